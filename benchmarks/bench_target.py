"""T(n): wall time of one target forward over n tree tokens, the input of the speedup model.

    python -m benchmarks.bench_target --sizes 1 2 4 8 16 32 64 --context 256 --out tn.csv
    python -m benchmarks.bench_target --target gemma3_270m --sizes 1 2 4 8 16 32 --out tn-gemma.csv
    python -m benchmarks.bench_target --random llama3-8b --device cuda --dtype bfloat16 \
        --batch 8 --sizes 1 2 4 8 16 32 64 128 256 --context 512 --out tn-8b-b8.csv

Plain torch + transformers (no hydra/wandb), so it also runs on a bare GPU image. Default target:
SmolLM2 (``--target``: a packaged target or a model folder); ``--random`` builds a randomly initialised Llama of a named shape instead (T(n) depends
on the shapes, not the weights). ``--batch B`` times B requests with n rows each.

On a CPU it also measures, interleaved in the same process (so machine noise hits both alike):
the target with stock linear kernels (``stock``) and with packed GEMMs from ``--packed-gemm-from``
rows (``target``, specdec.cpu_kernels), and the bound each chases: the model's linear layers alone,
called in order on n rows with the same kernels (``stock_matmul``, ``matmul``).
"""

from __future__ import annotations

import argparse
import csv
import os
from collections.abc import Callable
from pathlib import Path

import torch

from specdec.cpu_kernels import PackedLinear, set_packed_from
from specdec.files import write_atomically
from specdec.speedup import chain_forward, median_seconds
from specdec.target import HFTarget
from specdec.target_loader import DTYPES, check_target_config, open_target, target_argument


# Llama shapes by name: (hidden, intermediate, layers, heads, key/value heads, vocabulary)
RANDOM_SHAPES = {
    "llama3-8b": (4096, 14336, 32, 32, 8, 128256),
    "llama3-1b": (2048, 8192, 16, 32, 8, 128256),
    "tiny": (64, 128, 2, 4, 2, 128),  # for tests
}


def random_llama(shape: str, dtype: torch.dtype, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM  # transformers' Llama model: ~2 s more, for --random alone

    hidden, intermediate, layers, heads, kv_heads, vocab = RANDOM_SHAPES[shape]
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                         max_position_embeddings=8192, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(config).to(dtype)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2", help="a packaged target (smollm2, gemma3_270m) or a Hugging Face model folder")
    parser.add_argument("--random", choices=sorted(RANDOM_SHAPES), help="a random-weight Llama of this shape instead")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=1, help="requests per forward, n rows each")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--context", type=int, default=256, help="committed tokens before the tree")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--packed-gemm-from", default="auto",
                        help="rows from which linears use packed GEMMs (CPU), or auto: the fastest threshold, timed here")
    parser.add_argument("--invariant", choices=("auto", "yes", "no"), default="auto",
                        help="rows computed as if alone (HFTarget; auto = in half precision on a CPU)")
    parser.add_argument("--out", default=None, help="CSV file to write (atomically)")
    args = parser.parse_args(argv)
    if 1 not in args.sizes:
        parser.error("--sizes must include 1: every ratio is T(n) / T(1)")
    if args.packed_gemm_from != "auto":
        if not args.packed_gemm_from.isdigit() or int(args.packed_gemm_from) < 1:
            parser.error(f"--packed-gemm-from takes an integer >= 1 or auto; got {args.packed_gemm_from!r}")
        args.packed_gemm_from = int(args.packed_gemm_from)
    if args.batch < 1:
        parser.error("--batch must be >= 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device here")
    invariant = {"auto": None, "yes": True, "no": False}[args.invariant]
    try:
        target_config = target_argument("--target", args.target, device=args.device, dtype=args.dtype,
                                        packed_gemm_from=args.packed_gemm_from, invariant=invariant)
        check_target_config(target_config)
    except ValueError as error:
        parser.error(str(error))
    torch.set_num_threads(args.threads)
    if args.random:
        model = random_llama(args.random, DTYPES[args.dtype], args.device)
        target = HFTarget(model, packed_gemm_from=args.packed_gemm_from, invariant=invariant)
    else:
        target = open_target(target_config, with_tokenizer=False).load()
        model = target.model
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]  # none off the CPU
    sizes = sorted(args.sizes)
    rows = measure(target, linears, sizes, args.context, args.repeats, args.batch)
    columns = list(rows[0])
    base = rows[0]
    print(f"{'n':>4} " + " ".join(f"{c + ' ms':>13} {'/T(1)':>6}" for c in columns))
    for n, row in zip(sizes, rows):
        print(f"{n:>4} " + " ".join(f"{row[c] * 1e3:>13.2f} {row[c] / base[c]:>6.2f}" for c in columns))
    if args.out:  # n, seconds, ratio: the target as configured (what specdec-run's budget.profile reads)
        extra = [c for c in columns if c != "target"]

        def write(path: Path) -> None:
            with path.open("w", newline="") as f:
                writer = csv.writer(f)
                writer.writerow(["n", "seconds", "ratio", *(f"{c}_{k}" for c in extra for k in ("seconds", "ratio")),
                                 "context", "batch", "device", "threads", "dtype", "packed_gemm_from", "invariant"])
                for n, row in zip(sizes, rows):
                    values = [v for c in ["target", *extra] for v in (row[c], row[c] / base[c])]
                    writer.writerow([n, *values, args.context, args.batch, device_name(target.device), args.threads,
                                     args.dtype, target.packed_gemm_from if linears and not target.invariant else "",
                                     target.invariant])

        write_atomically(Path(args.out), write)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def measure(
    target: HFTarget, linears: list[PackedLinear], sizes: list[int], context: int, repeats: int, batch: int = 1
) -> list[dict[str, float]]:
    """Median seconds of one forward over n rows for each of ``batch`` requests, per size and
    variant. All of them take turns within each round, so the machine's drift (tens of percent
    between runs minutes apart on these VMs) moves every size and variant alike."""
    generator = torch.Generator().manual_seed(0)
    target.prefill([torch.randint(0, target.vocab_size, (context,), generator=generator)] * batch, ())
    forwards = {n: chain_forward(target, n, generator) for n in sizes}
    if not linears:
        seconds = median_seconds({(n, "target"): forwards[n] for n in sizes}, repeats, target.device)
        return [{"target": seconds[(n, "target")]} for n in sizes]
    threshold = linears[0].from_rows

    def with_kernels(packed: bool, run: Callable[[], object]) -> Callable[[], None]:
        def timed() -> None:
            set_packed_from(target.model, threshold if packed else None)
            run()

        return timed

    def matmuls(n: int) -> Callable[[], None]:
        inputs = {m.in_features: torch.randn(batch, n, m.in_features, dtype=target.dtype) for m in linears}

        def run() -> None:
            with torch.no_grad():
                for m in linears:
                    m(inputs[m.in_features])

        return run

    kinds = ("stock", "target", "stock_matmul", "matmul")
    variants = {}
    for n in sizes:
        work = (forwards[n], forwards[n], matmuls(n), matmuls(n))
        for kind, run, packed in zip(kinds, work, (False, True, False, True)):
            variants[(n, kind)] = with_kernels(packed, run)
    seconds = median_seconds(variants, repeats, target.device)
    set_packed_from(target.model, threshold)
    return [{kind: seconds[(n, kind)] for kind in kinds} for n in sizes]


if __name__ == "__main__":
    main()
