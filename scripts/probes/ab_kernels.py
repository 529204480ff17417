"""Probe: which of specdec.cpu_kernels' choices makes the real decode loop faster on this machine?
A/B'd in one process, since this VM's speed drifts between processes by more than the effects.

    python -m scripts.probes.ab_kernels --drafter eagle2 --option depth=2 top_k=2 total_tokens=4 --prompts 16
    python -m scripts.probes.ab_kernels --variants both dynamic-cache --batch 4 --prompts 16
    python -m scripts.probes.ab_kernels --drafter configs/drafter/union.yaml --variants both dynamic-cache --batch 4
    python -m scripts.probes.ab_kernels --drafter configs/drafter/union_retrieval.yaml --variants both --batch 4 --group 20

Variants: {transformers' SDPA, grouped-query SDPA} x {MKL GEMMs, packed oneDNN GEMMs from the row count HFTarget's auto picks},
all on specdec's in-place KV cache, and "dynamic-cache": grouped SDPA and packed GEMMs on
transformers' DynamicCache (which appends by concatenation).
``--drafter`` is a registered name (with ``--option`` integers) or a drafter YAML such as
configs/drafter/union.yaml (null options take the factory's defaults; ``${batch_size}`` is
``--batch``). Each decodes every MT-bench prompt plainly and speculatively (greedy, SmolLM2),
``--batch`` prompts at a time, groups of ``--group`` prompts (continuous batching). Group by group the
variants take turns in rotating order, so machine noise hits all alike; printed: total plain and
speculative seconds per variant and their ratio (the speedup).
Untested (scripts/probes/ is not part of the package): kept for the next kernel choice, it may
need mending to the current API first. Findings: docs/RESULTS.md and docs/NOTES.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from drafters.base import build
from experiments.common.prompt_sets import encode_prompt, load_mtbench
from specdec.cpu_kernels import GROUPED_ATTENTION, set_packed_from
from specdec.decode import SpecDecoder
from specdec.kv_cache import growing_cache
from specdec.packaged_models import load_smollm2
from specdec.sampling import SamplingParams
from specdec.target import HFTarget
from verifiers import reference

VARIANTS = {  # name: (attention implementation, packed GEMMs, KV cache factory)
    "stock": ("sdpa", False, growing_cache),
    "grouped": (GROUPED_ATTENTION, False, growing_cache),
    "packed": ("sdpa", True, growing_cache),
    "both": (GROUPED_ATTENTION, True, growing_cache),
    "dynamic-cache": (GROUPED_ATTENTION, True, DynamicCache),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default="eagle3")
    parser.add_argument("--option", nargs="*", default=[], help="drafter options as name=integer")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1, help="prompts decoded together")
    parser.add_argument("--group", type=int, default=None, help="prompts per group (default --batch)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=["stock", "grouped", "packed", "both"])
    args = parser.parse_args(argv)
    try:
        options = {name: int(value) for name, value in (o.split("=") for o in args.option)}
    except ValueError:
        parser.error(f"--option takes name=integer pairs; got {args.option}")
    name = args.drafter
    if name.endswith(".yaml"):
        from omegaconf import OmegaConf

        loaded = OmegaConf.create({"batch_size": args.batch, "drafter": OmegaConf.load(Path(name))})
        config = OmegaConf.to_container(loaded, resolve=True)["drafter"]
        name = config.pop("name")
        options = {**{k: v for k, v in config.items() if v is not None}, **options}
    torch.set_num_threads(args.threads)
    model, tokenizer = load_smollm2()
    target = HFTarget(model, packed_gemm_from="auto", key="smollm2")  # as configs/target/smollm2.yaml
    packed_from = target.packed_gemm_from
    print(f"packed GEMMs from {packed_from} rows (timed on this machine)")
    decoders = {
        "plain": SpecDecoder(target, None, reference.verify),
        "spec": SpecDecoder(target, build(name, target, **options), reference.verify),
    }
    prompts = [encode_prompt(tokenizer, p) for p in load_mtbench(args.prompts)]
    size = args.group or args.batch
    groups = [prompts[i : i + size] for i in range(0, len(prompts), size)]
    greedy = SamplingParams(0.0)

    def use(variant: str) -> None:
        attention, packed, cache = VARIANTS[variant]
        model.set_attn_implementation(attention)
        set_packed_from(model, packed_from if packed else None)
        target.new_cache = cache

    for decoder in decoders.values():  # warm-up
        decoder.generate(groups[0][: args.batch], 8, greedy)
    names = args.variants
    seconds = {(v, d): 0.0 for v in names for d in decoders}
    for i, group in enumerate(groups):
        for variant in names[i % len(names):] + names[: i % len(names)]:
            use(variant)
            for kind in ("plain", "spec") if i % 2 else ("spec", "plain"):
                start = time.perf_counter()
                decoders[kind].generate(group, args.tokens, greedy, eos_token_id=tokenizer.eos_token_id, max_batch=args.batch)
                seconds[(variant, kind)] += time.perf_counter() - start
    for v in names:
        plain, spec = seconds[(v, "plain")], seconds[(v, "spec")]
        print(f"{v:8s} plain {plain:7.2f} s  speculative {spec:7.2f} s  speedup {plain / spec:.3f}")


if __name__ == "__main__":
    main()
