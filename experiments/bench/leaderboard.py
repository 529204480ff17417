"""The leaderboard: every side of every bench run as one row, a table per machine and setting
(temperature, answer length), generated from the run dirs alone, never edited by hand.

``leaderboard_rows`` reads results.json files; ``leaderboard_markdown`` and ``leaderboard_plots``
render them; ``log_leaderboard`` sends the same tables and plots to an offline W&B run. Timings from
different machines never share a table: a speedup is a ratio measured on one machine.
"""

from __future__ import annotations

import datetime
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from experiments.common import plots
from experiments.common.formatting import markdown_table, with_interval
from experiments.common.records import machine_was_busy
from experiments.common.sinks import log_offline_run

NOT_RECORDED = "machine not recorded"  # results.json written before runs recorded their provenance


@dataclass(frozen=True)
class Row:
    machine: str  # provenance.machine.label
    target: str  # the target model's label
    dtype: str  # the target's weights: float32, bfloat16
    family: str  # the workload (and its category selection)
    temperature: float
    max_new_tokens: int
    side: str  # a drafter config's name, a rival's label or a transformers peer
    peer: bool
    tau: float | None  # None for a peer: it reports no acceptance
    tau_interval: list[float] | None
    speedup: float
    speedup_interval: list[float] | None
    drafter_cost: float | None  # c: drafting time per step in T(1)
    target_time_ratio: float | None  # T(n)/T(1)
    tree_nodes: float | None
    greedy: str  # "80/80", "78/80" (the logits contract says why a divergence may not be a fault), "n/a" at T > 0
    contract: str  # the exactness contract: bitwise | logits
    warmed: bool  # a warm-up pass preceded the timed ones (warmup_tokens > 0)
    busy: bool | None  # records.machine_was_busy; None: not recorded
    batch: int  # requests in flight; tau is per request-step
    prompts: int
    passes: int
    run: str  # the run dir (or NAME.results.json file), as found
    date: str
    commit: str
    command: str


def find_results(inputs: list[Path]) -> list[Path]:
    """Every results.json under the inputs (a bench dir, a run dir or a results.json itself); a file
    NAME.results.json counts too, as docs/data keeps runs whose other files it does not need."""
    def is_results(path: Path) -> bool:  # not specdec-train's NAME-train_results.json
        return path.name == "results.json" or path.name.endswith(".results.json")

    found: list[Path] = []
    for path in inputs:
        if path.is_file() and is_results(path):
            found.append(path)
        elif path.is_dir():
            found += sorted(p for p in path.rglob("*results.json") if is_results(p))
        else:
            raise ValueError(f"{path} is neither a bench dir, a run dir nor a results.json; give what specdec-bench wrote")
    if not found:
        raise ValueError(f"no results.json under {', '.join(map(str, inputs))}; run specdec-bench (or specdec-run) first")
    return found


def read_results(path: Path) -> dict[str, Any]:
    """A run's results.json; ValueError naming the file when it is unreadable, cut short or holds no
    run's record (results.json is written last and whole, so such a file was damaged afterwards)."""
    try:
        results = json.loads(path.read_bytes())
    except (OSError, ValueError) as error:
        raise ValueError(f"{path} is not a readable results record ({error}); rerun that run, or move the file "
                         f"out of the inputs") from None
    if not isinstance(results, dict) or "config" not in results:
        raise ValueError(f"{path} holds no run's results (no config recorded); rerun that run, or move the file "
                         f"out of the inputs")
    return results


def leaderboard_rows(inputs: list[Path], machine: str | None = None) -> list[Row]:
    """machine: the label for runs whose results.json records none (written before runs recorded
    their provenance); None = NOT_RECORDED, a table of their own."""
    rows = []
    for path in find_results(inputs):
        results = read_results(path)
        run = path.parent if path.name == "results.json" else path
        rows += [_row(results, side, peer, run, machine or NOT_RECORDED) for side, peer in _sides(results)]
    return rows


def _sides(results: dict[str, Any]) -> list[tuple[dict[str, Any], bool]]:
    if results.get("config", {}).get("drafter", {}).get("name") is None:
        return []  # plain decoding only: nothing to rank
    return [(results, False)] + [(r, False) for r in results.get("rivals", [])] + [(p, True) for p in results.get("peers", [])]


def _row(results: dict[str, Any], side: dict[str, Any], peer: bool, run: Path, unrecorded: str) -> Row:
    provenance = results.get("provenance", {})
    workload = results["config"]["workload"]
    family = workload["name"] + (f"[{','.join(workload['categories'])}]" if workload.get("categories") else "")
    greedy = side["greedy_equal"]
    n = side["num_prompts"]
    target = results["config"].get("target", {})
    return Row(
        machine=provenance.get("machine", {}).get("label", unrecorded),
        target=results.get("target", target.get("name", "?")),
        dtype=target.get("dtype") or "float32",
        family=family,
        temperature=results["temperature"],
        max_new_tokens=results["max_new_tokens"],
        side=side["drafter"] + (" (target drafting for itself)" if _drafts_for_itself(side, results) else "")
        + _replaced_head(side, results),
        peer=peer,
        tau=None if peer else side.get("tau"),
        tau_interval=None if peer else side.get("tau_interval"),
        speedup=side["speedup"],
        speedup_interval=side.get("speedup_interval"),
        drafter_cost=None if peer else side.get("drafter_cost_ratio"),
        target_time_ratio=None if peer else side.get("target_time_ratio"),
        tree_nodes=None if peer else side.get("mean_tree_nodes"),
        greedy="n/a" if greedy is None else f"{n - len(side.get('greedy_mismatches', [])) if not greedy else n}/{n}",
        contract=side.get("exactness_contract") or results.get("exactness_contract") or "-",
        warmed=bool(results.get("warmup_tokens")),
        busy=machine_was_busy(results),
        batch=results.get("batch_size", 1),
        prompts=n,
        passes=side["repeats"],
        run=str(run),
        date=provenance.get("date", ""),
        commit=provenance.get("commit") or "",
        command=provenance.get("command") or "specdec-run " + " ".join(results.get("overrides", [])),
    )


def _drafter_options(side: dict[str, Any], results: dict[str, Any]) -> dict[str, Any] | None:
    """A side's drafter config: a rival's own, or the run's for its main side."""
    return side.get("config") if side is not results else results["config"].get("drafter")


def _drafts_for_itself(side: dict[str, Any], results: dict[str, Any]) -> bool:
    """A draft model (a drafter's ``model_path``) that is the target itself (the only model of
    SmolLM2's family offline): its acceptance says nothing about a real small draft model."""
    options = _drafter_options(side, results) or {}
    target = results["config"].get("target", {})
    return options.get("model_path") is not None and options["model_path"] in (target.get("name"), target.get("path"))


@dataclass(frozen=True)
class ReplacedHead:
    since: str  # the date from which the bundled head is the current one
    label: str  # what a run before it ran


# bundled heads replaced by a head of another architecture, by drafter: a run before the date that
# passed no checkpoint ran the earlier head. Domino's was a miniature, smaller architecture
# (docs/NOTES.md "Domino and DFlash as published") until a head of the published one replaced it
REPLACED_HEADS = {"domino": ReplacedHead("2026-12-05T15:42:56+00:00", "miniature head")}


def _replaced_head(side: dict[str, Any], results: dict[str, Any]) -> str:
    """The note ' (what it ran)' for a side that ran a bundled head replaced since, else nothing."""
    options = _drafter_options(side, results) or {}
    replaced = REPLACED_HEADS.get(options.get("name"))
    date = results.get("provenance", {}).get("date")
    if replaced is None or options.get("checkpoint") is not None or (date is not None and date >= replaced.since):
        return ""
    return f" ({replaced.label})"


def _setting(row: Row) -> tuple[float, int]:
    return row.temperature, row.max_new_tokens


def _where(row: Row) -> str:
    """A table's machine, target and dtype: rows that differ in any of them never share a table."""
    return f"{row.machine}: {row.target}, {row.dtype}"


def _groups(rows: list[Row]) -> dict[str, dict[tuple[float, int], list[Row]]]:
    """Rows by machine, target and dtype, then by setting; within a setting by family, the fastest first."""
    groups: dict[str, dict[tuple[float, int], list[Row]]] = {}
    for row in sorted(rows, key=lambda r: (_where(r), _setting(r), r.family, -r.speedup, r.side)):
        groups.setdefault(_where(row), {}).setdefault(_setting(row), []).append(row)
    return groups


def _figure(value: float | None, interval: list[float] | None, unit: str = "") -> str:
    return "-" if value is None else with_interval(value, interval, unit, digits=2, missing="")


def _number(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


HEADER = ["family", "side", "speedup [95%]", "tau [95%]", "c", "T(n)/T(1)", "tree nodes", "greedy equal",
          "contract", "warm-up", "machine busy", "prompts x passes", "run"]


def _yes_no(value: bool | None) -> str:
    return "not recorded" if value is None else "yes" if value else "no"


def table_rows(rows: list[Row], runs: dict[str, int]) -> list[list[str]]:
    return [
        [r.family, r.side + (" (transformers)" if r.peer else ""), _figure(r.speedup, r.speedup_interval, "x"),
         _figure(r.tau, r.tau_interval), _number(r.drafter_cost, 3), _number(r.target_time_ratio, 2),
         _number(r.tree_nodes, 1), r.greedy, r.contract, _yes_no(r.warmed), ("**YES**" if r.busy else _yes_no(r.busy)),
         f"{r.prompts} x {r.passes}" + (f", batch {r.batch}" if r.batch > 1 else ""), f"[{runs[r.run]}](#run-{runs[r.run]})"]
        for r in rows
    ]


def best_rows(rows: list[Row]) -> list[Row]:
    """The fastest side of each (machine, target and dtype, setting, family): the leaderboard's top rows."""
    best: dict[tuple, Row] = {}
    for row in rows:
        key = (row.machine, row.target, row.dtype, _setting(row), row.family)
        if key not in best or row.speedup > best[key].speedup:
            best[key] = row
    return sorted(best.values(), key=lambda r: (r.machine, r.target, r.dtype, _setting(r), r.family))


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _setting_name(setting: tuple[float, int]) -> str:
    return f"T = {setting[0]:g}, {setting[1]} tokens"


def leaderboard_plots(rows: list[Row]) -> dict[str, bytes]:
    """Per machine and setting: tau against speedup (a point per drafter and family) and speedup by
    family (bars per side); file name -> PNG."""
    pngs = {}
    for machine, settings in _groups(rows).items():
        for setting, found in settings.items():
            stem = f"{slug(machine)}-t{setting[0]:g}-{setting[1]}tok".replace(".", "_")
            series: dict[str, list[plots.Point]] = {}
            for r in found:
                if r.tau is not None:
                    series.setdefault(r.side, []).append((r.tau, r.tau_interval, r.speedup, r.speedup_interval))
            pngs[f"tau_vs_speedup-{stem}.png"] = plots.interval_scatter_png(
                series, f"tau against speedup (95% intervals), {_setting_name(setting)}\n{machine}",
                "tau (tokens per request-step)", "speedup over plain decoding", reference_y=(1.0, "plain decoding"))
            families = list(dict.fromkeys(r.family for r in found))
            sides = list(dict.fromkeys(r.side for r in sorted(found, key=lambda r: -r.speedup)))
            by_cell = {(r.family, r.side): r for r in found}
            pngs[f"speedup_by_family-{stem}.png"] = plots.grouped_bars_png(
                families, {side: [by_cell[f, side].speedup if (f, side) in by_cell else 0.0 for f in families]
                           for side in sides},
                f"speedup by workload family (95% intervals), {_setting_name(setting)}\n{machine}", "workload family",
                "speedup over plain decoding", reference=(1.0, "plain decoding"),
                intervals={side: [by_cell[f, side].speedup_interval if (f, side) in by_cell else None for f in families]
                           for side in sides})
    return pngs


def leaderboard_markdown(rows: list[Row], inputs: list[Path], command: str, plot_dir: str | None) -> str:
    runs = {run: i for i, run in enumerate(dict.fromkeys(r.run for r in sorted(rows, key=lambda r: r.run)), 1)}
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    lines = [
        "# Leaderboard",
        "",
        f"Generated on {now} by `{command}` from {len(runs)} runs; do not edit by hand (rerun the command).",
        "",
        "Each run decodes the same prompts with plain decoding and with every side, taking turns unit by unit, "
        "after a warm-up pass where **warm-up** says yes (docs/MEASURING.md). **speedup**: tokens/s over our plain "
        "decoding in the same run; **tau**: tokens emitted per request-step (at batch 1, per target forward); both "
        "with a 95% BCa bootstrap interval over units (a unit is a prompt at batch 1). **c**: drafting time per step in "
        "target forwards T(1); **T(n)/T(1)**: the target forward over the tree against one token's; **greedy equal**: "
        "prompts whose output equals plain decoding token for token (T = 0); **contract**: bitwise (a greedy "
        "divergence is a fault) or logits (the target may round a row differently with the batch shape, so a "
        "divergence at a near-tie is not; docs/NOTES.md, \"The exactness contract\"); **machine busy**: other "
        "processes took more than 10% of the cores beyond those the run left them in some unit (its figures may hold "
        "their noise), or held cores as it started (it decoded on fewer threads). A transformers peer reports no "
        "acceptance. Speedups compare only within one table: one machine, target and dtype.",
        "",
        "## Top rows: the fastest side per workload family",
        "",
        markdown_table(["machine", "target", "dtype", "setting", "family", "side", "speedup [95%]", "tau [95%]",
                        "greedy equal", "machine busy", "run"], [
            [r.machine, r.target, r.dtype, _setting_name(_setting(r)), r.family, r.side,
             _figure(r.speedup, r.speedup_interval, "x"), _figure(r.tau, r.tau_interval), r.greedy,
             "**YES**" if r.busy else _yes_no(r.busy), f"[{runs[r.run]}](#run-{runs[r.run]})"]
            for r in best_rows(rows)
        ]),
    ]
    for machine, settings in _groups(rows).items():
        lines += ["", f"## {machine}"]
        for setting, found in settings.items():
            lines += ["", f"### {_setting_name(setting)}", "", markdown_table(HEADER, table_rows(found, runs))]
            if plot_dir is not None:
                stem = f"{slug(machine)}-t{setting[0]:g}-{setting[1]}tok".replace(".", "_")
                lines += ["", f"![tau against speedup]({plot_dir}/tau_vs_speedup-{stem}.png) "
                              f"![speedup by family]({plot_dir}/speedup_by_family-{stem}.png)"]
    lines += ["", "## Runs", ""]
    first = {r.run: r for r in rows}
    for run, number in runs.items():
        r = first[run]
        lines += [f'<a id="run-{number}"></a>**{number}.** `{run}`: {r.date or "date not recorded"}, '
                  f"commit {r.commit or 'not recorded'}, {r.machine}", "", f"    {r.command}", ""]
    return "\n".join(lines).rstrip() + "\n"


README_START = "<!-- generated by: "  # then the specdec-bench leaderboard command, " -->"
README_END = "<!-- end of the generated figures -->"


def readme_figures(rows: list[Row]) -> str:
    """The README's figures: the leaderboard's top rows (the fastest side per setting and family), one
    table per machine and target, without the per-run detail LEADERBOARD.md carries."""
    lines: list[str] = []
    for where in dict.fromkeys((r.machine, r.target) for r in best_rows(rows)):
        found = sorted((r for r in best_rows(rows) if (r.machine, r.target) == where),
                       key=lambda r: (_setting(r), r.family, r.dtype))
        dates = sorted({r.date[:10] for r in found if r.date})
        when = f"runs dated {', '.join(dates)}" if dates else "run dates not recorded"
        batches = sorted({r.batch for r in found})
        lines += [f"{where[0]}; {where[1]}; batch {', '.join(map(str, batches))}; {when}:",
                  "", markdown_table(["setting", "workload", "prompts", "dtype", "fastest", "speedup [95%]", "tau [95%]"], [
                      [_setting_name(_setting(r)), r.family, str(r.prompts), r.dtype, _fastest(r),
                       _figure(r.speedup, r.speedup_interval, "x"), _figure(r.tau, r.tau_interval)]
                      for r in found]), ""]
    return "\n".join(lines).rstrip() + "\n"


def _fastest(row: Row) -> str:
    side = f"`{row.side}`" + (" (transformers)" if row.peer else "")
    beaten = row.speedup_interval is not None and row.speedup_interval[1] < 1
    return f"none beats plain decoding (best: {side})" if beaten else side


def with_readme_figures(text: str, rows: list[Row], command: str, name: str) -> str:
    """text (a README) with its generated block, from the line starting README_START to README_END,
    replaced by the figures of rows and the command that made them; ValueError when it has no block."""
    start, end = text.find(README_START), text.find(README_END)
    if start < 0 or end < start:
        raise ValueError(f"{name} has no generated block; put the lines {README_START}... --> and {README_END} "
                         f"where its figures go")
    return f"{text[:start]}{README_START}{command} -->\n{readme_figures(rows)}\n{text[end:]}"


def readme_command(text: str) -> str | None:
    """The command recorded in a README's generated block (None: it has none)."""
    start = text.find(README_START)
    return None if start < 0 else text[start + len(README_START):text.index(" -->", start)]


def log_leaderboard(wandb_dir: Path, rows: list[Row], pngs: dict[str, Path]) -> str:
    """The rows and plots as a new offline W&B run under wandb_dir; returns the run's dir."""
    def values(wandb: Any) -> dict[str, Any]:
        def table(chosen: list[Row]) -> Any:  # intervals as JSON text: a W&B cell holds one value
            return wandb.Table(columns=list(asdict(rows[0])),
                               data=[[json.dumps(v) if isinstance(v, list) else v for v in asdict(r).values()] for r in chosen])

        return {
            "leaderboard": table(rows),
            "top_rows": table(best_rows(rows)),
            **{f"plots/{name.removesuffix('.png')}": wandb.Image(str(path)) for name, path in pngs.items()},
        }

    return log_offline_run(wandb_dir, "specdec-leaderboard", "leaderboard", values)
