"""make_sink looks a logger's name up in the SINKS registry: every name a config may give builds a
sink, and any other name is refused with the choices."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from experiments.analyze.sinks import SINKS, JsonlSink, MetricSink, NullSink, StdoutSink, make_sink


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
