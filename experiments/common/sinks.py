"""Where a run's metrics go while it runs: nowhere, the console, a JSONL file, or Weights & Biases.

The run's own record (results.json, steps.jsonl, ...) is written by specdec-run whatever the sink; a
sink is the live view of it. Each sink registers a factory in ``SINKS`` under the name a config gives
as ``logger`` (none, stdout, jsonl, wandb); wandb is imported only when its sink is built. The run's
summary may come with ``Table``s (per-prompt rows, per-depth acceptance): W&B shows them as tables,
the other sinks leave them out, as the run dir holds the same rows. ``log_offline_run`` is the one
place a report (specdec-analyze's, the leaderboard's) becomes an offline W&B run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from rich.console import Console

from specdec.files import write_atomically
from specdec.registry import Registry


@dataclass(frozen=True)
class Table:
    """Rows with named columns, for a sink that shows tables."""

    columns: list[str]
    rows: list[list[Any]]  # one value per column


@runtime_checkable
class MetricSink(Protocol):
    def log(self, metrics: dict[str, Any], step: int) -> None: ...

    def log_summary(self, summary: dict[str, Any], tables: dict[str, Table] | None = None) -> None: ...

    def finish(self) -> None: ...


# Not frozen: it is a node of specdec-run's and specdec-train's Hydra schemas, which Hydra merges into.
@dataclass
class LoggerConfig:
    """configs/logger/NAME.yaml, the logger= group of specdec-run and specdec-train."""

    name: str = "jsonl"  # a SINKS name: none | stdout | jsonl | wandb
    project: str = "specdec"  # wandb
    mode: str | None = None  # wandb: offline | online | disabled; null = $WANDB_MODE or offline


# make_sink calls every factory alike, with all of its arguments as keywords; each factory takes
# what its sink needs.
SINKS: Registry[Callable[..., MetricSink]] = Registry("logger")


class NullSink:
    def log(self, metrics: dict[str, Any], step: int) -> None:
        pass

    def log_summary(self, summary: dict[str, Any], tables: dict[str, Table] | None = None) -> None:
        pass

    def finish(self) -> None:
        pass


@SINKS.register("none")
def _null_sink(**_: Any) -> MetricSink:
    return NullSink()


class StdoutSink:
    """One line per log call; through rich so it prints above a live progress bar."""

    def __init__(self, console: Console) -> None:
        self.console = console

    def log(self, metrics: dict[str, Any], step: int) -> None:
        fields = "  ".join(f"{key}={_short(value)}" for key, value in metrics.items())
        self.console.print(f"[dim]step {step}[/dim]  {fields}", highlight=False)

    def log_summary(self, summary: dict[str, Any], tables: dict[str, Table] | None = None) -> None:
        pass  # the run prints its own summary table

    def finish(self) -> None:
        pass


@SINKS.register("stdout")
def _stdout_sink(*, console: Console, **_: Any) -> MetricSink:
    return StdoutSink(console)


class JsonlSink:
    """One JSON line per call, flushed, so a killed run keeps every finished line.

    ``keep_until_step``: None starts a new file (a rerun into a used dir must not mix two runs);
    N continues a run resumed from step N, keeping its lines up to step N (not the summary), so the
    steps it trains again are not logged twice.
    """

    def __init__(self, path: Path, keep_until_step: int | None = None) -> None:
        self.path = path
        kept = [] if keep_until_step is None else _lines_until(path, keep_until_step)
        write_atomically(path, lambda temporary: temporary.write_text("".join(kept), encoding="utf-8"))
        self._file = path.open("a", encoding="utf-8")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self._write({"step": step, **metrics})

    def log_summary(self, summary: dict[str, Any], tables: dict[str, Table] | None = None) -> None:
        self._write({"summary": summary})  # the tables' rows are in the run dir's own files

    def finish(self) -> None:
        self._file.close()

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")  # one write per line: never half a record
        self._file.flush()


@SINKS.register("jsonl")
def _jsonl_sink(*, run_dir: Path, keep_until_step: int | None, **_: Any) -> MetricSink:
    return JsonlSink(run_dir / "metrics.jsonl", keep_until_step)


class WandbSink:
    """A W&B run stored under run_dir/wandb. Offline unless told otherwise: never needs an account.

    mode: "offline" | "online" | "disabled"; None = $WANDB_MODE if set, else "offline".
    name: the run's name in W&B (specdec-run: the Hydra overrides that made it; None = a name W&B
    makes up); group: shared by the runs W&B should compare as one (specdec-run -m: the sweep dir;
    None = no group).
    """

    def __init__(
        self, run_dir: Path, project: str, mode: str | None, config: dict[str, Any], name: str | None,
        group: str | None = None,
    ) -> None:
        import wandb  # wandb: ~0.6 s to import, for the wandb sink alone

        mode = mode or os.environ.get("WANDB_MODE") or "offline"
        if mode not in ("offline", "online", "disabled"):
            raise ValueError(f"logger.mode must be offline, online or disabled; got {mode!r}")
        # console="off": wandb would otherwise wrap stdout and garble the live progress bar
        self._run = wandb.init(
            project=project,
            dir=str(run_dir),
            mode=mode,
            config=config,
            name=name,
            group=group,
            settings=wandb.Settings(console="off", silent=True),
        )

    def log(self, metrics: dict[str, Any], step: int) -> None:
        # commit now: a row left pending is committed at finish(), after log_summary, and W&B
        # copies a committed row's values into the summary (the run's tau would become the last
        # batch's)
        self._run.log(metrics, step=step, commit=True)

    def log_summary(self, summary: dict[str, Any], tables: dict[str, Table] | None = None) -> None:
        import wandb  # wandb: ~0.6 s to import, for the wandb sink alone (loaded by __init__)

        # tables in the summary, not in a history row: W&B's table panels read a run's summary, and a
        # row would be copied into the summary after the run's own figures
        self._run.summary.update({
            **summary,
            **{name: wandb.Table(columns=table.columns, data=table.rows) for name, table in (tables or {}).items()},
        })

    def finish(self) -> None:
        self._run.finish()


@SINKS.register("wandb")
def _wandb_sink(
    *, run_dir: Path, project: str, mode: str | None, config: dict[str, Any], run_name: str | None,
    group: str | None, **_: Any
) -> MetricSink:
    return WandbSink(run_dir, project, mode, config, run_name, group)


def log_offline_run(folder: Path, project: str, name: str, values: Callable[[Any], dict[str, Any]],
                    config: dict[str, Any] | None = None) -> str:
    """A new offline W&B run under ``folder`` that logs ``values(wandb)`` once: a report's tables and
    plots (specdec-analyze's, the leaderboard's), not a run's live metrics. Returns the run's dir."""
    import wandb  # wandb: ~0.6 s to import, for offline reports alone

    folder.mkdir(parents=True, exist_ok=True)
    run = wandb.init(project=project, dir=str(folder), mode="offline", name=name, config=config,
                     settings=wandb.Settings(console="off", silent=True))
    try:
        run.log(values(wandb))
        return str(Path(run.dir).parent)  # run.dir is its files/ folder
    finally:
        run.finish()


def make_sink(
    name: str,
    run_dir: Path,
    console: Console,
    config: dict[str, Any],
    project: str = "specdec",
    mode: str | None = None,
    run_name: str | None = None,
    keep_until_step: int | None = None,
    group: str | None = None,
) -> MetricSink:
    """The sink registered as `name` in SINKS (a ValueError naming the choices if none is);
    project/mode/run_name/group are for wandb only (see WandbSink), keep_until_step for jsonl only
    (see JsonlSink)."""
    return SINKS.get(name)(
        run_dir=run_dir, console=console, config=config, project=project, mode=mode, run_name=run_name,
        keep_until_step=keep_until_step, group=group,
    )


def _lines_until(path: Path, step: int) -> list[str]:
    """The complete step lines of ``path`` up to ``step``; a killed writer may have left half a line."""
    if not path.exists():
        return []
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        try:
            record = json.loads(line) if line.endswith("\n") else None
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            kept.append(line)
    return kept


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, list):
        return "[" + " ".join(_short(v) for v in value) + "]"
    return str(value)
