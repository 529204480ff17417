"""Each run's analysis (``RunAnalysis``, from ``analyze_run``), its label among the runs compared, and
the findings the report states about it and across runs, one sentence each with its number.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.analyze.discover import RunFiles, override_key, override_value
from specdec.speedup import expected_tau, predicted_speedup

# runs before prefill_s was recorded count the prefill in target_s (and have no prefill part)
TIME_PARTS = ("prefill", "draft", "target", "verify", "other")
POSITION_BINS = 8  # bins of the output length for acceptance vs position


# -- labels -----------------------------------------------------------------------------------------


def varying_overrides(runs: list[RunFiles]) -> list[str]:
    """Override keys whose values differ between the runs, in order of first appearance."""
    keys: list[str] = []
    for run in runs:
        keys += [k for k in map(override_key, run.overrides) if k not in keys]
    values = {key: {override_value(run, key) for run in runs} for key in keys}
    return [key for key in keys if len(values[key]) > 1]


def short_names(keys: list[str]) -> dict[str, str]:
    """Each key's last dotted part (`temperature` for `sampling.temperature`) where that is unique."""
    last = [key.split(".")[-1] for key in keys]
    return {key: name if last.count(name) == 1 else key for key, name in zip(keys, last)}


def label_runs(runs: list[RunFiles]) -> list[str]:
    """Each run's label: the overrides that differ between the runs (`drafter=ngram temperature=1`),
    else its drafter; a run dir's name disambiguates what is still equal."""
    keys = varying_overrides(runs)
    names = short_names(keys)
    labels = []
    for run in runs:
        parts = [f"{names[key]}={override_value(run, key)}" for key in keys if override_value(run, key) is not None]
        labels.append(" ".join(parts) or str(run.results["drafter"]))
    counts = {label: labels.count(label) for label in labels}
    return [f"{label} ({run.path.name})" if counts[label] > 1 else label for label, run in zip(labels, runs)]


# -- analysis ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CategoryTau:
    tau: float  # pooled over the category's request-steps
    prompts: int
    request_steps: int


@dataclass(frozen=True)
class PositionCurve:
    """tau of request-steps grouped by how many tokens the request had generated before the step."""

    bin_width: int  # output tokens per bin
    bin_starts: list[int]  # first output position of each non-empty bin
    tau: list[float]
    request_steps: list[int]
    cutoff: int  # steps at positions >= cutoff are left out: their drafts were cut to the token budget


@dataclass(frozen=True)
class RunAnalysis:
    label: str
    path: Path
    drafter: str
    workload: str
    temperature: float
    num_prompts: int
    tau: float
    draft_coverage: float  # share of request-steps with a draft (n-gram lookup may find none)
    tau_from_alpha: float  # 1 + coverage * sum_d prod_{j<=d} alpha_j: the tau the measured alphas imply
    tree_end_share: float  # of the steps that drafted: every node on the accepted path accepted, none deeper
    speedup: float  # measured, wall-clock tokens/s over the baseline's in the same run
    speedup_interval: list[float] | None  # 95% paired bootstrap interval; None: one unit, or an older run
    tau_interval: list[float] | None
    repeats: int  # timed passes over the prompts
    predicted_speedup: float  # tau * T(1) / (T(n) + T_draft)
    one_forward_s: float  # T(1)
    tree_forward_s: float  # T(n)
    draft_s: float  # T_draft per step
    drafter_cost_ratio: float  # c = T_draft / T(1)
    target_time_ratio: float  # T(n) / T(1)
    mean_tree_nodes: float
    time_per_step_s: dict[str, float]  # draft/target/verify/other seconds per speculative step
    time_shares: dict[str, float]  # draft/target/verify/other share of the speculative time
    overhead_share: float  # other / total: the loop's own cost (commits, bookkeeping, host syncs)
    outside_model_share: float  # prefill + verify + other: the time the analytic model leaves out
    per_depth_alpha: list[float]
    per_depth_attempts: list[int]
    survival: list[float]  # P(accepted drafts >= d), d = 0..
    rank_shares: list[float] | None  # share of accepted nodes per sibling rank; None: not recorded
    category_tau: dict[str, CategoryTau] | None  # None: no per-step rows (W&B log only)
    position: PositionCurve | None
    prompt_tokens: list[int] | None  # per prompt, with prompt_tau
    prompt_tau: list[float] | None
    greedy_equal: bool | None  # None: sampled run
    contract: str | None  # "bitwise" or "logits" (experiments.run.summary.CONTRACTS); None: not recorded
    greedy_mismatches: int  # prompts whose greedy output differs from plain decoding
    greedy_equal_tokens: float | None  # share of plain decoding's tokens before the first divergence


def analyze_run(run: RunFiles, label: str) -> RunAnalysis:
    results = run.results
    spec, base = results["time_split"], results["time_split_baseline"]
    steps, base_steps = max(results["num_steps"], 1), max(results["num_steps_baseline"], 1)
    one_forward, tree_forward, draft = base["target_s"] / base_steps, spec["target_s"] / steps, spec["draft_s"] / steps
    seconds = {part: spec.get(f"{part}_s", 0.0) for part in TIME_PARTS}
    shares = {part: _ratio(seconds[part], sum(seconds.values())) for part in TIME_PARTS}
    histogram = results["accepted_histogram"]
    ranks = results.get("accepted_rank_histogram")
    attempts = results["per_depth_attempts"]
    coverage = _ratio(attempts[0], sum(histogram)) if attempts else 0.0
    return RunAnalysis(
        label=label,
        path=run.path,
        drafter=str(results["drafter"]),
        workload=str(results["workload"]),
        temperature=float(results["temperature"]),
        num_prompts=int(results["num_prompts"]),
        tau=results["tau"],
        draft_coverage=coverage,
        # alpha_1 is conditional on a draft existing: steps without one emit exactly one token
        tau_from_alpha=1 + coverage * (expected_tau(results["per_depth_alpha"]) - 1),
        tree_end_share=tree_end_share(histogram, attempts),
        speedup=results["speedup"],
        speedup_interval=results.get("speedup_interval"),
        tau_interval=results.get("tau_interval"),
        repeats=int(results.get("repeats", 1)),
        predicted_speedup=predicted_speedup(results["tau"], one_forward, tree_forward, draft)
        if tree_forward + draft > 0 else 0.0,
        one_forward_s=one_forward,
        tree_forward_s=tree_forward,
        draft_s=draft,
        drafter_cost_ratio=_ratio(draft, one_forward),
        target_time_ratio=_ratio(tree_forward, one_forward),
        mean_tree_nodes=results["mean_tree_nodes"],
        time_per_step_s={part: seconds[part] / steps for part in TIME_PARTS},
        time_shares=shares,
        overhead_share=shares["other"],
        outside_model_share=shares["prefill"] + shares["verify"] + shares["other"],
        per_depth_alpha=results["per_depth_alpha"],
        per_depth_attempts=results["per_depth_attempts"],
        survival=[_ratio(sum(histogram[d:]), sum(histogram)) for d in range(len(histogram))],
        rank_shares=[_ratio(n, sum(ranks)) for n in ranks] if ranks is not None else None,
        category_tau=_category_tau(run.prompts, run.steps) if run.steps is not None else None,
        position=_position_curve(run.steps, results) if run.steps is not None else None,
        prompt_tokens=[p["prompt_tokens"] for p in run.prompts] if run.prompts is not None else None,
        prompt_tau=[p["tau"] for p in run.prompts] if run.prompts is not None else None,
        greedy_equal=results.get("greedy_equal"),
        contract=results.get("exactness_contract"),
        greedy_mismatches=len(results.get("greedy_mismatches", [])),
        greedy_equal_tokens=results.get("greedy_equal_tokens"),
    )


def _category_tau(prompts: list[dict], steps: list[dict]) -> dict[str, CategoryTau]:
    category = {p["id"]: str(p.get("category", "unknown")) for p in prompts}
    emitted: dict[str, int] = {}
    counted: dict[str, int] = {}
    for step in steps:
        for prompt_id, accepted in zip(step["prompt_ids"], step["num_accepted"]):
            name = category.get(prompt_id, "unknown")
            emitted[name] = emitted.get(name, 0) + accepted + 1
            counted[name] = counted.get(name, 0) + 1
    prompts_per = {name: list(category.values()).count(name) for name in counted}
    return {
        name: CategoryTau(emitted[name] / counted[name], prompts_per[name], counted[name]) for name in sorted(counted)
    }


def _position_curve(steps: list[dict], results: dict[str, Any]) -> PositionCurve:
    max_new_tokens = int(results["max_new_tokens"])
    cutoff = max_new_tokens - len(results["per_depth_alpha"])
    width = max(1, math.ceil(max_new_tokens / POSITION_BINS))
    generated: dict[tuple[int, str], int] = {}  # (batch, prompt id) -> tokens so far
    emitted: dict[int, int] = {}
    counted: dict[int, int] = {}
    for step in steps:
        for prompt_id, accepted in zip(step["prompt_ids"], step["num_accepted"]):
            key = (step["batch"], prompt_id)
            position = generated.get(key, 0)
            generated[key] = position + accepted + 1
            if position < cutoff:
                start = position // width * width
                emitted[start] = emitted.get(start, 0) + accepted + 1
                counted[start] = counted.get(start, 0) + 1
    starts = sorted(counted)
    return PositionCurve(width, starts, [emitted[s] / counted[s] for s in starts], [counted[s] for s in starts], cutoff)


def tree_end_share(histogram: list[int], attempts: list[int]) -> float:
    """Of the request-steps that drafted, the share that accepted every node along their path and
    stopped because that path went no deeper: the tree's size ended them, not a rejection.
    ``histogram[k]``: steps that accepted k drafts; ``attempts[d - 1]``: steps whose walk reached
    depth d - 1 at a node with children (specdec.metrics)."""
    with_children = lambda depth: attempts[depth - 1] if depth - 1 < len(attempts) else 0
    ended = sum(sum(histogram[d:]) - with_children(d + 1) for d in range(1, len(histogram)))
    return _ratio(ended, attempts[0]) if attempts else 0.0


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else 0.0


# -- findings: one sentence each, with its number ---------------------------------------------------


def run_findings(a: RunAnalysis) -> list[str]:
    findings = [
        f"tau = {a.tau:.2f} tokens per target forward ({a.drafter} on {a.workload}, T={a.temperature:g}, "
        f"{a.num_prompts} prompts).",
        f"Measured speedup is {a.speedup:.2f}x against {a.predicted_speedup:.2f}x predicted by "
        f"tau*T(1)/(T(n)+T_draft), {_gap(a)}.",
    ]
    if a.per_depth_alpha:
        deepest = len(a.per_depth_alpha)
        findings.append(
            f"Conditional acceptance is {a.per_depth_alpha[0]:.2f} at depth 1 ({a.per_depth_attempts[0]} attempts)"
            + (f" and {a.per_depth_alpha[-1]:.2f} at depth {deepest} ({a.per_depth_attempts[-1]} attempts)."
               if deepest > 1 else ".")
        )
        findings.append(
            f"Had every accepted draft been followed by a deeper one, the per-depth alphas would give tau = "
            f"{a.tau_from_alpha:.2f} (1 + the sum of their running products, times the {a.draft_coverage:.0%} of "
            f"steps that drafted) against {a.tau:.2f} measured: in {a.tree_end_share:.0%} of the steps that "
            f"drafted, the tree ended before a rejection did."
        )
    if len(a.survival) > 1:
        findings.append(
            f"{a.survival[1]:.0%} of steps accepted at least one draft and the longest accepted run was "
            f"{len(a.survival) - 1} drafts."
        )
    shares = a.time_shares
    findings.append(
        f"Drafting takes {shares['draft']:.0%} of the speculative time, the target forward {shares['target']:.0%}, "
        f"prefill {shares['prefill']:.0%}, verification {shares['verify']:.0%} and the loop's overhead "
        f"{shares['other']:.0%}, so {a.outside_model_share:.0%} lies outside the analytic model."
    )
    findings.append(
        f"The drafter cost ratio c = T_draft/T(1) is {a.drafter_cost_ratio:.3f} and T(n)/T(1) is "
        f"{a.target_time_ratio:.2f} for {a.mean_tree_nodes:.1f} tree nodes per step on average."
    )
    if a.rank_shares is not None and len(a.rank_shares) > 1:
        findings.append(f"{a.rank_shares[0]:.0%} of accepted nodes were their parent's first-ranked child.")
    if a.category_tau is not None and len(a.category_tau) > 1:
        ordered = sorted(a.category_tau.items(), key=lambda item: item[1].tau)
        (worst, low), (best, high) = ordered[0], ordered[-1]
        findings.append(
            f"tau is highest for {best} ({high.tau:.2f}) and lowest for {worst} ({low.tau:.2f}) "
            f"over {len(ordered)} categories."
        )
    if a.position is not None and len(a.position.bin_starts) > 1:
        p = a.position
        findings.append(
            f"tau is {p.tau[0]:.2f} over output tokens {_bin_range(p, 0)} and {p.tau[-1]:.2f} over tokens "
            f"{_bin_range(p, -1)}."
        )
    if a.greedy_equal is True:
        findings.append(f"Greedy output equals plain decoding token for token on all {a.num_prompts} prompts.")
    elif a.greedy_equal is False and a.contract == "logits":
        tokens = "" if a.greedy_equal_tokens is None else f", {a.greedy_equal_tokens:.1%} of its tokens before the first divergence"
        findings.append(
            f"Greedy output leaves plain decoding's on {a.greedy_mismatches} of {a.num_prompts} prompts{tokens}: "
            f"the run is under the logits contract (its target rounds a row differently with the batch shape), "
            f"so this is a near-tie rounded another way, not a fault of the verifier."
        )
    elif a.greedy_equal is False:
        findings.append(f"Greedy output DIFFERS from plain decoding in this run of {a.num_prompts} prompts: a bug.")
    return findings


def cross_run_findings(analyses: list[RunAnalysis]) -> list[str]:
    by_tau = sorted(analyses, key=lambda a: a.tau)
    by_speed = sorted(analyses, key=lambda a: a.speedup)
    slower = sum(a.speedup < 1 for a in analyses)
    gaps = [a.speedup / a.predicted_speedup - 1 for a in analyses if a.predicted_speedup > 0]
    findings = [
        f"Highest tau: {by_tau[-1].label} ({by_tau[-1].tau:.2f}); lowest: {by_tau[0].label} ({by_tau[0].tau:.2f}).",
        f"Fastest: {by_speed[-1].label} at {by_speed[-1].speedup:.2f}x measured "
        f"({by_speed[-1].predicted_speedup:.2f}x predicted).",
        f"{slower} of {len(analyses)} runs were slower than plain decoding (measured speedup < 1).",
    ]
    if gaps:
        median = statistics.median(gaps)
        findings.append(
            f"The median run's measured speedup lies {abs(median):.0%} {'below' if median < 0 else 'above'} "
            f"its prediction."
        )
    return findings


def _gap(a: RunAnalysis) -> str:
    if a.predicted_speedup <= 0:
        return "no prediction (no target time recorded)"
    gap = a.speedup / a.predicted_speedup - 1
    return f"{abs(gap):.0%} {'below' if gap < 0 else 'above'} it"


def _bin_range(p: PositionCurve, index: int) -> str:
    start = p.bin_starts[index]
    end = min(start + p.bin_width, p.cutoff) - 1
    return f"{start}-{end}" if end > start else str(start)

