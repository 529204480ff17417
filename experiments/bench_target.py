"""T(n): wall time of one target forward over n tree tokens, the input of the speedup model.

    python -m experiments.bench_target --sizes 1 2 4 8 16 32 64 --context 256 --out tn.csv

Plain torch (no hydra/wandb), so it also runs on a bare GPU image. Default target: SmolLM2.
"""

from __future__ import annotations

import argparse
import csv
import os
import tempfile

import torch

from specdec.speedup import profile_forward
from specdec.target import HFTarget


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="'smollm2' or a Hugging Face model folder")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--context", type=int, default=256, help="committed tokens before the tree")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", default=None, help="CSV file to write (atomically)")
    args = parser.parse_args(argv)
    if 1 not in args.sizes:
        parser.error("--sizes must include 1: every ratio is T(n) / T(1)")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if args.model == "smollm2":
        from specdec.assets import load_smollm2

        model = load_smollm2(dtype)[0]
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    profile = profile_forward(HFTarget(model), sorted(args.sizes), args.context, args.repeats)
    ratios = profile.ratios()
    print(f"{'n':>5} {'T(n) ms':>10} {'T(n)/T(1)':>10}")
    for n, seconds in zip(profile.sizes, profile.seconds):
        print(f"{n:>5} {seconds * 1e3:>10.2f} {ratios[n]:>10.2f}")
    if args.out:
        directory = os.path.dirname(os.path.abspath(args.out))
        with tempfile.NamedTemporaryFile("w", dir=directory, delete=False, suffix=".tmp", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["n", "seconds", "ratio", "context", "threads", "dtype"])
            for n, seconds in zip(profile.sizes, profile.seconds):
                writer.writerow([n, seconds, ratios[n], args.context, args.threads, args.dtype])
        os.replace(f.name, args.out)


if __name__ == "__main__":
    main()
