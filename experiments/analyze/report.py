"""What the analysis writes: the plots, report.md, and the tables and plots logged to an offline W&B run."""

from __future__ import annotations

from pathlib import Path

from experiments.analyze.discover import RunFiles, override_value, unfinished_runs
from experiments.analyze.findings import (
    TIME_PARTS,
    RunAnalysis,
    cross_run_findings,
    run_findings,
    short_names,
    varying_overrides,
)
from experiments.analyze.tables import (
    COMPARISON_HEADER,
    categories_of,
    category_table,
    comparison_rows,
    depth_table,
    rank_table,
    survival_table,
    time_table,
    with_drafter,
)
from experiments.common import plots
from experiments.common.formatting import markdown_table
from experiments.common.sinks import log_offline_run

TIME_PART_NAMES = {
    "prefill": "prefill", "draft": "draft", "target": "target forward", "verify": "verify", "other": "loop overhead"
}
PER_RUN_FINDINGS_LIMIT = 6  # beyond this many runs the report keeps to cross-run findings and tables


# -- plots ------------------------------------------------------------------------------------------


def make_plots(analyses: list[RunAnalysis], runs: list[RunFiles]) -> dict[str, bytes]:
    """File name -> PNG bytes."""
    pngs = {
        "per_depth_acceptance.png": plots.lines_png(
            {a.label: (list(range(1, len(a.per_depth_alpha) + 1)), a.per_depth_alpha) for a in analyses},
            "Conditional acceptance per draft depth", "draft depth d", "alpha_d = P(accept at d | reached d-1)",
            ylim=(0, 1.05), integer_x=True,
        ),
        "survival.png": plots.lines_png(
            {a.label: (list(range(len(a.survival))), a.survival) for a in analyses},
            "Survival: how far the accepted path reaches", "d (accepted drafts)", "P(accepted drafts >= d)",
            ylim=(0, 1.05), integer_x=True,
        ),
        "time_split.png": plots.stacked_shares_png(
            [a.label for a in analyses],
            {TIME_PART_NAMES[p]: [a.time_shares[p] for a in analyses] for p in TIME_PARTS},
            "Where speculative decoding spends its time", "share of speculative wall time (%)",
        ),
        "speedup.png": plots.grouped_bars_png(
            [a.label for a in analyses],
            {"measured": [a.speedup for a in analyses], "predicted tau*T(1)/(T(n)+T_draft)":
             [a.predicted_speedup for a in analyses]},
            "Speedup over plain decoding: measured vs analytic", "run", "speedup (x)",
            reference=(1.0, "break-even"),
        ),
    }
    ranked = [a for a in analyses if a.rank_shares]
    if ranked:
        width = max(len(a.rank_shares) for a in ranked)
        pngs["sibling_rank.png"] = plots.grouped_bars_png(
            [f"rank {r}" for r in range(width)],
            {a.label: a.rank_shares + [0.0] * (width - len(a.rank_shares)) for a in ranked},
            "Which sibling was accepted (0 = drafter's first choice)", "sibling rank of the accepted node",
            "share of accepted nodes",
        )
    with_steps = [a for a in analyses if a.category_tau is not None]
    if with_steps:
        names = categories_of(with_steps)
        pngs["tau_by_category.png"] = plots.heatmap_png(
            [with_drafter(a) for a in with_steps], names,
            [[a.category_tau[n].tau if n in a.category_tau else None for n in names] for a in with_steps],
            "tau by run (drafter) x workload category", "tau (tokens per target forward)",
        )
        pngs["acceptance_by_position.png"] = plots.lines_png(
            {a.label: (a.position.bin_starts, a.position.tau) for a in with_steps},
            f"Acceptance along the output (bins of {with_steps[0].position.bin_width} tokens; the last steps, "
            "whose drafts\nare cut to the token budget, are left out)",
            "output position (tokens generated before the step)", "tau (tokens per target forward)",
        )
        pngs["tau_vs_prompt_length.png"] = plots.scatter_png(
            {a.label: (a.prompt_tokens, a.prompt_tau) for a in with_steps},
            "tau per prompt vs prompt length", "prompt length (tokens)", "tau (tokens per target forward)",
        )
    sweep = sweep_series(analyses, runs)
    if sweep is not None:
        key, series = sweep
        pngs["sweep.png"] = plots.sweep_png(series, f"Sweep over {key}", key)
    return pngs


def sweep_series(analyses: list[RunAnalysis], runs: list[RunFiles]):
    """(key, label -> (x, tau, measured, predicted)) over the first numeric override that varies,
    one series per setting of the other varying overrides; None when no numeric override varies."""
    keys = varying_overrides(runs)
    numeric = [k for k in keys if all(_is_number(override_value(r, k)) for r in runs)]
    if not numeric:
        return None
    key, others = numeric[0], [k for k in keys if k != numeric[0]]
    names = short_names(keys)
    points: dict[str, list[tuple[float, RunAnalysis]]] = {}
    for run, analysis in zip(runs, analyses):
        group = " ".join(f"{names[k]}={override_value(run, k)}" for k in others) or analysis.drafter
        points.setdefault(group, []).append((float(override_value(run, key)), analysis))
    series = {}
    for group, members in points.items():
        members.sort(key=lambda item: item[0])
        series[group] = (
            [x for x, _ in members], [a.tau for _, a in members], [a.speedup for _, a in members],
            [a.predicted_speedup for _, a in members],
        )
    return key, series


def _is_number(value: str | None) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


# -- the report -------------------------------------------------------------------------------------


def report_markdown(analyses: list[RunAnalysis], pngs: dict[str, bytes], inputs: list[Path]) -> str:
    def image(name: str, caption: str) -> str:
        return f"![{caption}]({name})\n" if name in pngs else ""

    lines = ["# specdec-analyze report", "", "Inputs: " + ", ".join(f"`{p}`" for p in inputs), ""]
    unfinished = unfinished_runs(inputs)
    if unfinished:
        lines += ["Left out, unfinished (no results.json): " + ", ".join(f"`{p}`" for p in unfinished) + ".", ""]
    lines += ["## Findings", ""]
    if len(analyses) > 1:
        lines += [f"- {f}" for f in cross_run_findings(analyses)] + [""]
    if len(analyses) <= PER_RUN_FINDINGS_LIMIT:
        for a in analyses:
            lines += [f"### {a.label}", "", f"Run dir: `{a.path}`", ""] + [f"- {f}" for f in run_findings(a)] + [""]
    else:
        lines += [f"Per-run findings are left out for {len(analyses)} runs; the tables below hold every number.", ""]
    lines += [
        "## Runs compared", "",
        "Speedup measured = speculative tokens/s over plain decoding tokens/s, same prompts, interleaved in one "
        "run. Predicted = tau*T(1)/(T(n)+T_draft) from this run's measured times; c = T_draft/T(1); overhead "
        "share = the loop's own cost (other) / speculative time. The model leaves out prefill, verification and "
        "that overhead, on both sides, so it can err either way. tau from alpha = 1 + (share of steps that drafted) x "
        "sum_d prod_{j<=d} alpha_j; trees cut to the token budget and drafts of varying depth make it differ "
        "from the measured tau.", "",
        markdown_table(COMPARISON_HEADER, comparison_rows(analyses)), "", image("speedup.png", "speedup"),
        image("sweep.png", "sweep"),
    ]
    lines += ["## tau by drafter x workload category", ""]
    if categories_of(analyses):
        lines += ["Cells: tau (prompts).", "", category_table(analyses), "", image("tau_by_category.png", "categories")]
    without = [a.label for a in analyses if a.category_tau is None]
    if without:
        lines += [f"Left out (no per-step rows: read from a W&B log, or a rival measured beside a run's drafter): "
                  f"{', '.join(without)}.", ""]
    lines += [
        "## Per-depth conditional acceptance", "",
        "alpha_d = accepted at depth d / walks that reached depth d - 1 on a node with children.", "",
        depth_table(analyses), "", image("per_depth_acceptance.png", "per-depth acceptance"),
        "## Survival P(accepted drafts >= d)", "", survival_table(analyses), "", image("survival.png", "survival"),
        "## Accepted sibling rank", "",
    ]
    if any(a.rank_shares is not None for a in analyses):
        lines += ["Rank 0 = the drafter's first-ranked child of its parent.", "", rank_table(analyses), "",
                  image("sibling_rank.png", "sibling rank")]
    else:
        lines += ["Not recorded by these runs (results.json predates `accepted_rank_histogram`).", ""]
    lines += ["## Acceptance vs position in the output", ""]
    if "acceptance_by_position.png" in pngs:
        lines += [
            "tau of request-steps by how many tokens the request had generated; steps within the deepest draft "
            "of max_new_tokens are left out, since their drafts are cut to the budget.", "",
            image("acceptance_by_position.png", "acceptance by position"),
            image("tau_vs_prompt_length.png", "tau vs prompt length"),
        ]
    lines += ["## Time split (speculative side)", "", time_table(analyses), "", image("time_split.png", "time split")]
    return "\n".join(lines) + "\n"


# -- W&B output -------------------------------------------------------------------------------------


def log_to_wandb(out: Path, analyses: list[RunAnalysis], pngs: dict[str, bytes], inputs: list[Path]) -> str:
    """A new offline W&B run under out/analysis-wandb holding the tables and plots; returns its dir.
    Not under out/wandb, where a run dir keeps the W&B run of the measurement itself."""
    names = categories_of(analyses)
    return log_offline_run(out / "analysis-wandb", "specdec-analysis", f"analysis-{out.name}", lambda wandb: {
        "runs": wandb.Table(columns=COMPARISON_HEADER, data=comparison_rows(analyses)),
        "tau_by_category": wandb.Table(
            columns=["run", "drafter", *names],
            data=[[a.label, a.drafter] + [a.category_tau[n].tau if n in a.category_tau else None for n in names]
                  for a in analyses if a.category_tau],
        ),
        "per_depth_alpha": wandb.Table(
            columns=["run", "depth", "alpha", "attempts"],
            data=[[a.label, d + 1, alpha, a.per_depth_attempts[d]]
                  for a in analyses for d, alpha in enumerate(a.per_depth_alpha)],
        ),
        **{f"plots/{name.removesuffix('.png')}": wandb.Image(str(out / name)) for name in pngs},
    }, config={"inputs": [str(p) for p in inputs]})

