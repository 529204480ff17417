"""Finding specdec-run's runs on disk and reading each into ``RunFiles``: run dirs, sweep dirs (every
run below), W&B offline runs, and the rivals a run measured beside its drafter. What is not one
finished run is refused with an ``AnalyzeError`` that says what to point at instead.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from experiments.analyze import wandb_log
from experiments.analyze.errors import AnalyzeError
from experiments.common import records
from experiments.common.outputs import RUN_OUTPUTS

REQUIRED_RESULTS = (
    "drafter", "workload", "temperature", "num_prompts", "max_new_tokens", "tau", "speedup", "per_depth_alpha",
    "per_depth_attempts", "accepted_histogram", "mean_tree_nodes", "num_steps", "num_steps_baseline",
    "time_split", "time_split_baseline",
)


@dataclass(frozen=True)
class RunFiles:
    """One run as read from disk."""

    path: Path  # the specdec-run run dir, or the W&B run dir when only its log was there
    results: dict[str, Any]  # results.json (or the summary specdec-run logged to W&B)
    prompts: list[dict[str, Any]] | None  # prompts.jsonl rows, or a W&B log's prompts table; None for a rival
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
    _check_prompt_count(results, prompts, path, "prompts.jsonl")
    _check_units(results, _read_jsonl(path / "units.jsonl"), path / "units.jsonl")
    return RunFiles(
        path=path,
        results=results,
        prompts=prompts,
        steps=_read_jsonl(path / "steps.jsonl"),
        overrides=recorded if recorded is not None else overrides,
        from_wandb=from_wandb,
    )


def _check_prompt_count(results: dict[str, Any], prompts: list[dict[str, Any]], path: Path, source: str) -> None:
    if len(prompts) != results["num_prompts"]:
        raise AnalyzeError(
            f"{path} mixes two runs: its results count {results['num_prompts']} prompts, {source} holds "
            f"{len(prompts)} rows; rerun it into a dir of its own"
        )


def _check_units(results: dict[str, Any], rows: list[dict[str, Any]], source: Path) -> None:
    """units.jsonl must hold every unit, side and pass, and give every interval of results.json again
    (experiments.common.records): the intervals are recomputed from it, so a damaged file is a damaged run."""
    sides = [records.BASELINE, records.SPECULATIVE,
             *[side["drafter"] for side in results.get("rivals", []) + results.get("peers", [])]]
    try:
        records.check_rows(rows, sides, results.get("repeats", 1), str(source))
    except records.RecordsError as error:
        raise AnalyzeError(f"{error}; rerun the run that wrote it") from error
    if results.get("units") is not None and len(rows) != results["units"]:
        raise AnalyzeError(f"{source} holds {len(rows)} units where results.json counts {results['units']}; rerun it")
    found = records.disagreements(results, rows)
    if found:
        raise AnalyzeError(f"{source} does not give results.json's intervals again ({'; '.join(found[:3])}): "
                           f"one of the two was changed or damaged; rerun the run")


def with_rivals(run: RunFiles) -> list[RunFiles]:
    """A run, and the rivals measured beside it (specdec-run rivals=[...]) as runs of their own,
    each labelled by its drafter; they have results but no per-prompt or per-step rows."""
    rivals = run.results.get("rivals") or []
    if not rivals:
        return [run]
    shared = [o for o in run.overrides if override_key(o) not in ("drafter", "rivals")]
    main = dataclasses.replace(run, overrides=[*shared, f"drafter={override_value(run, 'drafter') or run.results['drafter']}"])
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


def _wandb_run_dirs(path: Path) -> list[Path]:
    """The W&B run dirs `path` names: one offline-run-* dir, or those inside a `wandb` dir."""
    if list(path.glob("run-*.wandb")):
        return [path]
    return sorted(p for p in path.glob("offline-run-*") if p.is_dir() and list(p.glob("run-*.wandb")))


def _read_wandb_run(path: Path) -> RunFiles:
    """Through the specdec-run run dir that holds it when there is one (it has every file); else
    through wandb's reader of the run's log (experiments.analyze.wandb_log)."""
    run_dir = path.parent.parent
    if path.parent.name == "wandb" and (run_dir / "results.json").is_file():
        return read_run_dir(run_dir, from_wandb=True)
    logged = wandb_log.read_run(path)
    results = wandb_log.logged_results(logged)
    _check_results(results, path)
    prompts = wandb_log.table_rows(logged, "prompts")
    if prompts is not None:
        _check_prompt_count(results, prompts, path, "its prompts table")
    overrides = [str(o) for o in results.get("overrides") or []]  # none when run() was called from Python
    return RunFiles(path=path, results=results, prompts=prompts, steps=None, overrides=overrides, from_wandb=True)


# -- overrides --------------------------------------------------------------------------------------


def override_key(override: str) -> str:
    """`key` of `key=value`, `+key=value` or `~key`."""
    return override.lstrip("+~").split("=", 1)[0]


def override_value(run: RunFiles, key: str) -> str | None:
    for override in run.overrides:
        if override_key(override) == key:
            return override.split("=", 1)[1] if "=" in override else ""
    return None

