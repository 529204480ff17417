"""The report's markdown tables: the runs compared, and tau by category, per depth, survival, sibling
rank and the time split, one row per run."""

from __future__ import annotations

from experiments.analyze.findings import TIME_PARTS, RunAnalysis
from experiments.common.formatting import markdown_table, with_interval


def with_drafter(a: RunAnalysis) -> str:
    return a.label if a.drafter in a.label else f"{a.label} ({a.drafter})"


COMPARISON_HEADER = [
    "run", "drafter", "workload", "T", "prompts x passes", "tau [95% interval]", "tau from alpha",
    "speedup measured [95% interval]", "speedup predicted", "c", "T(n)/T(1)", "tree nodes", "overhead share",
    "greedy equal",
]


def comparison_rows(analyses: list[RunAnalysis]) -> list[list[str]]:
    return [
        [
            a.label, a.drafter, a.workload, f"{a.temperature:g}", f"{a.num_prompts} x {a.repeats}",
            with_interval(a.tau, a.tau_interval, digits=2, missing=""), f"{a.tau_from_alpha:.2f}",
            with_interval(a.speedup, a.speedup_interval, "x", digits=2, missing=""), f"{a.predicted_speedup:.2f}x",
            f"{a.drafter_cost_ratio:.3f}",
            f"{a.target_time_ratio:.2f}", f"{a.mean_tree_nodes:.1f}", f"{a.overhead_share:.0%}",
            {True: "yes", False: "NO", None: "n/a"}[a.greedy_equal] + (" (logits)" if a.contract == "logits" else ""),
        ]
        for a in analyses
    ]


def categories_of(analyses: list[RunAnalysis]) -> list[str]:
    return sorted({name for a in analyses if a.category_tau for name in a.category_tau})


def category_table(analyses: list[RunAnalysis]) -> str:
    names = categories_of(analyses)
    rows = [
        [with_drafter(a)]
        + [f"{a.category_tau[n].tau:.2f} ({a.category_tau[n].prompts})" if n in a.category_tau else "-" for n in names]
        for a in analyses if a.category_tau
    ]
    return markdown_table(["run (drafter)", *names], rows)


def depth_table(analyses: list[RunAnalysis]) -> str:
    depth = max(len(a.per_depth_alpha) for a in analyses)
    rows = [
        [a.label] + [f"{a.per_depth_alpha[d]:.2f} ({a.per_depth_attempts[d]})" if d < len(a.per_depth_alpha) else "-"
                     for d in range(depth)]
        for a in analyses
    ]
    return markdown_table(["run", *[f"alpha_{d + 1} (attempts)" for d in range(depth)]], rows)


def survival_table(analyses: list[RunAnalysis]) -> str:
    depth = max(len(a.survival) for a in analyses)
    rows = [[a.label] + [f"{a.survival[d]:.2f}" if d < len(a.survival) else "0.00" for d in range(1, depth)]
            for a in analyses]
    return markdown_table(["run", *[f"P(>= {d})" for d in range(1, depth)]], rows)


def rank_table(analyses: list[RunAnalysis]) -> str:
    recorded = [a for a in analyses if a.rank_shares is not None]
    width = max((len(a.rank_shares) for a in recorded), default=0)
    rows = [[a.label] + [f"{a.rank_shares[r]:.0%}" if r < len(a.rank_shares) else "0%" for r in range(width)]
            for a in recorded]
    return markdown_table(["run", *[f"rank {r}" for r in range(width)]], rows)


def time_table(analyses: list[RunAnalysis]) -> str:
    rows = [
        [a.label, f"{1000 * a.one_forward_s:.2f}", f"{1000 * a.tree_forward_s:.2f}"]
        + [f"{1000 * a.time_per_step_s[p]:.2f} ({a.time_shares[p]:.0%})" for p in TIME_PARTS]
        for a in analyses
    ]
    return markdown_table(["run", "T(1) ms", "T(n) ms", *[f"{p} ms/step (share)" for p in TIME_PARTS]], rows)

