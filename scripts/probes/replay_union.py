"""Probe: which way of merging EAGLE-3, the n-gram member and retrieval into one union would pay?
Replays each variant offline on a greedy run's outputs: tau, rows per step and the predicted
speedup, in about a minute.

    python -m scripts.probes.replay_union --run outputs/results/eagle-d1-mtbench80-t0 --profile docs/data/tn/tn-smollm2-cpu.csv

At T = 0 the output is fixed (plain decoding's, read from a specdec-run dir's prompts.jsonl), so a
deterministic tree's accepted length at any position is its longest path matching that output.
EAGLE-3 at depth 1 drafts from the target's features up to the root, which teacher forcing on
the output gives exactly (one target forward per prompt), so its top_k and their probabilities
are computed once; the n-gram and retrieval members draft from the text. The loop is then
replayed step by step for each variant, with the rows each step verifies priced by the T(n)
profile (T(n)/T(1) + c, c = --draft-cost). Used to choose the budgeted union's design
(docs/NOTES.md); the measured runs are in docs/RESULTS.md. A prediction, not a measurement: a
forecast counts as evidence only beside a measured run. Untested (scripts/probes/ is not part of
the package) and it reads UnionDrafter's internals (_budget, calibrations), so a changed union may
need it mended first (tests/test_replay_union.py at 70ac38e checked its plain union's tau against
the loop's).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import yaml

from drafters.base import build
from drafters.training.eagle_training import head_logits
from drafters.ngram import NgramIndex
from drafters.union import UnionDrafter
from experiments.common import prompt_sets
from specdec import packaged_models
from specdec.speedup import load_profile
from specdec.target import HFTarget


def eagle_top_k(target: HFTarget, drafter, sequences: list[list[int]], starts: list[int]) -> list[list[tuple[list[int], list[float]]]]:
    """Per sequence and answer position t: the head's top_k tokens for x_t and their probabilities."""
    result = []
    for sequence, start in zip(sequences, starts):
        top = head_logits(target, drafter, sequence).softmax(-1).topk(drafter.top_k, -1)  # row t -> x_{t+2}
        ids = drafter.head.draft_ids[top.indices]
        result.append([(ids[t - 2].tolist(), top.values[t - 2].tolist()) for t in range(start, len(sequence))])
    return result


def accepted_length(paths: list[list[int]], truth: list[int]) -> int:
    best = 0
    for path in paths:
        length = 0
        while length < min(len(path), len(truth)) and path[length] == truth[length]:
            length += 1
        best = max(best, length)
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="a greedy (T = 0) specdec-run dir on MT-bench: its prompts.jsonl outputs")
    parser.add_argument("--profile", default="docs/data/tn/tn-smollm2-cpu.csv", help="a T(n) CSV (benchmarks/bench_target.py --out)")
    parser.add_argument("--members", default="configs/drafter/union_retrieval.yaml",
                        help="a union YAML: eagle3 (depth 1), ngram, retrieval, and its calibration if it names one")
    parser.add_argument("--draft-cost", type=float, default=0.114, help="c, drafting time per step in T(1)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    config = yaml.safe_load(Path(args.members).read_text())
    members = {m["name"]: {k: v for k, v in m.items() if k != "name"} for m in config["members"]}
    if sorted(members) != ["eagle3", "ngram", "retrieval"] or members["eagle3"].get("depth") != 1:
        parser.error(f"{args.members}: the replay models a union of eagle3 (depth: 1), ngram and retrieval")
    rows = [json.loads(line) for line in (Path(args.run) / "prompts.jsonl").read_text().splitlines()]
    model, tokenizer = packaged_models.load_smollm2()
    target = HFTarget(model, packed_gemm_from="auto", key="smollm2")
    prompts = {p.id: p for p in prompt_sets.load_mtbench()}
    prompt_ids = [prompt_sets.encode_prompt(tokenizer, prompts[row["id"]]) for row in rows]
    sequences = [p + row["output"] for p, row in zip(prompt_ids, rows)]
    eagle = build("eagle3", target, **members["eagle3"])
    ngram = build("ngram", target, **members["ngram"])
    retrieval = build("retrieval", target, **members["retrieval"])
    eagle_drafts = eagle_top_k(target, eagle, sequences, [len(p) for p in prompt_ids])

    profile = load_profile(args.profile)
    # from the CSV's path, the union prices trees as a run would (a curve that dips by noise is made non-decreasing)
    union = UnionDrafter(target, config["members"], costs=args.profile, draft_cost=args.draft_cost,
                         calibration=config.get("calibration"), max_rows=config.get("max_rows", 16))
    calibration = min(union.calibrations, key=lambda table: table.temperature)  # T = 0
    lookup_s: list[float] = []  # retrieval's lookup + trie per request and step

    def replay(with_retrieval: bool, budgeted: bool) -> dict[str, float]:
        steps = generated = 0
        rows_total = cost = 0.0
        for sequence, start, eagle_steps in zip(sequences, (len(p) for p in prompt_ids), eagle_drafts):
            index = NgramIndex(ngram.min_ngram, ngram.max_ngram)
            index.extend(sequence[:start])
            t = start
            while t < len(sequence):
                tokens, probs = eagle_steps[t - start]
                nodes = [(0, (token,), p) for token, p in zip(tokens, probs)]
                for path, shares in zip(*ngram.branches(index)):
                    nodes += [(1, tuple(path[: d + 1]), shares[d]) for d in range(len(path))]
                if with_retrieval:
                    started = time.perf_counter()
                    drafted = retrieval.drafts(sequence[:t])
                    lookup_s.append(time.perf_counter() - started)
                    for path, scores in zip(*drafted):
                        nodes += [(2, tuple(path[: d + 1]), scores[d]) for d in range(len(path))]
                kept = union._budget(nodes, calibration)[0] if budgeted else [list(path) for _, path, _ in nodes]
                tree_rows = 1 + len({tuple(path[: d + 1]) for path in kept for d in range(len(path))})
                new = min(accepted_length(kept, sequence[t:]) + 1, len(sequence) - t)
                index.extend(sequence[t : t + new])
                t += new
                steps += 1
                generated += new
                rows_total += tree_rows
                cost += profile.time(tree_rows) / profile.time(1) + args.draft_cost
        return {"tau": generated / steps, "rows": rows_total / steps, "predicted_speedup": generated / cost}

    variants = {
        "union (EAGLE-3 + n-gram, every node)": (False, False),
        "+ retrieval, every node": (True, False),
        "budgeted, EAGLE-3 + n-gram": (False, True),
        "budgeted, EAGLE-3 + n-gram + retrieval": (True, True),
    }
    print(f"{len(sequences)} prompts from {args.run}, c = {args.draft_cost}, T(n) from {args.profile}")
    for label, (with_retrieval, budgeted) in variants.items():
        result = replay(with_retrieval, budgeted)
        print(f"{label:45s} tau {result['tau']:.3f}  rows {result['rows']:.2f}  predicted {result['predicted_speedup']:.3f}x")
    print(f"retrieval lookup + trie: {1e3 * sum(lookup_s) / len(lookup_s):.2f} ms per request and step (mean of {len(lookup_s)})")


if __name__ == "__main__":
    main()
