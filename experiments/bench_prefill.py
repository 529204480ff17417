"""Prefill time of one prompt of each length on SmolLM2, for float32 and bfloat16 targets.

    python -m experiments.bench_prefill --threads 2 --lengths 40 100 200

Medians of ``--repeats`` prefills of one random prompt after a warm-up, the targets timed one
after another in one process. bfloat16 is timed with invariant kernels (``bf16-invariant``, what
target=smollm2_bf16 runs) and with stock kernels (``bf16-stock``).
"""

from __future__ import annotations

import argparse

import torch

from specdec import assets
from specdec.speedup import median_seconds
from specdec.target import HFTarget

TARGETS = {"fp32": (torch.float32, None), "bf16-invariant": (torch.bfloat16, True), "bf16-stock": (torch.bfloat16, False)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[40, 100, 200])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    prompts = {n: [torch.randint(0, 49152, (n,), generator=generator)] for n in args.lengths}
    print(f"{'target':>16} " + " ".join(f"{n:>8}" for n in args.lengths) + "   (prompt tokens; ms per prefill)")
    for name, (dtype, invariant) in TARGETS.items():
        target = HFTarget(assets.load_smollm2(dtype)[0], invariant=invariant)
        seconds = median_seconds({n: lambda p=p: target.prefill(p, ()) for n, p in prompts.items()}, args.repeats,
                                 target.device)
        print(f"{name:>16} " + " ".join(f"{seconds[n] * 1000:8.1f}" for n in args.lengths))


if __name__ == "__main__":
    main()
