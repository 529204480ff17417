"""make_sink looks a logger's name up in the SINKS registry: every name a config may give builds a
sink, and any other name is refused with the choices. The W&B sink names and groups its run and
puts the run's figures and tables in its summary, as wandb's own reader of the log finds them."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from experiments.analyze import wandb_log
from experiments.common.sinks import SINKS, JsonlSink, MetricSink, NullSink, StdoutSink, Table, make_sink


def test_the_registry_holds_the_loggers_a_config_names():
    assert SINKS.names() == ["jsonl", "none", "stdout", "wandb"]


@pytest.mark.parametrize("name,kind", [("none", NullSink), ("stdout", StdoutSink), ("jsonl", JsonlSink)])
def test_each_name_builds_its_sink(tmp_path, name, kind):
    output = io.StringIO()
    sink = make_sink(name, tmp_path, Console(file=output), {"seed": 0})
    assert isinstance(sink, kind) and isinstance(sink, MetricSink)
    sink.log({"tau": 2.5}, step=1)
    sink.finish()
    if name == "jsonl":
        assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "tau": 2.5}
    if name == "stdout":
        assert "tau=2.5" in output.getvalue()


def test_an_unknown_name_is_refused_with_the_choices(tmp_path):
    with pytest.raises(ValueError, match="unknown logger 'tensorboard'; choose one of jsonl, none, stdout, wandb"):
        make_sink("tensorboard", tmp_path, Console(file=io.StringIO()), {})


def test_a_sink_without_tables_logs_the_summary_alone(tmp_path):
    sink = make_sink("jsonl", tmp_path, Console(file=io.StringIO()), {})
    sink.log_summary({"tau": 2.5}, {"per_depth": Table(["depth", "alpha"], [[1, 0.5]])})
    sink.finish()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"summary": {"tau": 2.5}}


def test_the_wandb_sink_names_and_groups_its_run_and_puts_figures_and_tables_in_the_summary(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))  # W&B stages table files there
    sink = make_sink("wandb", tmp_path, Console(file=io.StringIO()), {"seed": 3}, mode="offline",
                     run_name="sampling.temperature=1", group="multirun/sweep")
    for step in range(2):
        sink.log({"tau": 9.0, "batch_only": 1.0}, step=step)
    summary = {"tau": 2.5, "tau_interval": [2.25, 2.75], "tau_interval_low": 2.25, "tau_interval_high": 2.75,
               "speedup": 1.5}
    sink.log_summary(summary, {"per_depth": Table(["depth", "alpha"], [[1, 0.5], [2, 0.25]])})
    sink.finish()

    [run_dir] = (tmp_path / "wandb").glob("offline-run-*")
    logged = wandb_log.read_run(run_dir)
    assert (logged.name, logged.group, logged.config) == ("sampling.temperature=1", "multirun/sweep", {"seed": 3})
    assert logged.tables == {"per_depth": {"columns": ["depth", "alpha"], "data": [[1, 0.5], [2, 0.25]]}}
    # the run's own figures, not the batch rows W&B also copied into the summary
    assert {key: logged.summary[key] for key in summary} == summary and "batch_only" not in logged.summary
