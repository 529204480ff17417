"""A run's per-unit records (``units.jsonl``) and every interval a run prints, computed from them.

specdec-run computes its intervals through these functions from the rows it then writes, and
specdec-analyze recomputes them from the file and compares, so a figure in results.json can always be
traced to the raw timings and counts, and a damaged or edited ``units.jsonl`` is found.

A row, one per unit (experiments.run.measure: a unit is ``group_size`` prompts decoded by one call of
each side, in every timed pass)::

    unit            int, the unit's index
    prompt_ids      [str], its prompts
    tokens          {side: int}, tokens generated in one pass (every pass decodes the same)
    seconds         {side: [float]}, wall time of each pass's call
    request_steps   {side: int}, (request, step) pairs in one pass; sides with acceptance only
    emitted         {side: int}, tokens those steps emitted (accepted + 1 each, before max_new_tokens cuts)
    cpu_seconds     {side: [float]}, this process's CPU time in each pass's call
    others_share    {side: [float | null]}, share of our cores other processes took in each call
    load_average    {side: [float | null]}, the machine's one-minute load average after each call
"""

from __future__ import annotations

from typing import Any

from specdec.intervals import Interval, rate_ratio_interval, ratio_interval

# the sides every run has (experiments.run.measure); rivals and peers are named by their labels
BASELINE, SPECULATIVE = "baseline", "speculative"
REQUIRED = ("unit", "prompt_ids", "tokens", "seconds")


class RecordsError(ValueError):
    """units.jsonl rows that cannot be what a run wrote."""


def check_rows(rows: list[Any], sides: list[str], repeats: int, source: str) -> None:
    """Refuse rows that lack a field, a side or a pass the run's results name."""
    for number, row in enumerate(rows, 1):
        where = f"{source} row {number}"
        if not isinstance(row, dict):
            raise RecordsError(f"{where} is not a JSON object")
        missing = [key for key in REQUIRED if key not in row]
        if missing:
            raise RecordsError(f"{where} lacks {', '.join(missing)}")
        for side in sides:
            if side not in row["tokens"] or len(row["seconds"].get(side, [])) != repeats:
                raise RecordsError(f"{where} lacks side {side!r} or one of its {repeats} timed passes")


def speedup_interval(rows: list[dict[str, Any]], side: str, reference: str, seed: int) -> Interval | None:
    """side's tokens/s over reference's, paired on the units (every pass of a unit in its totals)."""
    def totals(name: str) -> tuple[list[int], list[float]]:
        return ([row["tokens"][name] * len(row["seconds"][name]) for row in rows],
                [sum(row["seconds"][name]) for row in rows])

    return rate_ratio_interval(*totals(side), *totals(reference), seed=seed)


def tau_interval(rows: list[dict[str, Any]], side: str, seed: int) -> Interval | None:
    """Tokens emitted per request-step, resampling units."""
    return ratio_interval([row["emitted"][side] for row in rows], [row["request_steps"][side] for row in rows],
                          seed=seed)


def contention(rows: list[dict[str, Any]], busy_share: float, min_judged_s: float) -> dict[str, Any]:
    """How much of our cores other processes took, per unit over all its calls (weighted by their
    wall time), and whether any unit passed ``busy_share``. A unit whose calls took less than
    ``min_judged_s`` in all is not judged: the kernel counts CPU time in ticks, and over a short
    unit one tick more or less moves the share by more than the threshold. busy is None when no unit
    was judged (all too short, or no per-core account: then max_others_share is None too)."""
    shares, judged = [], []
    for row in rows:
        weighted = [(share, wall) for side, walls in row["seconds"].items()
                    for share, wall in zip(row.get("others_share", {}).get(side, []), walls) if share is not None]
        total = sum(wall for _, wall in weighted)
        share = sum(share * wall for share, wall in weighted) / total if weighted and total > 0 else None
        shares.append(share)
        if share is not None and total >= min_judged_s:
            judged.append(share)
    loads = [load for row in rows for side_loads in row.get("load_average", {}).values() for load in side_loads
             if load is not None]
    return {
        "busy": any(share > busy_share for share in judged) if judged else None,
        "busy_share": busy_share,
        "others_share_per_unit": shares,
        "judged_units": len(judged),
        "busy_units": sum(share > busy_share for share in judged),
        "max_others_share": max(judged, default=None),
        "max_load_average": max(loads, default=None),
    }


def machine_was_busy(results: dict[str, Any]) -> bool | None:
    """Whether a run's results.json records a busy machine: other processes took more of the cores
    than it left them, or held some as it started, so that it decoded on fewer threads than a quiet
    run (and than the other rows of a leaderboard). None where the run recorded neither."""
    contention = results.get("contention") or {}
    return True if left_cores(contention) else contention.get("busy")


def left_cores(contention: dict[str, Any] | None) -> bool:
    """Whether a run found other processes holding cores as it started and decoded without them."""
    start = (contention or {}).get("at_start")
    return bool(start) and start["threads"] < start["cores"]


def disagreements(results: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """Every interval in results.json that the rows do not give again, as 'side key: recorded vs
    recomputed'; [] when all agree. tau is checked where the rows carry its counts."""
    seed, found = results["seed"], []

    def compare(side: str, key: str, recorded: list[float] | None, interval: Interval | None) -> None:
        again = interval.as_list() if interval else None
        if (recorded is None) != (again is None) or (
                again is not None and any(abs(a - b) > 1e-9 * max(1.0, abs(a)) for a, b in zip(recorded, again))):
            found.append(f"{side} {key}: {recorded} vs {again}")

    others = results.get("rivals", []) + results.get("peers", [])
    sides = [(SPECULATIVE, results), *[(side["drafter"], side) for side in others]]
    for side, record in sides:
        compare(side, "speedup_interval", record.get("speedup_interval"), speedup_interval(rows, side, BASELINE, seed))
        if side != SPECULATIVE:
            compare(side, "ratio_to_drafter_interval", record.get("ratio_to_drafter_interval"),
                    speedup_interval(rows, side, SPECULATIVE, seed))
        if "tau" in record and all(side in row.get("request_steps", {}) for row in rows):
            compare(side, "tau_interval", record.get("tau_interval"), tau_interval(rows, side, seed))
    top = results.get("headline")
    if top and top["against"] != BASELINE:
        compare(SPECULATIVE, f"headline against {top['against']}", top["speedup_interval"],
                speedup_interval(rows, SPECULATIVE, top["against"], seed))
    return found
