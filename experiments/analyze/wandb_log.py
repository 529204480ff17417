"""What specdec-run logged to a W&B offline run, read through wandb's own reader of its run-*.wandb
transaction log: ``wandb leet inspect --json`` (wandb >= 0.31), which prints each record as one JSON
object. No Python API of wandb reads that log (the old ``DataStore`` is gone); its CLI does, with the
same code that wrote it, so a change of the log's format is wandb's to follow, not ours.

specdec-run's summary is the one summary update that holds "speedup" (its sinks.WandbSink writes the
run's figures and tables in one update); the other updates are per-batch rows that W&B copies into
the summary, and a row still pending at the end is copied after it, so merging every update in order
could replace the run's tau with the last batch's. Tables in the summary are files under the run's
``files/`` dir in W&B's table JSON (``columns``, ``data``).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.version import Version

from experiments.analyze.errors import AnalyzeError

READER_SINCE = Version("0.31")  # the first wandb whose `leet inspect` prints records as JSON
READER_TIMEOUT_S = 120


@dataclass(frozen=True)
class LoggedRun:
    """One W&B offline run as its log and files hold it."""

    name: str | None  # the run's display name (specdec-run: its Hydra overrides); None = W&B's own
    group: str | None  # the group it shares with the runs of its sweep; None = none
    config: dict[str, Any]  # the run's config, wandb's own "_wandb" entry left out
    summary: dict[str, Any]  # specdec-run's summary update; its tables stay references (see tables)
    tables: dict[str, dict[str, list]]  # summary key -> {"columns": [...], "data": [[...], ...]}


def read_run(run_dir: Path) -> LoggedRun:
    """The W&B offline run in run_dir (a wandb/offline-run-* dir holding one run-*.wandb) that
    specdec-run logged; an AnalyzeError if it is not one or did not finish."""
    logs = sorted(run_dir.glob("run-*.wandb"))
    if len(logs) != 1:
        raise AnalyzeError(f"{run_dir} holds {len(logs)} run-*.wandb logs; give a W&B run dir with exactly one")
    records = read_records(logs[0])
    run = next((r["run"] for r in records if r["type"] == "run"), None)
    if run is None:
        raise AnalyzeError(f"{logs[0]} holds no run record; it was cut short before the run started")
    config = _values(run.get("config"))
    for record in records:
        if record["type"] == "config":
            config.update(_values(record["config"]))
    config.pop("_wandb", None)
    updates = [_values(r["summary"]) for r in records if r["type"] == "summary"]
    summary = next((update for update in reversed(updates) if "speedup" in update), None)
    if summary is None:
        raise AnalyzeError(
            f"{logs[0]} holds no specdec-run summary: the run did not finish, so there is nothing to analyse"
        )
    tables = {key: _read_table(run_dir / "files" / value["path"]) for key, value in summary.items() if _is_table(value)}
    return LoggedRun(
        name=run.get("display_name") or None,
        group=run.get("run_group") or None,
        config=config,
        summary=summary,
        tables=tables,
    )


def logged_results(run: LoggedRun) -> dict[str, Any]:
    """results.json as specdec-run logged it: the run's summary without the tables, with the run's
    config under "config"."""
    return {**{k: v for k, v in run.summary.items() if k not in run.tables}, "config": run.config}


def table_rows(run: LoggedRun, name: str) -> list[dict[str, Any]] | None:
    """The rows of the summary's table ``name`` as dicts (column -> value); None if it has none
    (specdec-run logs ``prompts``, prompts.jsonl without the outputs' token ids, since 2026-12-03)."""
    table = run.tables.get(name)
    return None if table is None else [dict(zip(table["columns"], row)) for row in table["data"]]


def read_records(log: Path) -> list[dict[str, Any]]:
    """The records of a run-*.wandb log, in order, each as `wandb leet inspect --json` prints it
    ({"num": ..., "type": "run" | "summary" | ..., <type>: {...}})."""
    installed = Version(importlib.metadata.version("wandb"))
    if installed < READER_SINCE:
        raise AnalyzeError(
            f"reading {log} needs wandb >= {READER_SINCE} (its `wandb leet inspect --json`); wandb {installed} is "
            f"installed: pip install -U 'wandb>={READER_SINCE}'"
        )
    # offline: the CLI would otherwise report its own errors to W&B's server. Its debug log goes into
    # WANDB_DIR/wandb, a scratch dir here, not into the working dir.
    with tempfile.TemporaryDirectory() as scratch:
        (Path(scratch) / "wandb").mkdir()
        done = subprocess.run(
            [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log.resolve())],
            cwd=scratch, env={**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": scratch},
            capture_output=True, text=True, timeout=READER_TIMEOUT_S,
        )
    if done.returncode != 0:
        raise AnalyzeError(f"wandb could not read {log}: {_last_line(done.stderr)}")
    records = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    if not records or records[0]["type"] != "header":
        raise AnalyzeError(f"{log} is not a W&B run log (wandb read no header record from it)")
    return records


def _values(update: dict[str, Any] | None) -> dict[str, Any]:
    """A config or summary record's {"update": {key: value}} as {key: value}."""
    return dict((update or {}).get("update", {}))


def _is_table(value: Any) -> bool:
    return isinstance(value, dict) and value.get("_type") == "table-file"


def _read_table(path: Path) -> dict[str, list]:
    try:
        table = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise AnalyzeError(f"{path}: a table the W&B run's summary names cannot be read ({error})") from error
    return {"columns": table["columns"], "data": table["data"]}


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no message"
