"""Fit the calibration table of a budgeted union (drafters/union.py): how often a member's node of
a given depth and confidence is accepted.

    python -m experiments.calibrate_union --members configs/drafter/union_retrieval.yaml --prompts 64

``--target`` picks the packaged model (SmolLM2 by default; gemma3_270m): a table holds that model's
acceptance, and by default is written where the union looks for that target's tables at T = 0 or
T = 1 (drafters/checkpoints/union-calibration-<target>{,-t1}.json). Prompts are fed as the target's
config says (configs/target/<target>.yaml ``chat``: Gemma 3, a base model, reads them as raw text).
Decodes ShareGPT prompts (greedily unless --temperature is given: acceptance falls with T, so a
table fits the temperature it was fitted at) with the union verifying every member's node
(costs=null, record=true), so every node gets a label; then, per member and depth (1..4, deeper nodes with
depth 4), the acceptance rate in fixed confidence bins, shrunk toward that member and depth's mean
by one pseudo-observation and made non-decreasing in confidence (pool-adjacent-violators). The
prompts come from the end of the ShareGPT file (``--offset``), away from the conversations the
bundled heads were trained on (the first 6,000) and from MT-bench, where results are measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
import yaml

from drafters.union import CALIBRATED_DEPTHS, UnionDrafter, calibration_paths, confidence_bin
from experiments.common import prompt_sets
from specdec import packaged_models
from specdec.decode import SpecDecoder
from specdec.files import write_atomically
from specdec.sampling import SamplingParams
from specdec.target import HFTarget
from verifiers.reference import verify

EDGES = [0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0 + 1e-6]


def non_decreasing(values: list[float], weights: list[float]) -> list[float]:
    """The weighted least-squares non-decreasing fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight, size]
    for value, weight in zip(values, weights):
        blocks.append([value, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, w1, n1), (m2, w2, n2) = blocks.pop(-2), blocks.pop(-1)
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return [mean for mean, _, size in blocks for _ in range(size)]


def fit(records: list[tuple[int, int, float, bool]], num_members: int) -> tuple[list, list]:
    """(accept, count): [member][depth - 1][bin] acceptance rates and the records behind them."""
    bins = len(EDGES) - 1
    hits = [[[0] * bins for _ in range(CALIBRATED_DEPTHS)] for _ in range(num_members)]
    count = [[[0] * bins for _ in range(CALIBRATED_DEPTHS)] for _ in range(num_members)]
    for member, depth, confidence, hit in records:
        column = confidence_bin(EDGES, confidence)
        row = min(depth, CALIBRATED_DEPTHS) - 1
        hits[member][row][column] += int(hit)
        count[member][row][column] += 1
    accept = []
    for member in range(num_members):
        tables = []
        for row in range(CALIBRATED_DEPTHS):
            h, n = hits[member][row], count[member][row]
            mean = (sum(h) + 0.5) / (sum(n) + 1)  # a member that never drafted this deep: ~nothing known
            rates = [(hi + mean) / (ni + 1) for hi, ni in zip(h, n)]
            tables.append(non_decreasing(rates, [ni + 1 for ni in n]))
        accept.append(tables)
    return accept, count


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--members", default="configs/drafter/union_retrieval.yaml", help="a union drafter YAML")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--offset", type=int, default=10000, help="the first ShareGPT prompt used")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--target", default="smollm2", choices=sorted(packaged_models.PACKAGED_MODELS),
                        help="the packaged model whose acceptance the table holds")
    parser.add_argument("--out", default=None,
                        help="where to write the table (default: the target's bundled table for --temperature 0 or 1)")
    args = parser.parse_args(argv)
    bundled = dict(zip((0.0, 1.0), calibration_paths(args.target)))
    if args.out is None and args.temperature not in bundled:
        parser.error(f"--temperature {args.temperature}: no bundled table is read at it (the union reads T = 0 and T = 1 "
                     f"tables); pass --out PATH")
    destination = Path(args.out or bundled[args.temperature])
    torch.set_num_threads(args.threads)

    members = yaml.safe_load(Path(args.members).read_text())["members"]
    chat = prompt_sets.packaged_target_chat(args.target)
    model, tokenizer = packaged_models.load_packaged(args.target)
    target = HFTarget(model, packed_gemm_from="auto", key=args.target)
    # prompts of at most 400 tokens, as MT-bench's are: decoding stays cheap, the context typical
    sharegpt = prompt_sets.load_sharegpt()[args.offset :]
    encoded = (prompt_sets.encode_prompt(tokenizer, dataclasses.replace(p, chat=chat)) for p in sharegpt)
    prompts = [ids for ids in encoded if len(ids) <= 400][: args.prompts]
    if len(prompts) < args.prompts:
        parser.error(f"only {len(prompts)} short ShareGPT prompts from --offset {args.offset}; lower --offset or --prompts")
    union = UnionDrafter(target, members, record=True)
    started = time.perf_counter()
    out = SpecDecoder(target, union, verify).generate(
        prompts, args.max_new_tokens, SamplingParams(args.temperature), eos_token_id=tokenizer.eos_token_id, max_batch=4
    )
    accept, count = fit(union.records, len(members))
    table = {
        "members": members, "edges": EDGES, "accept": accept, "count": count,
        "source": f"ShareGPT prompts {args.offset}..{args.offset + args.prompts - 1}, {args.max_new_tokens} new tokens",
        "target": args.target,
        "temperature": args.temperature,
        "tau": out.stats.tau, "nodes": len(union.records),
    }
    write_atomically(destination, lambda staged: staged.write_text(json.dumps(table, indent=1) + "\n"))
    print(f"{destination}: {len(union.records)} nodes from {args.prompts} prompts, tau {out.stats.tau:.3f}, "
          f"{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
