"""What a run reports: each side's summary against the baseline (tokens/s, speedup and tau with
their intervals, the acceptance the analytic model reads), the per-prompt, per-step and per-unit
rows, and the console tables. Every interval comes from specdec.intervals over the units of
experiments.run.measure.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from rich import box
from rich.table import Table

from experiments.common import records, sinks
from experiments.common.formatting import with_interval
from experiments.common.records import BASELINE, SPECULATIVE
from experiments.run.measure import UnitRun, pool
from specdec.intervals import CONFIDENCE, METHOD, WIDE, ratio_interval
from specdec.metrics import AcceptanceStats
from specdec.sampling import SamplingParams
from specdec.speedup import predicted_speedup

CONTRACTS = {  # results.json "exactness_contract" -> what a run's "greedy equal" may be held to
    "bitwise": "bitwise (each row's logits as if computed alone: greedy output must equal plain decoding)",
    "logits": "logits (the verifier is exact for the logits it sees; kernels may round a row differently "
              "with the batch shape, so a greedy answer can leave plain decoding's at a near-tie)",
}

if TYPE_CHECKING:
    from experiments.run.build import Pieces


def summarize(units: list[UnitRun], side: str, pieces: Pieces, label: str) -> dict[str, Any]:
    """One side (named ``label`` in results and tables) against the baseline over every unit and
    timed pass: tokens/s, the speedup and tau with their intervals (specdec.intervals), and the
    acceptance the analytic model reads."""
    settings, sampling = pieces.settings, pieces.sampling
    base = pool(units, BASELINE)
    repeats = len(units[0].passes)
    rows = unit_rows(units)
    speedup = records.speedup_interval(rows, side, BASELINE, settings.seed)
    mismatches = [
        request.id
        for unit in units
        for request, a, b in zip(unit.requests, unit.decoded(side).outputs, unit.decoded(BASELINE).outputs)
        if a != b
    ]
    results = {
        "drafter": label,
        "target": pieces.handle.label,
        "workload": settings.workload.name,
        "num_prompts": sum(len(unit.requests) for unit in units),
        "repeats": repeats,
        "units": len(units),
        "max_new_tokens": settings.max_new_tokens,
        "batch_size": settings.batch_size,
        "group_size": settings.group_size,
        "warmup_tokens": settings.warmup_tokens,
        "temperature": sampling.temperature,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
        "seed": settings.seed,
        "threads": torch.get_num_threads(),
        "speedup": speedup.estimate if speedup else _rate(*rates(units, side, BASELINE)),
        "speedup_interval": speedup.as_list() if speedup else None,
        # null without an interval (one unit); true: wider than +-WIDE, too few prompts or tokens to tell
        "too_small_to_tell": speedup.is_wide() if speedup else None,
        "speedup_per_pass": [_rate(*rates(units, side, BASELINE, repeat)) for repeat in range(repeats)],
        "tokens_per_s": _rate(sum(u.tokens(side) for u in units), sum(u.seconds(side) for u in units)),
        "tokens_per_s_baseline": _rate(sum(u.tokens(BASELINE) for u in units), sum(u.seconds(BASELINE) for u in units)),
        "interval_method": f"{METHOD}; {CONFIDENCE:.0%}",
        "exactness_contract": "bitwise" if pieces.target.invariant else "logits",
        "greedy_equal": not mismatches if sampling.greedy else None,  # None: not defined when sampling
        "greedy_mismatches": mismatches if sampling.greedy else [],
        # plain decoding's tokens reproduced before each answer's first divergence
        "greedy_equal_tokens": equal_token_share(units, side) if sampling.greedy else None,
        "reproducible": all(unit.reproducible(side) for unit in units),  # every pass gave the same outputs
        "generated_tokens": sum(u.tokens(side) for u in units) // repeats,  # in one pass
        "generated_tokens_baseline": sum(u.tokens(BASELINE) for u in units) // repeats,
        "wall_s": sum(u.seconds(side) for u in units) / repeats,  # of one pass, on average
        "wall_s_baseline": sum(u.seconds(BASELINE) for u in units) / repeats,
        "num_steps_baseline": base.num_steps,
        "time_split_baseline": asdict(base.time),
        "overhead_share_baseline": base.time.overhead_share,
    }
    if units[0].decoded(side).stats is not None:
        results.update(acceptance_summary(units, rows, side, base, settings.seed, settings.max_new_tokens))
    return results


def equal_token_share(units: list[UnitRun], side: str) -> float:
    """Share of plain decoding's tokens that ``side`` produced before its answer first differs: under
    the logits contract a divergence comes from a near-tie rounded differently, and everything after
    it is another (equally exact) continuation, so only the common prefix counts as equal."""
    equal = total = 0
    for unit in units:
        for a, b in zip(unit.decoded(side).outputs, unit.decoded(BASELINE).outputs):
            equal += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            total += len(b)
    return _rate(equal, total)


def acceptance_summary(
    units: list[UnitRun], rows: list[dict[str, Any]], side: str, base: AcceptanceStats, seed: int, max_new_tokens: int
) -> dict[str, Any]:
    """tau with its interval, tau along the answer, per-depth acceptance, T(n)/T(1), c and the analytic prediction."""
    spec = pool(units, side)
    steps = [steps_of(unit, side) for unit in units]
    tau = records.tau_interval(rows, side, seed)
    one_forward_s = base.time.target_s / max(base.num_steps, 1)  # T(1): a plain decoding forward
    target_time_ratio = _rate(spec.time.target_s / max(spec.num_steps, 1), one_forward_s)  # T(n)/T(1)
    drafter_cost_ratio = _rate(spec.time.draft_s / max(spec.num_steps, 1), one_forward_s)  # c
    return {
        "tau": spec.tau,
        "tau_interval": tau.as_list() if tau else None,
        "tau_along_answer": tau_along_answer(steps, max_new_tokens, seed),
        # the analytic model S = tau / (T(n)/T(1) + c); the gap to the measured speedup is overhead
        "predicted_speedup": predicted_speedup(spec.tau, 1.0, target_time_ratio, drafter_cost_ratio),
        "per_depth_alpha": spec.per_depth_alpha,
        "per_depth_attempts": spec.per_depth_attempts,
        "accepted_histogram": spec.accepted_histogram,
        "accepted_rank_histogram": spec.accepted_rank_histogram,
        "mean_tree_nodes": spec.mean_tree_nodes,
        "target_time_ratio": target_time_ratio,
        "drafter_cost_ratio": drafter_cost_ratio,
        "num_steps": spec.num_steps,
        "time_split": asdict(spec.time),
        # the loop's own cost: 1 - (prefill + draft + target + verify) / total
        "overhead_share": spec.time.overhead_share,
    }


def tau_along_answer(steps: list[list[dict[str, Any]]], max_new_tokens: int, seed: int, segments: int = 4) -> list[dict]:
    """tau in each quarter of the answer: a step counts in the segment holding the position of its
    root (the tokens its request had generated before it), so a drafter whose acceptance decays over
    a long answer shows a falling row. steps: per unit, steps_of's records in decoding order."""
    width = -(-max_new_tokens // segments)
    emitted = [[0] * segments for _ in steps]  # [unit][segment]
    counted = [[0] * segments for _ in steps]
    for u, unit_steps in enumerate(steps):
        position: dict[int, int] = {}
        for step in unit_steps:
            at = position.get(step["request"], 0)
            segment = min(at // width, segments - 1)
            emitted[u][segment] += step["num_accepted"] + 1
            counted[u][segment] += 1
            position[step["request"]] = at + step["num_accepted"] + 1
    rows = []
    for segment in range(segments):
        numerators, denominators = [e[segment] for e in emitted], [c[segment] for c in counted]
        if not sum(denominators):
            continue
        # units whose answers ended before this segment (EOS) have no steps in it and drop out
        reached = [(n, d) for n, d in zip(numerators, denominators) if d]
        interval = ratio_interval(*map(list, zip(*reached)), seed=seed)
        rows.append({
            "from_token": segment * width, "to_token": min((segment + 1) * width, max_new_tokens),
            "tau": sum(numerators) / sum(denominators), "steps": sum(denominators),
            "tau_interval": interval.as_list() if interval else None,
        })
    return rows


def steps_of(unit: UnitRun, side: str) -> list[dict[str, Any]]:
    """A side's per-request step records in a unit: one dict per (request, step), num_accepted an int."""
    return [
        {"request": request, "num_accepted": accepted}
        for record in unit.decoded(side).steps
        for request, accepted in zip(record["requests"], record["num_accepted"])
    ]


def rates(units: list[UnitRun], side: str, reference: str, repeat: int | None = None) -> tuple[float, float]:
    """(side's tokens/s, reference's tokens/s) over the units, in one pass or all of them."""
    def rate(name: str) -> float:
        passes = [unit.passes[repeat] for unit in units] if repeat is not None else [t for u in units for t in u.passes]
        return _rate(sum(sum(len(o) for o in t[name].decoded.outputs) for t in passes), sum(t[name].wall_s for t in passes))

    return rate(side), rate(reference)


def comparison(units: list[UnitRun], side: str, seed: int) -> dict[str, Any]:
    """A rival or peer against the run's drafter on the same units: the ratio of their tokens/s."""
    ratio = records.speedup_interval(unit_rows(units), side, SPECULATIVE, seed)
    return {
        "ratio_to_drafter": ratio.estimate if ratio else _rate(*rates(units, side, SPECULATIVE)),
        "ratio_to_drafter_interval": ratio.as_list() if ratio else None,
        # true: faster than the drafter, false: slower, null: the interval holds 1 (or there is none)
        "beats_drafter": (ratio.estimate > 1) if ratio and ratio.excludes(1.0) else None,
    }


def prompt_rows(units: list[UnitRun], sampling: SamplingParams, tokenizer) -> list[dict[str, Any]]:
    rows = []
    for unit in units:
        spec, base = unit.decoded(SPECULATIVE), unit.decoded(BASELINE)
        offered, steps = [0] * len(unit.requests), [0] * len(unit.requests)  # tau's numerator, denominator
        for step in steps_of(unit, SPECULATIVE):
            offered[step["request"]] += step["num_accepted"] + 1
            steps[step["request"]] += 1
        for b, request in enumerate(unit.requests):
            row = {
                "index": request.index,
                "id": request.id,
                "category": request.category,
                "unit": unit.index,
                "prompt_tokens": len(request.prompt),
                "generated_tokens": len(spec.outputs[b]),
                "generated_tokens_baseline": len(base.outputs[b]),
                "tau": offered[b] / steps[b],
                "greedy_equal": spec.outputs[b] == base.outputs[b] if sampling.greedy else None,
                "output": spec.outputs[b],
            }
            if tokenizer is not None:
                row["text"] = tokenizer.decode(spec.outputs[b])
            rows.append(row)
    return rows


def step_rows(units: list[UnitRun]) -> list[dict[str, Any]]:
    rows = []
    for unit in units:
        for record in unit.decoded(SPECULATIVE).steps:
            prompt_ids = [unit.requests[r].id for r in record["requests"]]
            rows.append({"batch": unit.index, **record, "prompt_ids": prompt_ids})
    return rows


def unit_rows(units: list[UnitRun]) -> list[dict[str, Any]]:
    """Each unit's record (experiments.common.records): what every interval was computed from, and how busy
    the machine was during each call."""
    rows = []
    for unit in units:
        sides = list(unit.passes[0])
        counted = [side for side in sides if unit.decoded(side).stats is not None]
        steps = {side: steps_of(unit, side) for side in counted}
        rows.append({
            "unit": unit.index,
            "prompt_ids": [request.id for request in unit.requests],
            "tokens": {side: sum(len(o) for o in unit.decoded(side).outputs) for side in sides},
            "seconds": {side: [timed[side].wall_s for timed in unit.passes] for side in sides},
            "request_steps": {side: len(steps[side]) for side in counted},
            "emitted": {side: sum(step["num_accepted"] + 1 for step in steps[side]) for side in counted},
            "cpu_seconds": {side: [timed[side].cpu_s for timed in unit.passes] for side in sides},
            "others_share": {side: [timed[side].others_share for timed in unit.passes] for side in sides},
            "load_average": {side: [timed[side].load_average for timed in unit.passes] for side in sides},
        })
    return rows


def unit_metrics(unit: UnitRun, sampling: SamplingParams) -> dict[str, Any]:
    """What a sink logs after each unit of each pass (a live view; results.json is the record)."""
    spec, base = unit.passes[0][SPECULATIVE], unit.passes[0][BASELINE]
    metrics = {
        "unit": unit.index,
        "prompts": len(unit.requests),
        "tau": spec.decoded.stats.tau,
        "tokens_per_s": _rate(sum(len(o) for o in spec.decoded.outputs), spec.wall_s),
        "tokens_per_s_baseline": _rate(sum(len(o) for o in base.decoded.outputs), base.wall_s),
    }
    if sampling.greedy:
        metrics["greedy_equal"] = spec.decoded.outputs == base.decoded.outputs
    return metrics


# -- tables ---------------------------------------------------------------------------------------


def budget_summary(budget: dict[str, Any]) -> str:
    if budget["mode"] == "fixed":
        return "fixed (the drafter's settings)"
    chosen = ", ".join(f"{key}={value}" for key, value in budget["chosen"].items())
    predicted = budget["predicted"]
    return f"auto: {chosen} (predicted tau {predicted['tau']:.2f}, speedup {predicted['speedup']:.2f}x)"


def busy_rows(contention: dict[str, Any] | None) -> list[tuple[str, str]]:
    """Above the figures: the cores a run left to other processes it found as it started, and a
    warning when they took more than that during the run."""
    rows = []
    if records.left_cores(contention):
        start = contention["at_start"]
        rows.append(("machine load", f"other processes took {100 * start['others_share']:.0f}% of the cores as the "
                                     f"target loaded: decoding on the {start['threads']} of {start['cores']} cores "
                                     f"they left free, so the figures are for {start['threads']} thread(s)"))
    if contention is None or contention["busy"] is False:
        return rows
    if contention["busy"] is None:
        if any(share is not None for share in contention["others_share_per_unit"]):
            return rows  # every unit too short to judge (machine_load.MIN_JUDGED_S)
        return [*rows, ("machine load", "unknown: this system has no per-core CPU account, so a busy machine "
                                        "would go unnoticed")]
    units = contention["judged_units"]
    return [*rows, ("[bold red]MACHINE BUSY[/bold red]", f"[bold]other processes took up to "
                    f"{100 * contention['max_others_share']:.0f}% of the cores in {contention['busy_units']} of {units} "
                    f"units (flag above {100 * contention['busy_share']:.0f}%): the figures below may hold their "
                    f"noise; rerun on a quiet machine[/bold]")]


def headline_rows(results: dict[str, Any]) -> list[tuple[str, str]]:
    """Our plain decoding against generate() (experiments.run.baseline_check), and the headline
    speedup over generate() where that was the faster plain decoder."""
    rows = []
    check = results.get("baseline_check")
    if check:
        verdict = "ours slower" if check["ours_slower"] else "ours not slower by the interval"
        rows.append(("plain decoding vs generate()", f"{check['tokens_per_s']:.1f} vs {check['tokens_per_s_generate']:.1f} "
                     f"tok/s, generate()/ours " + with_interval(check["generate_over_ours"],
                     check["generate_over_ours_interval"]) + f" on {check['prompts']} prompts x {check['tokens']} "
                     f"tokens: {verdict}"))
    top = results.get("headline")
    if top and top["against"] != BASELINE:
        rows.append(("[bold]speedup over generate()[/bold]", "[bold]" + with_interval(top["speedup"], top["speedup_interval"], "x")
                     + "[/bold] (the headline: transformers' generate() was the faster plain decoder here)"))
    return rows


def results_table(results: dict[str, Any], run_dir: Path) -> Table:
    table = Table(
        title=f"specdec-run: {results['drafter']} on {results['target']}",
        caption=f"in brackets: {CONFIDENCE:.0%} interval, {METHOD}. predicted speedup = tau / (T(n)/T(1) + c); "
                f"the gap to the measured one is overhead",
        show_header=False,
    )
    table.add_column(style="bold")
    table.add_column()
    split = results["time_split"]
    total = max(split["total_s"], 1e-12)
    greedy = results["greedy_equal"]
    rows = [*busy_rows(results.get("contention")),
        ("prompts x new tokens", f"{results['num_prompts']} x {results['max_new_tokens']} ({results['workload']}, "
                                 f"batch {results['batch_size']}, T={results['temperature']:g})"),
        ("timed passes", f"{results['repeats']} over {results['units']} units of {results['group_size']} prompt(s), "
                         f"after a warm-up pass of {results['warmup_tokens']} tokens per prompt"
                         if results["warmup_tokens"] else f"{results['repeats']} over {results['units']} units, no warm-up"),
        ("tree budget", budget_summary(results["budget"])),
        ("tau (tokens / target forward)", with_interval(results["tau"], results["tau_interval"])),
        *headline_rows(results),
        ("speedup (measured)" if not results.get("headline") or results["headline"]["against"] == BASELINE
         else "speedup over our plain decoding", with_interval(results["speedup"], results["speedup_interval"], "x")),
    ]
    if results["too_small_to_tell"]:
        rows.append(("", f"[bold]the interval reaches past +-{WIDE:.0%}: too few prompts or tokens to tell[/bold]"))
    rows += [
        ("speedup per pass", " ".join(f"{s:.3f}x" for s in results["speedup_per_pass"])),
        ("speedup (predicted)", f"{results['predicted_speedup']:.3f}x"),
        ("tokens/s speculative", f"{results['tokens_per_s']:.2f}"),
        ("tokens/s baseline", f"{results['tokens_per_s_baseline']:.2f}"),
        ("tau along the answer", "  ".join(
            f"{row['from_token']}-{row['to_token']}: {row['tau']:.2f}" for row in results["tau_along_answer"]) or "-"),
        ("per-depth alpha", " ".join(f"{a:.2f}" for a in results["per_depth_alpha"]) or "-"),
        ("T(n)/T(1)", f"{results['target_time_ratio']:.3f}"),
        ("drafter cost ratio c", f"{results['drafter_cost_ratio']:.4f}"),
        ("time split (speculative)", "  ".join(
            f"{name} {100 * split[f'{name}_s'] / total:.0f}%"
            for name in ("prefill", "draft", "target", "verify", "other"))),
        ("overhead share", f"{100 * results['overhead_share']:.1f}% (baseline "
                           f"{100 * results['overhead_share_baseline']:.1f}%)"),
        ("exactness contract", CONTRACTS[results["exactness_contract"]]),
        ("greedy equal", "n/a (sampling)" if greedy is None else
         "yes" if greedy else f"NO: {', '.join(results['greedy_mismatches'])} "
                              f"({100 * results['greedy_equal_tokens']:.1f}% of tokens before the first divergence)"),
        ("reproducible", "yes (every pass decoded the same)" if results["reproducible"] else
         "NO: outputs changed between passes"),
        ("threads", str(results["threads"])),
        ("run dir", str(run_dir)),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def rivals_table(results: dict[str, Any]) -> Table:
    table = Table(
        title="every side against the same baseline calls, in turn unit by unit",
        caption=f"under each figure: its {CONFIDENCE:.0%} paired interval. vs drafter: tokens/s over the "
                f"drafter's; * the interval excludes 1",
        box=box.SIMPLE_HEAD,
    )
    table.add_column("side", overflow="fold", min_width=12)
    for column in ("tau", "speedup", "vs drafter", "tok/s", "greedy\nequal"):
        table.add_column(column, no_wrap=True)

    def stacked(value: float, interval: list[float] | None, unit: str = "", digits: int = 2) -> str:
        return with_interval(value, interval, unit, digits, missing="").replace(" [", "\n[", 1)

    for row in [results, *results.get("rivals", []), *results.get("peers", [])]:
        greedy = row["greedy_equal"]
        ratio = row.get("ratio_to_drafter")
        versus = "-" if ratio is None else stacked(ratio, row["ratio_to_drafter_interval"], "x", 3).replace(
            "\n", " *\n" if row["beats_drafter"] is not None else "\n", 1)
        table.add_row(str(row["drafter"]), stacked(row["tau"], row["tau_interval"]) if "tau" in row else "-",
                      stacked(row["speedup"], row["speedup_interval"], "x"), versus,
                      f"{row['tokens_per_s']:.1f}", "n/a" if greedy is None else "yes" if greedy else "NO")
    return table


def wandb_summary(results: dict[str, Any]) -> dict[str, Any]:
    """results.json for a W&B run summary: each [low, high] interval also as two scalars W&B can chart."""
    summary = {k: v for k, v in results.items() if k != "config"}
    for key, value in results.items():
        if key.endswith("_interval") and value is not None:
            summary[f"{key}_low"], summary[f"{key}_high"] = value
    return summary


def wandb_tables(results: dict[str, Any], prompts: list[dict[str, Any]]) -> dict[str, sinks.Table]:
    """The rows W&B shows as tables beside the summary: one per prompt (prompts.jsonl without the
    output's token ids) and one per draft depth (alpha_d, the walks it is measured over, and the
    share of steps that accepted at least d drafts)."""
    columns = [key for key in prompts[0] if key != "output"]
    histogram = results["accepted_histogram"]  # steps by number of drafts accepted, 0 up
    steps = sum(histogram)
    depths = range(1, len(results["per_depth_alpha"]) + 1)
    return {
        "prompts": sinks.Table(columns, [[row[key] for key in columns] for row in prompts]),
        "per_depth": sinks.Table(
            ["depth", "alpha", "attempts", "survival"],
            [[d, results["per_depth_alpha"][d - 1], results["per_depth_attempts"][d - 1],
              sum(histogram[d:]) / steps if steps else None] for d in depths],
        ),
    }


def _rate(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else 0.0
