"""Verifier benchmark: time and effective bandwidth of the reference vs the Triton kernel.

A step is what the decode loop pays to verify: drawing the noise (``VerifyNoise.draw``: each
request's key and counter at T > 0, constants at T = 0) plus one verify call, its torch pre-pass
included (the reference's greedy argmax over every row; top-k's and top-p's cuts; the kernel
computes p, or greedy's argmax, for the rows a walk visits, and the reference p likewise);
both are timed, apart and together. The kernel is timed both ways it can get a visited row's
statistics (max, mass, argmax): ``triton-walk`` computes them in the walk's own block,
``triton-split`` in a pre-pass over every row with V split across blocks (verifiers/triton_rows.py),
so a GPU run shows where ``triton_rows.splits`` should switch. The noise's values are hashed where they are read: by the
reference inside its verify call (N + 1 uniforms per request), by the Triton kernel for the nodes
its walk tries. Effective bandwidth = bytes of the step's inputs (target logits [B, N+1, V], and
draft probabilities [B, N, V] where a sampled tree at T > 0 is tested against them) / the step's
time: a yardstick the same for every verifier, above what a walk that visits few rows reads. On a GPU the device's
copy bandwidth (read + write of a large buffer) is measured too, as the ceiling to compare with,
and one forward of a Llama-3-8B-shaped layer stack with random bf16 weights over the same B x (N+1)
tree tokens, for scale (attention sees only the tree tokens, no KV prefix: at these sizes the
forward is bound by reading the 16 GB of weights).

Plain torch + triton (no hydra/wandb/datasets), so it runs on a bare GPU image:

    python -m benchmarks.bench_verify                # GPU: the full grid, forward included
    python -m benchmarks.bench_verify --quick        # CPU smoke run: small shapes; the Triton
                                                      # kernel only with TRITON_INTERPRET=1
"""

from __future__ import annotations

import argparse
import csv
import functools
import itertools
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.noise import RequestRNG, VerifyNoise
from specdec.sampling import SamplingParams, probabilities
from specdec.tree import DraftTree, SiblingMode
from verifiers import reference

COLUMNS = (
    "device", "logits_dtype", "mode", "temperature", "batch", "nodes", "vocab", "verifier",
    "noise_ms", "verify_ms", "step_ms", "gb_per_s", "of_copy", "forward_ms", "step_over_forward",
)


@dataclass(frozen=True)
class LlamaShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int


LLAMA3_8B = LlamaShape(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256)
TINY_LLAMA = LlamaShape(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=1000)


def bench_inputs(
    batch: int, nodes: int, vocab: int, mode: SiblingMode, sampling: SamplingParams,
    logits_dtype: torch.dtype, device: torch.device,
) -> tuple[DraftTree, torch.Tensor, VerifyNoise]:
    """A random bushy tree (parents[i] uniform in [-1, i)) whose drafts resemble the target, so
    that walks go past the root as in real use."""
    g = torch.Generator(device=device).manual_seed(0)
    own = torch.arange(nodes, device=device)
    parents = (torch.rand(nodes, generator=g, device=device) * (own + 1)).long() - 1
    parents = parents.expand(batch, nodes).contiguous()  # [B, N]
    target_logits = 3 * torch.randn(batch, nodes + 1, vocab, generator=g, device=device)
    blurred = target_logits[:, parents[0] + 1] + torch.randn(batch, nodes, vocab, generator=g, device=device)
    draft_probs = probabilities(blurred, sampling if not sampling.greedy else SamplingParams(1.0))
    tokens = torch.multinomial(draft_probs.reshape(-1, vocab), 1, generator=g).reshape(batch, nodes)
    tree = DraftTree(
        tokens=tokens,
        parents=parents,
        draft_probs=None if mode is SiblingMode.DETERMINISTIC else draft_probs,
        num_nodes=torch.full((batch,), nodes, device=device),
        mode=mode,
    )
    noise = VerifyNoise.draw(RequestRNG(torch.arange(batch, device=device)), nodes)
    return tree, target_logits.to(logits_dtype), noise


def input_bytes(tree: DraftTree, target_logits: torch.Tensor, sampling: SamplingParams) -> int:
    """What any exact verifier must read: every row of the logits (which rows the walk visits is
    known only as it goes), and q for a sampled tree at T > 0 (greedy never reads it)."""
    drafts = tree.draft_probs
    draft = 0 if drafts is None or sampling.greedy else drafts.numel() * drafts.element_size()
    return target_logits.numel() * target_logits.element_size() + draft


def seconds(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median wall time of fn after one warm-up call (which compiles kernels)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def verify_step(verify: Callable, tree: DraftTree, logits: torch.Tensor, sampling: SamplingParams,
                draw: Callable[[], VerifyNoise]) -> object:
    """What the decode loop pays per step: the noise, then the verify call."""
    return verify(tree, logits, sampling, draw())


def copy_bandwidth(num_bytes: int, repeats: int, device: torch.device) -> float:  # bytes/s
    source = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return 2 * num_bytes / seconds(lambda: target.copy_(source), repeats, device)


class RandomLlama:
    """A Llama layer stack with random weights: only its cost matters, not its outputs."""

    def __init__(self, shape: LlamaShape, dtype: torch.dtype, device: torch.device) -> None:
        self.shape = shape
        head_dim = shape.hidden // shape.heads

        def weight(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, dtype=dtype, device=device) * cols**-0.5

        qkv_rows = (shape.heads + 2 * shape.kv_heads) * head_dim
        self.layers = [
            (weight(qkv_rows, shape.hidden), weight(shape.hidden, shape.hidden),
             weight(2 * shape.ffn, shape.hidden), weight(shape.hidden, shape.ffn))
            for _ in range(shape.layers)
        ]
        self.lm_head = weight(shape.vocab, shape.hidden)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, T, H] -> [B, T, vocab]
        s = self.shape
        batch, length, _ = hidden.shape
        head_dim = s.hidden // s.heads
        for qkv_weight, out_weight, up_weight, down_weight in self.layers:
            qkv = F.linear(F.rms_norm(hidden, (s.hidden,)), qkv_weight)
            q, k, v = qkv.split([s.heads * head_dim, s.kv_heads * head_dim, s.kv_heads * head_dim], -1)
            q = q.view(batch, length, s.heads, head_dim).transpose(1, 2)
            k = k.view(batch, length, s.kv_heads, head_dim).transpose(1, 2)
            v = v.view(batch, length, s.kv_heads, head_dim).transpose(1, 2)
            k = k.repeat_interleave(s.heads // s.kv_heads, dim=1)
            v = v.repeat_interleave(s.heads // s.kv_heads, dim=1)
            attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            hidden = hidden + F.linear(attention.transpose(1, 2).reshape(batch, length, -1), out_weight)
            gate, up = F.linear(F.rms_norm(hidden, (s.hidden,)), up_weight).chunk(2, dim=-1)
            hidden = hidden + F.linear(F.silu(gate) * up, down_weight)
        return F.linear(F.rms_norm(hidden, (s.hidden,)), self.lm_head)


def write_csv_atomically(path: Path, rows: list[dict]) -> None:
    """A reader never sees half a file: write a temporary file beside it, then rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with temporary.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(temporary, path)


def print_table(rows: list[dict]) -> None:
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in COLUMNS}
    print("  ".join(c.rjust(widths[c]) for c in COLUMNS))
    for row in rows:
        print("  ".join(str(row[c]).rjust(widths[c]) for c in COLUMNS))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 32, 64])
    # Llama 2, SmolLM2, Llama 3, Qwen 2.5, Gemma 3 (the packaged target=gemma3_270m)
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 49152, 128256, 151936, 262144])
    parser.add_argument("--mode", choices=[m.value for m in SiblingMode], default="sampled_iid")
    parser.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0], help="0 = greedy")
    parser.add_argument("--logits-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--csv", type=Path, default=Path("bench_verify.csv"))
    parser.add_argument("--no-forward", action="store_true", help="skip the 8B-shaped forward")
    parser.add_argument("--quick", action="store_true", help="small shapes for a CPU smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.nodes, args.vocab, args.repeats = [1, 3], [4], [1000], 2
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    candidates = {"reference": reference.verify}
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        from verifiers import triton_tree  # imports triton: only where it can run

        # both ways of getting the visited rows' statistics, whichever triton_rows.splits would pick
        candidates["triton-walk"] = functools.partial(triton_tree.verify, split=False)
        candidates["triton-split"] = functools.partial(triton_tree.verify, split=True)
    # the 8B stack needs ~16 GB of weights: a tiny stack only proves the code path runs
    llama_shape = LLAMA3_8B if device.type == "cuda" and not args.quick else TINY_LLAMA
    llama_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    llama = None if args.no_forward else RandomLlama(llama_shape, llama_dtype, device)
    copy_bytes = 1 << 30 if device.type == "cuda" else 1 << 24
    copy = copy_bandwidth(copy_bytes, args.repeats, device)
    print(f"device {device}: copy bandwidth {copy / 1e9:.1f} GB/s; verifiers {', '.join(candidates)}")

    mode = SiblingMode(args.mode)
    logits_dtype = getattr(torch, args.logits_dtype)
    rows = []
    for batch in args.batch:
        for nodes in args.nodes:
            forward = math.nan
            if llama is not None:
                hidden = torch.randn(batch, nodes + 1, llama_shape.hidden, dtype=llama_dtype, device=device)
                with torch.inference_mode():
                    forward = seconds(lambda: llama.forward(hidden), args.repeats, device)
            for vocab, temperature in itertools.product(args.vocab, args.temperature):
                sampling = SamplingParams(temperature)
                tree, logits, _ = bench_inputs(batch, nodes, vocab, mode, sampling, logits_dtype, device)
                rng = RequestRNG(torch.arange(batch, device=device))

                def draw() -> VerifyNoise:
                    return VerifyNoise.draw(rng, nodes, greedy=sampling.greedy)

                noise = draw()
                noise_time = seconds(draw, args.repeats, device)
                num_bytes = input_bytes(tree, logits, sampling)
                for name, verify in candidates.items():
                    verify_time = seconds(functools.partial(verify, tree, logits, sampling, noise), args.repeats, device)
                    step = seconds(functools.partial(verify_step, verify, tree, logits, sampling, draw), args.repeats, device)
                    rows.append({
                        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                        "logits_dtype": args.logits_dtype,
                        "mode": mode.value,
                        "temperature": temperature,
                        "batch": batch,
                        "nodes": nodes,
                        "vocab": vocab,
                        "verifier": name,
                        "noise_ms": f"{noise_time * 1e3:.4g}",
                        "verify_ms": f"{verify_time * 1e3:.4g}",
                        "step_ms": f"{step * 1e3:.4g}",
                        "gb_per_s": f"{num_bytes / step / 1e9:.4g}",
                        "of_copy": f"{num_bytes / step / copy:.3f}",
                        "forward_ms": f"{forward * 1e3:.4g}",
                        "step_over_forward": f"{step / forward:.4f}",
                    })
                del tree, logits, noise
    print_table(rows)
    write_csv_atomically(args.csv, rows)
    print(f"wrote {args.csv}")
    return rows


if __name__ == "__main__":
    main()
