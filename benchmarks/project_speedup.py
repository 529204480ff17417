"""Projected speedup on other hardware: a T(n) profile measured there (bench_target --out) and the
acceptance a drafter measured here (a specdec-run results.json), through the analytic model.

    python -m benchmarks.bench_target --out tn-b1.csv                  # on the other machine
    python -m benchmarks.project_speedup --acceptance docs/data/training-free/t0_256.results.json \\
        --profile tn-b1.csv docs/data/tn/tn-smollm2-cpu.csv --draft-cost 0.05

For each profile: the tree budget (depth, nodes) that maximises predicted tokens/s, its tau and
its speedup over plain decoding at that profile's batch size. The drafter's time per drafting pass
on that hardware is not measured here: ``--draft-cost`` gives it as a fraction of the profile's
T(1) (an EAGLE head is one decoder layer: ~1/L of a forward plus its LM-head slice).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdec.speedup import choose_tree_budget, load_profile, measured_alphas, rank_share


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--acceptance", required=True, help="results.json of a specdec-run of the drafter")
    parser.add_argument("--profile", required=True, nargs="+", help="T(n) CSVs from benchmarks.bench_target")
    parser.add_argument("--draft-cost", type=float, required=True, help="one drafting pass, as a fraction of T(1)")
    parser.add_argument("--max-depth", type=int, default=8)
    parser.add_argument("--max-nodes", type=int, default=64)
    args = parser.parse_args(argv)
    if args.draft_cost < 0:
        parser.error("--draft-cost must be >= 0")
    try:
        results = json.loads(Path(args.acceptance).read_text())
        measured, histogram = results["per_depth_alpha"], results.get("accepted_rank_histogram", [])
        attempts = results.get("per_depth_attempts")
    except (OSError, ValueError, KeyError) as error:
        parser.error(f"--acceptance {args.acceptance}: not a specdec-run results.json with per_depth_alpha ({error})")
    if not measured:
        parser.error(f"--acceptance {args.acceptance}: that run measured no acceptance (no draft was ever tried)")
    alpha, share = measured_alphas(measured, attempts), rank_share(histogram)
    first, last = len(alpha) + 1, len(measured)
    dropped = "" if first > last else f" (depth {first}{'' if first == last else f'-{last}'} dropped: too few attempts)"
    print(f"acceptance from {args.acceptance}: alpha per depth {[round(a, 3) for a in alpha]}{dropped}, "
          f"sibling-rank share {[round(s, 3) for s in share]}")
    print(f"{'profile':<40} {'batch':>5} {'T(1) ms':>8} {'depth':>5} {'nodes':>5} {'tau':>6} "
          f"{'T(n+1)/T(1)':>11} {'speedup':>8}")
    for path in args.profile:
        profile = load_profile(path)
        t1 = profile.time(1)
        nodes = min(args.max_nodes, max(profile.sizes) - 1)
        best = choose_tree_budget(profile, alpha, args.draft_cost * t1, share, args.max_depth, nodes).best
        ratio = profile.time(best.num_nodes + 1) / t1
        print(f"{Path(path).name:<40} {profile.batch_size:>5} {t1 * 1e3:>8.2f} {best.depth:>5} {best.num_nodes:>5} "
              f"{best.tau:>6.3f} {ratio:>11.3f} {best.speedup:>7.3f}x")


if __name__ == "__main__":
    main()
