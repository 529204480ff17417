"""specdec-analyze: why acceptance is what it is, from the files specdec-run wrote.

    specdec-analyze outputs/2026-01-01/12-00-00          # one run: report.md + PNGs into the run dir
    specdec-analyze multirun/2026-01-01/12-00-00         # a sweep: every run below it, compared
    specdec-analyze RUN_A SWEEP_B --out comparison/      # several inputs need --out
    specdec-analyze RUN/wandb/offline-run-...            # a W&B offline run (see below)

Each run contributes results.json, steps.jsonl and prompts.jsonl, and .hydra/overrides.yaml when
Hydra wrote one: runs are labelled by the overrides that differ between them. The report states
tau per workload category, the per-depth conditional acceptance alpha_d, the survival curve
P(accepted drafts >= d), the sibling rank of accepted nodes, tau along the output, the split of
speculative time, and the measured speedup beside the analytic one

    S = tau * T(1) / (T(n) + T_draft)

where T(1) is the baseline's mean target forward, T(n) the speculative side's mean target forward
over its trees and T_draft its mean drafting time per step, all measured in the same run. The model
leaves out prefill, verification and the loop's own cost (the "overhead share", other / total, as
results.json defines it); on both sides of the comparison, so a gap can go either way.

A W&B offline run (wandb/offline-run-*) inside a specdec-run run dir is analysed through that run
dir. A W&B run on its own (copied without the run's files) is read from its run-*.wandb log, which
holds the run's summary but no per-prompt or per-step rows: the category, position and prompt
length analyses leave it out. With --wandb (the default when a W&B run is given) the tables and
plots also go to a new offline W&B run in the output dir.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from experiments import plots
from experiments.run import RUN_OUTPUTS, write_file
from experiments.summary import with_interval
from specdec.speedup import expected_tau, predicted_speedup

REQUIRED_RESULTS = (
    "drafter", "workload", "temperature", "num_prompts", "max_new_tokens", "tau", "speedup", "per_depth_alpha",
    "per_depth_attempts", "accepted_histogram", "mean_tree_nodes", "num_steps", "num_steps_baseline",
    "time_split", "time_split_baseline",
)
# runs before prefill_s was recorded count the prefill in target_s (and have no prefill part)
TIME_PARTS = ("prefill", "draft", "target", "verify", "other")
TIME_PART_NAMES = {
    "prefill": "prefill", "draft": "draft", "target": "target forward", "verify": "verify", "other": "loop overhead"
}
POSITION_BINS = 8  # bins of the output length for acceptance vs position
PER_RUN_FINDINGS_LIMIT = 6  # beyond this many runs the report keeps to cross-run findings and tables


class AnalyzeError(Exception):
    """Bad input: reported as one line without a traceback, exit status 2."""


# -- reading runs -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunFiles:
    """One run as read from disk."""

    path: Path  # the specdec-run run dir, or the W&B run dir when only its log was there
    results: dict[str, Any]  # results.json (or the summary specdec-run logged to W&B)
    prompts: list[dict[str, Any]] | None  # prompts.jsonl rows; None when read from a W&B log
    steps: list[dict[str, Any]] | None  # steps.jsonl rows; None when read from a W&B log
    overrides: list[str]  # the run's Hydra overrides; [] when unknown
    from_wandb: bool  # named on the command line as a W&B run


def find_runs(paths: list[Path]) -> list[RunFiles]:
    """Every run the given paths name: run dirs, sweep dirs (searched recursively) and W&B runs."""
    runs: dict[Path, RunFiles] = {}
    for path in paths:
        for run in _runs_at(path):
            runs.setdefault(run.path.resolve(), run)
    return list(runs.values())


def unfinished_runs(paths: list[Path]) -> list[Path]:
    """Run dirs under `paths` that Hydra started but that wrote no results.json (failed or killed)."""
    return sorted(
        hydra_dir.parent for path in paths if path.is_dir() for hydra_dir in path.rglob(".hydra")
        if not (hydra_dir.parent / "results.json").is_file()
    )


def _runs_at(path: Path) -> list[RunFiles]:
    if not path.exists():
        raise AnalyzeError(f"{path} does not exist; give a run dir or sweep dir written by specdec-run")
    if not path.is_dir():
        raise AnalyzeError(f"{path} is a file; give the folder specdec-run wrote (hydra.run.dir or hydra.sweep.dir)")
    if (path / "results.json").is_file():
        return with_rivals(read_run_dir(path, from_wandb=False))
    wandb_runs = _wandb_run_dirs(path)
    if wandb_runs:
        return [_read_wandb_run(run) for run in wandb_runs]
    found = sorted(p.parent for p in path.rglob("results.json") if "wandb" not in p.relative_to(path).parts)
    if found:
        return [each for run in found for each in with_rivals(read_run_dir(run, from_wandb=False))]
    if (path / ".hydra").is_dir() or any((path / name).exists() for name in RUN_OUTPUTS):
        raise AnalyzeError(
            f"{path} is a specdec-run run dir without results.json (written last): the run did not finish; rerun it"
        )
    raise AnalyzeError(
        f"{path} is not a specdec-run run dir (no results.json), a sweep dir (no results.json below it) or a W&B "
        f"offline run (no run-*.wandb); point at the folder specdec-run wrote (hydra.run.dir or hydra.sweep.dir)"
    )


def read_run_dir(path: Path, from_wandb: bool) -> RunFiles:
    results = _read_json(path / "results.json")
    _check_results(results, path / "results.json")
    overrides_file = path / ".hydra" / "overrides.yaml"
    overrides = [str(o) for o in yaml.safe_load(overrides_file.read_text()) or []] if overrides_file.is_file() else []
    recorded = results.get("overrides")
    if recorded is not None and overrides_file.is_file() and recorded != overrides:
        raise AnalyzeError(
            f"{path} mixes two runs: results.json was written with overrides {recorded}, but .hydra/overrides.yaml "
            f"holds {overrides} (a later run into the same dir stopped early); rerun it into a dir of its own"
        )
    prompts = _read_jsonl(path / "prompts.jsonl")
    if len(prompts) != results["num_prompts"]:
        raise AnalyzeError(
            f"{path} mixes two runs: results.json counts {results['num_prompts']} prompts, prompts.jsonl holds "
            f"{len(prompts)} rows; rerun it into a dir of its own"
        )
    return RunFiles(
        path=path,
        results=results,
        prompts=prompts,
        steps=_read_jsonl(path / "steps.jsonl"),
        overrides=recorded if recorded is not None else overrides,
        from_wandb=from_wandb,
    )


def with_rivals(run: RunFiles) -> list[RunFiles]:
    """A run, and the rivals measured beside it (specdec-run rivals=[...]) as runs of their own,
    each labelled by its drafter; they have results but no per-prompt or per-step rows."""
    rivals = run.results.get("rivals") or []
    if not rivals:
        return [run]
    shared = [o for o in run.overrides if _override_key(o) not in ("drafter", "rivals")]
    main = dataclasses.replace(run, overrides=[*shared, f"drafter={_override_value(run, 'drafter') or run.results['drafter']}"])
    for rival in rivals:
        _check_results(rival, run.path / "results.json")
    return [main] + [
        RunFiles(run.path / f"rival {rival['drafter']}", rival, None, None, [*shared, f"drafter={rival['drafter']}"], False)
        for rival in rivals
    ]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise AnalyzeError(f"{path} is not valid JSON ({error}); rerun the run that wrote it") from error
    if not isinstance(data, dict):
        raise AnalyzeError(f"{path} holds no JSON object; it is not a specdec-run results file")
    return data


def _check_results(results: dict[str, Any], source: Path) -> None:
    missing = [key for key in REQUIRED_RESULTS if key not in results]
    if missing:
        raise AnalyzeError(f"{source} is not a specdec-run results file: it lacks {', '.join(missing)}")


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise AnalyzeError(f"{path} is missing; a finished specdec-run run dir has it next to results.json")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise AnalyzeError(f"{path} line {number} is not valid JSON ({error})") from error
    return rows


# -- W&B offline runs -------------------------------------------------------------------------------
# A run-*.wandb file is wandb's transaction log: a 7-byte header (":W&B", magic 0xBEE1, version 0)
# and then LevelDB's log format, 32 KiB blocks of chunks (crc32c, length, type) that reassemble
# into protobuf `Record`s as defined by the installed wandb package. The checksums are not checked
# (crc32c is not in the standard library); a truncated last record (a killed run) is dropped.

WANDB_LOG_HEADER = b":W&B\xe1\xbe\x00"
LOG_BLOCK_BYTES = 32 * 1024
CHUNK_HEADER_BYTES = 7
CHUNK_FULL, CHUNK_FIRST, CHUNK_MIDDLE, CHUNK_LAST = 1, 2, 3, 4


def _wandb_run_dirs(path: Path) -> list[Path]:
    """The W&B run dirs `path` names: one offline-run-* dir, or those inside a `wandb` dir."""
    if list(path.glob("run-*.wandb")):
        return [path]
    return sorted(p for p in path.glob("offline-run-*") if p.is_dir() and list(p.glob("run-*.wandb")))


def _read_wandb_run(path: Path) -> RunFiles:
    """Through the specdec-run run dir that holds it when there is one (it has every file)."""
    run_dir = path.parent.parent
    if path.parent.name == "wandb" and (run_dir / "results.json").is_file():
        return read_run_dir(run_dir, from_wandb=True)
    log = sorted(path.glob("run-*.wandb"))[-1]
    records = read_wandb_log(log)
    results = _specdec_summary(records, log)
    results["config"] = _wandb_config(records)
    _check_results(results, log)
    return RunFiles(path=path, results=results, prompts=None, steps=None, overrides=[], from_wandb=True)


def read_wandb_log(path: Path) -> list[Any]:
    """The protobuf records of a W&B transaction log, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if not data.startswith(WANDB_LOG_HEADER):
        raise AnalyzeError(f"{path} does not start with a W&B log header; it is not a W&B offline run log")
    records, pending, position = [], b"", len(WANDB_LOG_HEADER)
    while position + CHUNK_HEADER_BYTES <= len(data):
        room = LOG_BLOCK_BYTES - position % LOG_BLOCK_BYTES
        if room < CHUNK_HEADER_BYTES:  # a block's tail too short for a chunk header is padding
            position += room
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + CHUNK_HEADER_BYTES])
        start = position + CHUNK_HEADER_BYTES
        if kind == 0 or start + length > len(data):  # zero padding, or the run was killed mid-write
            break
        chunk, position = data[start : start + length], start + length
        pending = chunk if kind in (CHUNK_FULL, CHUNK_FIRST) else pending + chunk
        if kind in (CHUNK_FULL, CHUNK_LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def _items(items) -> dict[str, Any]:
    """Summary/config update items -> {top-level key: value}."""
    values = {}
    for item in items:
        key = item.key or ".".join(item.nested_key)
        values[key] = json.loads(item.value_json)
    return values


def _specdec_summary(records: list[Any], log: Path) -> dict[str, Any]:
    """The summary specdec-run logged in one update at the end of the run. Later automatic updates
    (wandb copies each history row into the summary) are ignored: they would replace the run's tau
    with the last batch's."""
    for record in reversed(records):
        if record.WhichOneof("record_type") == "summary":
            values = _items(record.summary.update)
            if "speedup" in values:
                return values
    raise AnalyzeError(f"{log} holds no specdec-run summary: the run did not finish, so there is nothing to analyse")


def _wandb_config(records: list[Any]) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            config.update(_items(record.run.config.update))
        elif kind == "config":
            config.update(_items(record.config.update))
    config.pop("_wandb", None)
    return config


# -- labels -----------------------------------------------------------------------------------------


def _override_key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def varying_overrides(runs: list[RunFiles]) -> list[str]:
    """Override keys whose values differ between the runs, in order of first appearance."""
    keys: list[str] = []
    for run in runs:
        keys += [k for k in map(_override_key, run.overrides) if k not in keys]
    values = {key: {_override_value(run, key) for run in runs} for key in keys}
    return [key for key in keys if len(values[key]) > 1]


def _override_value(run: RunFiles, key: str) -> str | None:
    for override in run.overrides:
        if _override_key(override) == key:
            return override.split("=", 1)[1] if "=" in override else ""
    return None


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
        parts = [f"{names[key]}={_override_value(run, key)}" for key in keys if _override_value(run, key) is not None]
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


# -- findings: one sentence each, with its number -----------------------------------------------------


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


# -- tables -----------------------------------------------------------------------------------------


def _with_drafter(a: RunAnalysis) -> str:
    return a.label if a.drafter in a.label else f"{a.label} ({a.drafter})"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


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
            {True: "yes", False: "NO", None: "n/a"}[a.greedy_equal],
        ]
        for a in analyses
    ]


def categories_of(analyses: list[RunAnalysis]) -> list[str]:
    return sorted({name for a in analyses if a.category_tau for name in a.category_tau})


def category_table(analyses: list[RunAnalysis]) -> str:
    names = categories_of(analyses)
    rows = [
        [_with_drafter(a)]
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
            [_with_drafter(a) for a in with_steps], names,
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
    numeric = [k for k in keys if all(_is_number(_override_value(r, k)) for r in runs)]
    if not numeric:
        return None
    key, others = numeric[0], [k for k in keys if k != numeric[0]]
    names = short_names(keys)
    points: dict[str, list[tuple[float, RunAnalysis]]] = {}
    for run, analysis in zip(runs, analyses):
        group = " ".join(f"{names[k]}={_override_value(run, k)}" for k in others) or analysis.drafter
        points.setdefault(group, []).append((float(_override_value(run, key)), analysis))
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
        lines += [f"Left out (read from a W&B log, which has no per-prompt rows): {', '.join(without)}.", ""]
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
    import wandb

    (out / "analysis-wandb").mkdir(exist_ok=True)
    run = wandb.init(
        project="specdec-analysis",
        dir=str(out / "analysis-wandb"),
        mode="offline",
        name=f"analysis-{out.name}",
        config={"inputs": [str(p) for p in inputs]},
        settings=wandb.Settings(console="off", silent=True),
    )
    try:
        names = categories_of(analyses)
        run.log({
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
        })
        return str(Path(run.dir).parent)  # run.dir is its files/ folder
    finally:
        run.finish()


# -- entry point ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Written:
    out: Path
    report: Path
    plots: list[Path]
    wandb_dir: str | None  # the offline W&B run written, if any


def analyze(inputs: list[Path], out: Path | None = None, wandb: bool | None = None) -> Written:
    """Analyse the runs under `inputs` into `out` (default: the one input). wandb: log to a new
    offline W&B run; None = when a W&B run is among the inputs and wandb is importable."""
    if out is None and len(inputs) != 1:
        raise AnalyzeError(f"{len(inputs)} inputs given; say where the report goes with --out DIR")
    runs = find_runs(inputs)
    if out is None:  # a W&B run inside a run dir reports into that run dir
        out = runs[0].path if len(runs) == 1 and runs[0].from_wandb else inputs[0]
    analyses = [analyze_run(run, label) for run, label in zip(runs, label_runs(runs))]
    pngs = make_plots(analyses, runs)
    out.mkdir(parents=True, exist_ok=True)
    for name, data in pngs.items():
        write_file(out / name, data)
    report = out / "report.md"
    write_file(report, report_markdown(analyses, pngs, inputs).encode())
    wandb_dir = None
    if wandb is None:
        wandb = any(run.from_wandb for run in runs) and _wandb_importable()
    if wandb:
        if not _wandb_importable():
            raise AnalyzeError("--wandb needs the wandb package: pip install wandb (it logs offline, no account)")
        wandb_dir = log_to_wandb(out, analyses, pngs, inputs)
    return Written(out, report, [out / name for name in pngs], wandb_dir)


def _wandb_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("wandb") is not None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="specdec-analyze",
        description="Acceptance analysis of specdec-run outputs: report.md + PNG plots (offline).",
    )
    parser.add_argument("inputs", nargs="+", type=Path, metavar="RUN_DIR",
                        help="a specdec-run run dir, a Hydra multirun sweep dir, or a W&B offline run dir")
    parser.add_argument("--out", type=Path, help="where report.md and the plots go (default: the one RUN_DIR)")
    parser.add_argument("--wandb", action=argparse.BooleanOptionalAction, default=None,
                        help="also log tables and plots to a new offline W&B run in --out "
                             "(default: when a W&B run is given)")
    args = parser.parse_args(argv)
    try:
        written = analyze(args.inputs, args.out, args.wandb)
    except AnalyzeError as error:
        print(f"specdec-analyze: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"specdec-analyze: wrote {written.report} and {len(written.plots)} plots to {written.out}")
    if written.wandb_dir:
        print(f"specdec-analyze: offline W&B run in {written.wandb_dir} (wandb sync to upload)")


if __name__ == "__main__":
    main()
