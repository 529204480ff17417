"""Probe: where does a decode step's time go? cProfile of plain decoding and of one drafter on SmolLM2.

    python -m scripts.probes.profile_step --drafter union --prompts 8 --tokens 32

Each side first decodes 2 prompts untimed, then its ``--prompts`` MT-bench prompts one at a time
(batch 1) under cProfile; printed per side: the loop's time split and the step's functions in
specdec/ and verifiers/ by cumulative time, with ms per step (``commit``: the target's KV-cache
bookkeeping, docs/NOTES.md). bfloat16 invariant target unless ``--dtype float32``.
Untested (scripts/probes/ is not part of the package); its before/after profiles are in
docs/RESULTS.md.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
from pathlib import Path

import torch
from omegaconf import OmegaConf

from drafters.base import build
from experiments.common import prompt_sets
from specdec import packaged_models
from specdec.decode import SpecDecoder
from specdec.sampling import SamplingParams
from specdec.target import HFTarget
from verifiers import reference

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default="union", help="a config name under configs/drafter/")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = packaged_models.load_smollm2(getattr(torch, args.dtype))
    target = HFTarget(model, packed_gemm_from="auto", invariant=args.dtype == "bfloat16", key="smollm2")  # as configs/target/ picks
    prompts = [prompt_sets.encode_prompt(tokenizer, p) for p in prompt_sets.load_mtbench(args.prompts)]
    options = OmegaConf.load(CONFIG_DIR / "drafter" / f"{args.drafter}.yaml")
    if "cost_batch" in options:
        options.cost_batch = 1
    options = OmegaConf.to_container(options, resolve=True)
    name = options.pop("name")
    greedy = SamplingParams(0.0)
    for label, drafter in (("plain", None), (args.drafter, build(name, target, **options))):
        decoder = SpecDecoder(target, drafter, reference.verify)
        decoder.generate(prompts[:2], 8, greedy)
        profile = cProfile.Profile()
        profile.enable()
        generation = decoder.generate(prompts, args.tokens, greedy, max_batch=1)
        profile.disable()
        steps = len(generation.steps)
        print(f"== {label}: {steps} steps, {generation.stats.time}")
        stats = pstats.Stats(profile).sort_stats("cumulative")
        for path, line, function in stats.fcn_list:  # by cumulative time
            _, calls, _, cumulative, _ = stats.stats[(path, line, function)]
            if ("specdec/" in path or "verifiers/" in path) and cumulative * 1000 / steps >= 0.05:
                print(f"{cumulative * 1000 / steps:9.3f} ms/step {calls:7d} calls  {path.split('/')[-2]}/{path.split('/')[-1]}:{line}({function})")


if __name__ == "__main__":
    main()
