"""Fault injection for the training side: kills at every point of training, of checkpoint saving and
of the recovery a resume does, in feature extraction and in build_datastore; malformed specdec-train
command lines.

A kill is a Crash, a BaseException that no code under test catches, raised at a named point (the
trainer's ``checkpoint_hook``, or a write the test wraps), so nothing after it runs; training and
feature extraction are also SIGKILLed once each as real subprocesses. After every kill no partial file may be read as complete,
no finished work may be lost, and the rerun must end exactly where an unbroken run ends (torch.equal
weights, byte-identical files).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import drafters.training.trainer as trainer
from drafters.training.features import CacheMeta, FeatureCache, extract_features
from drafters.training.methods import build_method
from drafters.training.trainer import CRASH_POINTS, TrainConfig, latest_checkpoint, train
from faults import Crash
from specdec import assets
from specdec.target import HFTarget
from test_train_cli import one_line_error, specdec_train  # noqa: F401 (specdec_train: a fixture)
from tiny_models import save_base_model, tiny_model

REPO = Path(__file__).resolve().parent.parent


def crash(where: str) -> None:
    raise Crash(where)


def files_of(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` but the temporaries a kill may leave (never read: see each test)."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and not any(part.startswith((".", "tmp")) for part in p.relative_to(directory).parts)}


# -- training: every step, every checkpoint point, every recovery point -------------------------------

CONFIG = TrainConfig(steps=8, lr=1e-2, warmup_steps=2, checkpoint_every=3, log_every=2, snapshot_every=4)
CHECKPOINT_STEPS = (3, 6, 8)
FIRST_SAVE = ("rng-saved", "weights-saved", "optimizer-saved", "marked", "renamed")  # no old state/ to discard yet
LATER_SAVE = ("rng-saved", "weights-saved", "optimizer-saved", "marked", "old-unmarked", "old-removed", "renamed")
SAVE_EVENTS = FIRST_SAVE + LATER_SAVE * (len(CHECKPOINT_STEPS) - 1)
RECOVERY = ("leftover-unmarked", "leftover-removed", "promoted")


def tiny_target() -> HFTarget:
    return HFTarget(tiny_model("llama", sharpness=4.0))


def tiny_features(target: HFTarget, directory: Path) -> Path:
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, 128, (24,), generator=generator).tolist() for _ in range(8)]
    meta = CacheMeta("tiny", target.hidden_size, target.num_layers, target.vocab_size, (1, 3), 64, 2)
    return extract_features(target, sequences, directory, meta, batch_size=2)


@dataclass(frozen=True)
class Outcome:
    weights: dict[str, torch.Tensor]
    steps_trained: int
    events: tuple[str, ...]  # the checkpoint and recovery points reached, in order


def train_head(target: HFTarget, features: Path, run_dir: Path, crash_at_event: int | None = None,
               crash_at_step: int | None = None, kill: Callable[[str], None] = crash) -> Outcome:
    """The tiny EAGLE head (feature noise on: a resume must restore the RNG) trained in run_dir,
    resuming what is there; ``kill`` runs at the n-th point reached or in the n-th step trained."""
    events, steps = [], []

    def hook(point: str) -> None:
        events.append(point)
        if len(events) == crash_at_event:
            kill(point)

    method = build_method({"name": "eagle", "draft_vocab": 64, "feature_noise": 0.1})
    torch.manual_seed(0)
    prepared = method.prepare(target, FeatureCache(features), 2, 0, [0, 1, 2, 3])

    def loss(batch):
        steps.append(len(steps) + 1)
        if len(steps) == crash_at_step:
            kill(f"step {len(steps)}")
        return prepared.loss(batch)

    trainer.checkpoint_hook = hook
    try:
        train(prepared.model, prepared.batches, loss, CONFIG, run_dir)
    finally:
        trainer.checkpoint_hook = None
    return Outcome({k: v.clone() for k, v in prepared.model.state_dict().items()}, len(steps), tuple(events))


@dataclass(frozen=True)
class Bench:
    """The tiny target, its features, and the unbroken run every killed one must end equal to."""

    target: HFTarget
    features: Path
    straight: Outcome
    snapshots: dict[str, bytes]  # the straight run's snapshots/ files


@pytest.fixture(scope="module")
def bench(tmp_path_factory) -> Bench:
    target = tiny_target()
    features = tiny_features(target, tmp_path_factory.mktemp("features"))
    run_dir = tmp_path_factory.mktemp("straight")
    return Bench(target, features, train_head(target, features, run_dir), files_of(run_dir / "snapshots"))


def assert_same_weights(outcome: Outcome, straight: Outcome) -> None:
    assert outcome.weights.keys() == straight.weights.keys()
    assert all(torch.equal(outcome.weights[k], straight.weights[k]) for k in straight.weights)


def saved_before_event(n: int) -> int:
    """The step of the newest checkpoint marked complete at or before the n-th save event."""
    marked = SAVE_EVENTS[:n].count("marked")
    return CHECKPOINT_STEPS[marked - 1] if marked else 0


def saved_before_step(k: int) -> int:
    return max((s for s in CHECKPOINT_STEPS if s <= k - 1), default=0)


def resume_and_check(bench: Bench, run_dir: Path, saved: int) -> None:
    """Resume to the end: it must start at ``saved`` (nothing lost), leave state/ as the only
    checkpoint and end equal to the unbroken run, snapshots included."""
    assert (latest_checkpoint(run_dir) or (0,))[0] == saved
    resumed = train_head(bench.target, bench.features, run_dir)
    assert resumed.steps_trained == CONFIG.steps - saved
    assert_same_weights(resumed, bench.straight)
    assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith((".state", "state"))) == ["state"]
    assert files_of(run_dir / "snapshots") == bench.snapshots


def test_the_straight_run_passes_every_save_point_in_order(bench):
    assert bench.straight.events == SAVE_EVENTS and bench.straight.steps_trained == CONFIG.steps
    assert set(SAVE_EVENTS) | set(RECOVERY) == set(CRASH_POINTS)


@pytest.mark.parametrize("n", range(1, len(SAVE_EVENTS) + 1), ids=lambda n: f"{n}-{SAVE_EVENTS[n - 1]}")
def test_a_kill_inside_checkpoint_saving_loses_nothing(bench, tmp_path, n):
    target, features = bench.target, bench.features
    with pytest.raises(Crash):
        train_head(target, features, tmp_path, crash_at_event=n)
    resume_and_check(bench, tmp_path, saved_before_event(n))


@pytest.mark.parametrize("k", range(1, CONFIG.steps + 1))
def test_a_kill_in_any_step_resumes_from_the_last_checkpoint(bench, tmp_path, k):
    target, features = bench.target, bench.features
    with pytest.raises(Crash):
        train_head(target, features, tmp_path, crash_at_step=k)
    resume_and_check(bench, tmp_path, saved_before_step(k))


@pytest.mark.parametrize("n", range(1, len(SAVE_EVENTS) + 1), ids=lambda n: f"{n}-{SAVE_EVENTS[n - 1]}")
def test_a_kill_inside_the_recovery_of_a_killed_save_loses_nothing(bench, tmp_path, n):
    """Kill a save at its n-th point, then the resume at each point of its recovery, then resume."""
    target, features = bench.target, bench.features
    with pytest.raises(Crash):
        train_head(target, features, tmp_path / "probe", crash_at_event=n)
    recovery = [point for point in train_head(target, features, tmp_path / "probe").events if point in RECOVERY]
    for j in range(1, len(recovery) + 1):
        run_dir = tmp_path / f"recovery-{j}"
        with pytest.raises(Crash):
            train_head(target, features, run_dir, crash_at_event=n)
        with pytest.raises(Crash):
            train_head(target, features, run_dir, crash_at_event=j)
        resume_and_check(bench, run_dir, saved_before_event(n))


KILL = st.one_of(st.tuples(st.just("event"), st.integers(1, len(SAVE_EVENTS) + 2)),
                 st.tuples(st.just("step"), st.integers(1, CONFIG.steps)))


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kills=st.lists(KILL, min_size=1, max_size=4))
def test_repeated_kills_never_lose_progress_and_end_bitwise_equal(bench, kills):
    target, features = bench.target, bench.features
    with tempfile.TemporaryDirectory() as directory:
        run_dir, saved = Path(directory), 0
        for kind, where in kills:
            try:
                train_head(target, features, run_dir, **{f"crash_at_{kind}": where})
            except Crash:
                pass
            now = (latest_checkpoint(run_dir) or (0,))[0]
            assert now >= saved  # a kill never takes away a finished checkpoint
            saved = now
        assert_same_weights(train_head(target, features, run_dir), bench.straight)


def test_a_kill_between_the_old_renames_resumes_from_the_newer_checkpoint(bench, tmp_path):
    """The layout a kill left under the old two-rename save (.state.stale and .state.step-N, no
    state/): the newest complete checkpoint wins, instead of a silent restart from step 0."""
    target, features = bench.target, bench.features
    with pytest.raises(Crash):
        train_head(target, features, tmp_path, crash_at_step=4)
    shutil.copytree(tmp_path / "state", tmp_path / "step-3")
    with pytest.raises(Crash):
        train_head(target, features, tmp_path, crash_at_step=4)  # trains steps 4-6, killed in step 7
    os.replace(tmp_path / "state", tmp_path / ".state.step-6")
    os.replace(tmp_path / "step-3", tmp_path / ".state.stale")
    resume_and_check(bench, tmp_path, 6)


def test_a_damaged_checkpoint_is_named_not_silently_restarted(bench, tmp_path):
    target, features = bench.target, bench.features
    with pytest.raises(Crash):
        train_head(target, features, tmp_path, crash_at_step=4)
    (tmp_path / "state" / "progress.json").unlink()
    with pytest.raises(ValueError, match="state: it holds no progress.json.*delete it to start over"):
        train_head(target, features, tmp_path)
    (tmp_path / "state" / "progress.json").write_text("{")
    with pytest.raises(ValueError, match="progress.json is unreadable"):
        train_head(target, features, tmp_path)


SUBPROCESS_TRAINING = """
import os, signal, sys
import torch
sys.path[:0] = [{tests!r}]
torch.set_num_threads({threads})
from test_faults_training import tiny_target, train_head
from pathlib import Path
train_head(tiny_target(), Path({features!r}), Path({run_dir!r}), crash_at_event={event},
           kill=lambda where: os.kill(os.getpid(), signal.SIGKILL))
"""


def test_a_sigkilled_training_resumes_bitwise_equal(bench, tmp_path):
    """A real SIGKILL (no finally clause runs) where no state/ is complete: the old checkpoint
    unmarked, the new one not yet renamed into its place."""
    event = SAVE_EVENTS.index("old-unmarked", len(FIRST_SAVE)) + 1
    script = SUBPROCESS_TRAINING.format(tests=str(REPO / "tests"), threads=torch.get_num_threads(), features=str(bench.features),
                                        run_dir=str(tmp_path), event=event)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert not (tmp_path / "state" / "progress.json").exists() and (tmp_path / ".state.step-6" / "progress.json").exists()
    resume_and_check(bench, tmp_path, 6)


# -- feature extraction and build_datastore: a kill at every write ----------------------------------


@dataclass(frozen=True)
class Write:
    """A function that writes a file, and the ways a kill can meet it."""

    owner: object  # the module or class holding the function
    name: str
    path_index: int  # which positional argument names the file
    ways: tuple[str, ...]  # "before" it runs, "after" it ran, "partial": after, with half its file lost


def with_kill(write: Write, inside: Path, calls: list, kill_at: int | None, way: str) -> Callable:
    """``write``'s function, counting its calls on files under ``inside`` in ``calls`` (shared by all
    wrapped functions) and killing the kill_at-th such call the given way."""
    real = getattr(write.owner, write.name)

    def wrapped(*args, **kwargs):
        path = Path(args[write.path_index])
        if inside not in path.parents:
            return real(*args, **kwargs)
        calls.append(write)
        if len(calls) != kill_at:
            return real(*args, **kwargs)
        if way == "before":
            raise Crash(f"before {write.name} {path}")
        real(*args, **kwargs)
        if way == "partial":
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        raise Crash(f"after {write.name} {path}")
    return wrapped


def run_killed(writes: list[Write], inside: Path, run: Callable[[], None], monkeypatch, kill_at: int | None = None,
               way: str = "before") -> list[Write]:
    """Run with the writes wrapped; returns the writes made, in order (all of them when kill_at is None)."""
    calls = []
    with monkeypatch.context() as patch:
        for write in writes:
            patch.setattr(write.owner, write.name, with_kill(write, inside, calls, kill_at, way))
        run()
    return calls


def every_kill(writes: list[Write], inside: Path, run: Callable[[], None], monkeypatch) -> list[tuple[int, str]]:
    """(n, way): the n-th write of an unbroken ``run``, killed each way that write can meet."""
    return [(n, way) for n, write in enumerate(run_killed(writes, inside, run, monkeypatch), 1) for way in write.ways]


def assert_listed_shards_are_whole(directory: Path, straight: dict[str, bytes]) -> None:
    """Every shard a reader of the cache would see reads whole and is the unbroken run's."""
    if not (directory / "meta.json").exists():
        return
    try:
        cache = FeatureCache(directory)
    except ValueError:  # no complete shard yet
        return
    assert all(shard.read_bytes() == straight[shard.name] for shard in cache.shards)
    assert sum(1 for _ in cache.sequences((1, 3))) == cache.meta.sequences_per_shard * len(cache.shards)


def test_a_kill_at_any_write_of_feature_extraction_reruns_to_identical_files(bench, tmp_path, monkeypatch):
    import safetensors.torch

    target, features = bench.target, bench.features
    straight = files_of(features)
    writes = [Write(safetensors.torch, "save_file", 1, ("before", "partial", "after")),
              Write(os, "replace", 0, ("before", "after"))]
    kills = every_kill(writes, tmp_path, lambda: tiny_features(target, tmp_path / "probe"), monkeypatch)
    # meta.json renamed; per shard its features and its labels, each written (3 ways) and renamed (2 ways)
    assert len(kills) == 2 + 4 * 2 * (3 + 2)
    for n, way in kills:
        directory = tmp_path / f"{way}-{n}"
        with pytest.raises(Crash):
            run_killed(writes, tmp_path, lambda: tiny_features(target, directory), monkeypatch, n, way)
        assert_listed_shards_are_whole(directory, straight)
        tiny_features(target, directory)
        assert files_of(directory) == straight


SUBPROCESS_EXTRACTION = """
import sys
import torch
sys.path[:0] = [{tests!r}]
torch.set_num_threads({threads})
from test_faults_training import many_shards
many_shards({directory!r}, progress=lambda done, total, rate: print(done, flush=True))
"""
SHARDS = 100


def many_shards(directory: str, progress=None) -> None:
    """One sequence a shard: many writes for a kill to land among."""
    target = tiny_target()
    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, 128, (24,), generator=generator).tolist() for _ in range(SHARDS)]
    meta = CacheMeta("tiny", target.hidden_size, target.num_layers, target.vocab_size, (1, 3), 64, 1)
    extract_features(target, sequences, directory, meta, batch_size=1, progress=progress)


def test_a_sigkill_at_a_random_moment_of_extraction_reruns_to_identical_files(tmp_path):
    many_shards(str(tmp_path / "straight"))
    straight = files_of(tmp_path / "straight")
    directory = tmp_path / "killed"
    script = SUBPROCESS_EXTRACTION.format(tests=str(REPO / "tests"), threads=torch.get_num_threads(), directory=str(directory))
    process = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    for _ in range(random.Random(0).randint(5, 30)):  # shards written; the kill lands somewhere in the next ones
        process.stdout.readline()
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=60) == -signal.SIGKILL
    assert 0 < len(FeatureCache(directory).shards) < SHARDS
    assert_listed_shards_are_whole(directory, straight)
    many_shards(str(directory))
    assert files_of(directory) == straight


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    directory = tmp_path_factory.mktemp("corpus")
    save_base_model(directory / "tokenizer")
    lines = [json.dumps({"text": f"document {i}: " + " ".join(["the quick brown fox"] * (i + 1))}) for i in range(6)]
    (directory / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    return directory


def test_a_kill_at_any_write_of_build_datastore_reruns_to_identical_files(corpus, tmp_path, monkeypatch):
    from experiments import build_datastore

    def build(out: Path) -> Callable[[], None]:
        return lambda: build_datastore.main(["--tokenizer", str(corpus / "tokenizer"), "--jsonl", str(corpus / "corpus.jsonl"),
                                             "--out", str(out)])

    writes = [Write(np, "save", 0, ("before", "partial", "after")), Write(Path, "write_text", 0, ("before", "after")),
              Write(os, "replace", 0, ("before", "after"))]
    kills = every_kill(writes, tmp_path, build(tmp_path / "straight"), monkeypatch)
    assert len(kills) == 3 * 3 + 2 + 2  # three arrays, meta.json, the folder's rename
    straight = files_of(tmp_path / "straight")
    for n, way in kills:
        out = tmp_path / f"{way}-{n}"
        with pytest.raises(Crash):
            run_killed(writes, tmp_path, build(out), monkeypatch, n, way)
        if out.exists():  # killed after the rename: the folder appears whole or not at all
            assert files_of(out) == straight
        else:
            build(out)()
            assert files_of(out) == straight


# -- metrics.jsonl ------------------------------------------------------------------------------------


def test_jsonl_metrics_start_anew_or_keep_only_the_resumed_steps(tmp_path):
    from experiments.sinks import JsonlSink

    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    for step in (2, 4, 6):
        sink.log({"loss": float(step)}, step)
    sink.log_summary({"tau": 1.5})
    sink.finish()
    with path.open("a") as f:
        f.write('{"step": 8, "lo')  # a killed writer's half line
    sink = JsonlSink(path, keep_until_step=4)  # resumed from step 4
    sink.log({"loss": 6.5}, 6)
    sink.finish()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"step": 2, "loss": 2.0}, {"step": 4, "loss": 4.0}, {"step": 6, "loss": 6.5}]
    JsonlSink(path).finish()  # a new run into the same dir
    assert path.read_text() == ""


# -- malformed specdec-train command lines ---------------------------------------------------------

NOT_NUMBERS = st.sampled_from(["abc", "fast", "1.5.2", "ten", "[1]"])  # a value of the wrong type
OPTIONS = {  # option: (a strategy of bad values, one of good values)
    **{name: (st.one_of(st.integers(max_value=0), NOT_NUMBERS), st.integers(1, 50)) for name in (
        "batch_size", "checkpoint_every", "log_every", "threads", "data.conversations", "data.per_shard", "data.shards",
        "data.regenerate_tokens", "data.regenerate_batch", "eval.prompts", "eval.max_new_tokens", "eval.depth")},
    **{name: (st.one_of(st.integers(max_value=-1), NOT_NUMBERS), st.integers(0, 50))
       for name in ("steps", "warmup_steps", "snapshot_every")},
    "data.max_length": (st.one_of(st.integers(max_value=15), NOT_NUMBERS), st.integers(16, 512)),
    **{name: (st.one_of(st.floats(max_value=0.0), st.sampled_from([float("nan"), float("inf")]), NOT_NUMBERS),
              st.floats(1e-6, 1.0)) for name in ("lr", "grad_clip")},
    **{name: (st.one_of(st.floats(max_value=-1e-9), st.sampled_from([float("nan"), float("inf")]), NOT_NUMBERS),
              st.floats(0.0, 1.0)) for name in ("weight_decay", "data.regenerate_temperature")},
    "eval.curve": (st.sampled_from(["maybe", "2", "yes please"]), st.just("false")),
    "logger": (st.sampled_from(["tensorboard", "mlflow", "json", "JSONL", "csv", "wand"]), st.sampled_from(["none", "jsonl"])),
    **{name: (st.text("abcxyz0123", min_size=1, max_size=8).map(lambda tail: f"/no/such/{tail}"), st.nothing())
       for name in ("target", "init", "resume")},
    # keys the schema lacks: a typo must not be dropped silently
    **{name: (st.integers(1, 9), st.nothing()) for name in ("batchsize", "learning_rate", "data.conversation", "eval.prompt")},
}
ONLY_BAD = ("target", "init", "resume", "batchsize", "learning_rate", "data.conversation", "eval.prompt")


def override(option: str, value) -> str:
    return f"{option}={value!r}" if isinstance(value, float) else f"{option}={value}"


@st.composite
def malformed_command_lines(draw) -> tuple[list[str], set[str]]:
    """1-3 options with bad values among 0-3 with good ones: (overrides, the bad options)."""
    bad = draw(st.lists(st.sampled_from(sorted(OPTIONS)), min_size=1, max_size=3, unique=True))
    good = draw(st.lists(st.sampled_from(sorted(n for n in OPTIONS if n not in bad and n not in ONLY_BAD)), max_size=3,
                         unique=True))
    overrides = [override(name, draw(OPTIONS[name][0])) for name in bad] + [override(name, draw(OPTIONS[name][1])) for name in good]
    return draw(st.permutations(overrides)), set(bad)


@settings(max_examples=50, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=malformed_command_lines())
def test_every_malformed_command_line_is_one_line_naming_a_bad_option_before_the_target_loads(specdec_train, case):
    overrides, bad = case
    error = one_line_error(specdec_train(*overrides))
    assert any(re.search(rf"(?<![\w.]){re.escape(name)}=", error) for name in bad), (overrides, error)
    assert specdec_train.loads == []


def bad_jsonl(directory: Path) -> Path:
    path = directory / "corpus.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "cut\n')
    return path


@pytest.mark.parametrize("arguments,message", [
    (lambda d, c: ["--jsonl", str(d / "none.jsonl"), "--tokenizer", str(c / "tokenizer")], "--jsonl: prompt file"),
    (lambda d, c: ["--jsonl", str(bad_jsonl(d)), "--tokenizer", str(c / "tokenizer")], "line 2 is not valid JSON"),
    (lambda d, c: ["--jsonl", str(c / "corpus.jsonl"), "--tokenizer", str(d / "none")], "cannot load a tokenizer"),
    (lambda d, c: ["--jsonl", str(c / "corpus.jsonl"), "--tokenizer", str(d)], "cannot load a tokenizer"),
    (lambda d, c: ["--generate", str(d / "none")], "--generate: target="),
    (lambda d, c: ["--generate", "smollm2", "--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (lambda d, c: ["--generate", "smollm2", "--temperature", "nan"], "--temperature must be a finite number >= 0"),
], ids=["missing corpus", "malformed corpus", "missing tokenizer", "folder without a tokenizer", "missing target",
        "negative temperature", "nan temperature"])
def test_a_bad_build_datastore_input_is_named_with_exit_2(corpus, tmp_path, capsys, arguments, message):
    from experiments import build_datastore

    with pytest.raises(SystemExit) as exit:
        build_datastore.main([*arguments(tmp_path, corpus), "--out", str(tmp_path / "ds")])
    error = capsys.readouterr().err
    assert exit.value.code == 2 and message in error.splitlines()[-1] and "Traceback" not in error, error
    assert not (tmp_path / "ds").exists()


@pytest.mark.parametrize("arguments,message", [
    (["--per-shard", "0"], "--per-shard must be at least 1"),
    (["--batch-size", "-2"], "--batch-size must be at least 1"),
    (["--max-length", "0"], "--max-length must be at least 1"),
    (["--threads", "0"], "--threads must be at least 1"),
    (["--conversations", "0"], "--conversations must be at least 1"),
    (["--sequences", "/no/such.json"], "--sequences /no/such.json: no such file"),
    (["--model", "/no/such/model"], "--model /no/such/model: not 'smollm2' and not a Hugging Face model folder"),
])
def test_a_bad_extract_features_option_is_named_before_the_model_loads(tmp_path, capsys, monkeypatch, arguments, message):
    from experiments import extract_features as command

    monkeypatch.setattr(assets, "load_smollm2", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(SystemExit) as exit:
        command.main(["--out", str(tmp_path / "features"), *arguments])
    assert exit.value.code == 2 and message in capsys.readouterr().err
