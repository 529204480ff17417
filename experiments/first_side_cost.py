"""Does the first drafter to decode in a process pay more than an identical second one?

    python -m experiments.first_side_cost --threads 2
    python -m experiments.first_side_cost --warm-prompts --warm-widths --warm-tokens 32

Two union drafters A and B with the same options (configs/drafter/union.yaml) decode the same
MT-bench prompts (16 x 32 tokens unless ``--prompts`` / ``--tokens`` say otherwise; batch 4,
bfloat16 invariant target) by turns with plain decoding; each call prints its wall, drafting and
target time. Before timing, every side decodes ``--warm-tokens`` tokens of 5 prompts (specdec-run's
warm-up); ``--warm-prompts`` also lets A prefill each prompt alone, and ``--warm-widths`` runs the
target untimed at every tree width 1-16 for batches 1-4. With ``ONEDNN_VERBOSE=profile_create`` in
the environment, oneDNN logs every kernel it builds (``cache_miss``) between the printed lines
(docs/NOTES.md, the first-drafter bias).
"""

from __future__ import annotations

import argparse
import time

import torch
from omegaconf import OmegaConf

from drafters.base import build
from experiments.run import CONFIG_DIR
from specdec import assets
from specdec.decode import SpecDecoder
from specdec.sampling import SamplingParams
from specdec.speedup import profile_forward
from specdec.target import HFTarget
from verifiers import reference

ORDER = ["base", "A", "B", "A", "B", "base", "B", "A"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warm-tokens", type=int, default=8)
    parser.add_argument("--warm-prompts", action="store_true")
    parser.add_argument("--warm-widths", action="store_true")
    parser.add_argument("--prompts", type=int, default=16, help="MT-bench prompts per call")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per prompt")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = assets.load_smollm2(torch.bfloat16)
    target = HFTarget(model, invariant=True)
    prompts = [assets.encode_prompt(tokenizer, p) for p in assets.load_mtbench(args.prompts)]
    options = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "drafter" / "union.yaml"))
    name = options.pop("name")
    decoders = {"base": SpecDecoder(target, None, reference.verify)}
    decoders |= {side: SpecDecoder(target, build(name, target, **options), reference.verify) for side in "AB"}
    greedy = SamplingParams(0.0)
    for decoder in decoders.values():
        decoder.generate(prompts[:5], args.warm_tokens, greedy, max_batch=4)
    if args.warm_prompts:  # one prompt per call: the head's catch-up meets each prompt's length as on admission
        for prompt in prompts:
            decoders["A"].generate([prompt], 1, greedy)
    if args.warm_widths:
        for batch in (1, 2, 3, 4):
            profile_forward(target, list(range(1, 17)), context_length=128, repeats=1, batch_size=batch)
    for side in ORDER:
        start = time.perf_counter()
        split = decoders[side].generate(prompts, args.tokens, greedy, max_batch=4).stats.time
        print(f"call {side:>4}: wall {time.perf_counter() - start:.2f} s, drafting {split.draft_s:.3f} s, "
              f"target {split.target_s:.2f} s", flush=True)


if __name__ == "__main__":
    main()
