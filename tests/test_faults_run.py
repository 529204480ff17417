"""Faults on the measuring side: specdec-run killed at every write and at random times, reruns into
a used run dir, and generated malformed command lines, prompt files and model folders.

The claim under test: nothing half-written is ever read as complete, a run dir holds one run, and
every bad input ends in one line naming it (exit status 2), before the model loads wherever the
input can be checked without it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import string
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_run_cli import SMALL, forbid_model_loading, read_jsonl, run_command, run_in_process
from tiny_models import tiny_model

from experiments.analyze import command as specdec_analyze
from experiments import cli
from experiments.cli import CommandLineError, check_overrides
from experiments.run import build, command, schema, workloads

SLOW_SYNTHETIC = [*SMALL, "workload.num_prompts=4", "target.forward_ms=40", "logger=jsonl"]


def outputs(run_dir: Path) -> list[list[int]]:
    return [row["output"] for row in read_jsonl(run_dir / "prompts.jsonl")]


def assert_complete_or_absent(run_dir: Path) -> None:
    """Every file in a run dir parses to its end; results.json (written last) implies the rest."""
    assert not list(run_dir.glob(".*.tmp")), "a temporary file was left behind"
    for path in run_dir.glob("*.jsonl"):
        read_jsonl(path)  # raises on a half-written line
    for path in run_dir.glob("*.png"):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if (run_dir / "results.json").exists():
        results = json.loads((run_dir / "results.json").read_text())
        assert len(read_jsonl(run_dir / "prompts.jsonl")) == results["num_prompts"]
        assert (run_dir / "steps.jsonl").exists()


# -- kills ---------------------------------------------------------------------------------------------


@pytest.mark.slow  # heavy: CI runs it after the default suite
def test_a_run_killed_at_every_write_leaves_no_partial_file_and_reruns_to_the_same_outputs(tmp_path, monkeypatch):
    reference = tmp_path / "reference"
    run_in_process(reference, SMALL)
    writes = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (writes.append(b), real_replace(a, b)))
    run_in_process(tmp_path / "count", SMALL)
    monkeypatch.undo()
    assert [Path(w).name for w in writes][-1] == "results.json"
    for kill_at in range(len(writes)):  # a kill just before the k-th file is renamed into place
        run_dir = tmp_path / f"killed-{kill_at}"
        calls = []

        def replace_or_die(source, destination):
            calls.append(destination)
            if len(calls) > kill_at:
                raise KeyboardInterrupt
            real_replace(source, destination)

        with monkeypatch.context() as patched:
            patched.setattr(os, "replace", replace_or_die)
            with pytest.raises(KeyboardInterrupt):
                run_in_process(run_dir, SMALL)
        assert_complete_or_absent(run_dir)
        assert not (run_dir / "results.json").exists()
        with pytest.raises(specdec_analyze.AnalyzeError, match="did not finish" if any(run_dir.iterdir()) else "not a"):
            specdec_analyze.analyze([run_dir])
        run_in_process(run_dir, SMALL)  # the rerun into the same dir
        assert outputs(run_dir) == outputs(reference)
        assert len(read_jsonl(run_dir / "metrics.jsonl")) == len(read_jsonl(reference / "metrics.jsonl"))
        specdec_analyze.analyze([run_dir])


@pytest.mark.slow
def test_specdec_run_killed_at_random_times_never_leaves_a_partial_run(tmp_path):
    reference = tmp_path / "reference"
    done = run_command([*SLOW_SYNTHETIC, f"hydra.run.dir={reference}"], tmp_path)
    assert done.returncode == 0, done.stderr
    start = time.perf_counter()
    run_command([*SLOW_SYNTHETIC, f"hydra.run.dir={tmp_path / 'timed'}"], tmp_path)
    duration = time.perf_counter() - start
    run_dir = tmp_path / "killed"
    for delay in sorted(random.Random(0).uniform(0.5, duration) for _ in range(6)):
        process = subprocess.Popen(
            [sys.executable, "-m", "experiments.run", *SLOW_SYNTHETIC, f"hydra.run.dir={run_dir}"],
            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        time.sleep(delay)
        process.send_signal(signal.SIGKILL)
        process.wait()
        if run_dir.exists():
            assert_complete_or_absent(run_dir)
            if (run_dir / "results.json").exists():
                specdec_analyze.analyze([run_dir])
            else:
                with pytest.raises(specdec_analyze.AnalyzeError, match="did not finish"):
                    specdec_analyze.analyze([run_dir])
    done = run_command([*SLOW_SYNTHETIC, f"hydra.run.dir={run_dir}"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert outputs(run_dir) == outputs(reference)


# -- one run per run dir ----------------------------------------------------------------------------


def test_a_rerun_that_stops_early_leaves_nothing_of_the_previous_run(tmp_path, monkeypatch):
    run_in_process(tmp_path, [*SMALL, "workload.num_prompts=4"])
    assert (tmp_path / "results.json").exists()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(command, "measure", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_in_process(tmp_path, [*SMALL, "workload.num_prompts=2", "drafter=ngram"])
    # results, prompts, steps and plots all went; the new run's metrics file holds nothing yet
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]
    assert (tmp_path / "metrics.jsonl").read_text() == ""


@pytest.mark.integration  # two whole runs; the fast tier keeps the rerun that stops early (above)
def test_a_rerun_replaces_the_metrics_of_the_previous_run(tmp_path):
    run_in_process(tmp_path, SMALL)
    first = read_jsonl(tmp_path / "metrics.jsonl")
    run_in_process(tmp_path, SMALL)
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == len(first)


@pytest.mark.integration
def test_a_rerun_keeps_files_that_are_not_a_runs(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    run_in_process(tmp_path, SMALL)
    run_in_process(tmp_path, SMALL)
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.integration
def test_analyze_refuses_a_dir_whose_records_disagree_with_its_config(tmp_path):
    done = run_command([*SMALL, "logger=none", f"hydra.run.dir={tmp_path}"], tmp_path)
    assert done.returncode == 0, done.stderr
    specdec_analyze.analyze([tmp_path])  # consistent: analysed
    overrides = tmp_path / ".hydra" / "overrides.yaml"
    overrides.write_text(yaml.safe_dump([*SMALL, "drafter=ngram", "workload.num_prompts=2"]))
    with pytest.raises(specdec_analyze.AnalyzeError, match="mixes two runs"):
        specdec_analyze.analyze([tmp_path])


# -- bad prompt files and model folders ---------------------------------------------------------------


@pytest.mark.parametrize("content, message", [
    (b'{"prompt": "a"}\n{"prompt": "b"\n', "line 2 is not valid JSON"),
    (b'{"prompt": "a"}\n{"prompt": "\xff\xfe"}\n', "line 2 is not UTF-8 text"),
    (b'{"prompt": "a"}\n[1, 2]\n', "line 2 holds a JSON list, not an object"),
    (b"\n\n", "is empty"),
])
def test_a_malformed_prompt_file_names_the_file_and_line_before_loading(tmp_path, monkeypatch, content, message):
    forbid_model_loading(monkeypatch)
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(content)
    with pytest.raises(cli.SpecdecUserError, match=f"{path}.*{message}"):
        run_in_process(tmp_path / "run", ["workload=jsonl", f"workload.path={path}", "drafter=ngram"])


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    tiny_model("llama").save_pretrained(path)
    return path


def broken_copy(source: Path, destination: Path, damage: str) -> Path:
    destination.mkdir()
    if damage == "empty":
        return destination
    for file in source.iterdir():
        (destination / file.name).write_bytes(file.read_bytes())
    if damage == "corrupt config":
        (destination / "config.json").write_text('{"model_type": "llama", ')
    elif damage == "no model type":
        (destination / "config.json").write_text('{"hidden_size": 64}')
    elif damage == "no weights":
        (destination / "model.safetensors").unlink()
    elif damage == "corrupt weights":
        (destination / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    return destination


@pytest.mark.parametrize("damage, message", [
    ("empty", "has no config.json"),
    ("corrupt config", "config.json is not valid JSON"),
    ("no model type", "config.json names no model_type"),
    ("no weights", "holds no weights"),
    ("corrupt weights", "model.safetensors is not a readable safetensors file"),
])
def test_a_broken_model_folder_is_one_line_naming_it_before_loading(tmp_path, monkeypatch, model_folder, damage, message):
    forbid_model_loading(monkeypatch)
    folder = broken_copy(model_folder, tmp_path / "model", damage)
    with pytest.raises(cli.SpecdecUserError, match=f"target.path={folder}.*{message}"):
        run_in_process(tmp_path / "run", ["target=hf", f"target.path={folder}", "workload=synthetic", "drafter=ngram"])


@pytest.mark.integration  # a subprocess; the fast tier checks the same folders in process (above)
def test_a_broken_model_folder_on_the_command_line_exits_2_in_one_line(tmp_path, model_folder):
    folder = broken_copy(model_folder, tmp_path / "model", "corrupt config")
    done = run_command(["target=hf", f"target.path={folder}", "workload.chat=false", "drafter=ngram",
                        f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"specdec-run: error: target.path={folder}: config.json is not valid JSON")


def test_a_missing_drafter_checkpoint_is_refused_before_the_target_loads(tmp_path, monkeypatch):
    forbid_model_loading(monkeypatch)
    monkeypatch.setattr(build, "open_target", lambda *a, **k: pytest.fail("the target was opened"))
    for overrides in (["drafter=eagle3"], ["drafter=union"]):  # a head, and a union member's head
        key = "drafter.checkpoint" if overrides == ["drafter=eagle3"] else "drafter.members.0.checkpoint"
        with pytest.raises(cli.SpecdecUserError, match=f"checkpoint={tmp_path / 'gone'} is not a folder"):
            run_in_process(tmp_path / "run", [*overrides, f"{key}={tmp_path / 'gone'}"])
    done = run_command(["drafter=eagle3", f"drafter.checkpoint={tmp_path / 'gone'}", f"hydra.run.dir={tmp_path / 'cli'}"],
                       tmp_path)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "cli").exists()  # refused before Hydra made the run dir


# -- generated malformed command lines and prompt files --------------------------------------------

# key -> values that must each be refused (the schema's type, or a check in checked_settings)
BAD_VALUES = {
    "max_new_tokens": st.one_of(st.integers(max_value=0), st.just("abc"), st.just("1.5")),
    "batch_size": st.one_of(st.integers(max_value=0), st.just("many")),
    "threads": st.integers(max_value=0),
    "warmup_tokens": st.integers(max_value=-1),
    "seed": st.just("x"),
    "sampling.temperature": st.one_of(st.floats(max_value=-0.01, allow_nan=False, allow_infinity=False), st.just("hot")),
    "sampling.top_p": st.one_of(st.floats(max_value=0.0, allow_nan=False, allow_infinity=False),
                                st.floats(min_value=1.01, allow_nan=False, allow_infinity=False)),
    "sampling.top_k": st.integers(max_value=-1),
    "workload.num_prompts": st.integers(max_value=0),
    "target.dtype": st.sampled_from(["float8", "int4", "fp32"]),
    "target.packed_gemm_from": st.one_of(st.integers(max_value=0), st.just("fast")),
    "target.device": st.sampled_from(["gpu", "cuda:x", "tpu"]),
    "budget.mode": st.sampled_from(["magic", "Auto"]),
    "budget.max_depth": st.integers(max_value=0),
    "drafter_quant": st.sampled_from(["int3", "nf4"]),
    "rivals": st.sampled_from(["[nope]", "[{drafter: eagle3, dpeth: 2}]", "[none]"]),
    "drafter.depth": st.sampled_from(["deep"]),
}
GROUPS = ("drafter", "verifier", "target", "workload", "sampling", "logger", "experiment")
NAMES = st.text(string.ascii_lowercase + "_", min_size=3, max_size=12)


@st.composite
def malformed_command_lines(draw) -> tuple[list[str], str]:
    """(a command line with one bad override, what its error must name)."""
    kind = draw(st.sampled_from(["value", "group", "key"]))
    base = draw(st.sampled_from([["experiment=synthetic"], ["drafter=eagle3"], ["drafter=ngram"]]))
    if kind == "value":
        key = draw(st.sampled_from(sorted(BAD_VALUES)))
        value = draw(BAD_VALUES[key])
        return [*base, f"{key}={value}"], key.split(".")[-1]
    if kind == "group":
        group, name = draw(st.sampled_from(GROUPS)), draw(NAMES)
        known = {p.stem for p in (schema.CONFIG_DIR / group).glob("*.yaml")}
        name = name if name not in known else name + "_x"
        return [*base, f"{group}={name}"], name
    key = draw(NAMES)
    return [*base, f"{key}=1"], key


@pytest.mark.slow  # heavy: CI runs it after the default suite
@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(malformed_command_lines())
def test_every_generated_malformed_command_line_is_one_line_naming_it(case):
    argv, named = case
    with pytest.raises(CommandLineError) as refused:
        check_overrides(argv, schema.CONFIG_DIR, "config", command.check_config)
    message = str(refused.value)
    assert "\n" not in message and named in message, message


def corrupt(line: bytes, how: str) -> bytes:
    if how == "truncate":
        return line[: max(1, len(line) // 2)]
    if how == "bytes":
        return line[:2] + b"\xc3\x28" + line[2:]  # an invalid UTF-8 sequence
    if how == "array":
        return b"[" + line + b"]"
    if how == "no field":
        return json.dumps({"text": "hello"}).encode()
    return json.dumps({"prompt": "   "}).encode()  # "blank"


@pytest.mark.integration  # the fast tier keeps the listed malformed files (above)
@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    texts=st.lists(st.text(min_size=1, max_size=40).filter(str.strip), min_size=1, max_size=6),
    position=st.integers(min_value=0, max_value=5),
    how=st.sampled_from(["truncate", "bytes", "array", "no field", "blank"]),
)
def test_every_generated_malformed_prompt_file_names_the_file(tmp_path_factory, texts, position, how):
    path = tmp_path_factory.mktemp("workload") / "prompts.jsonl"
    lines = [json.dumps({"prompt": text}).encode() for text in texts]
    position = min(position, len(lines) - 1)
    lines[position] = corrupt(lines[position], how)
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(ValueError) as refused:
        workloads.load_texts(schema.WorkloadConfig(name="jsonl", path=str(path)))
    message = str(refused.value)
    assert "\n" not in message and str(path) in message, message
    if how in ("truncate", "bytes", "array"):
        assert f"line {position + 1} " in message, message
