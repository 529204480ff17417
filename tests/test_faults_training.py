"""Fault injection for training: kills at every point of training, of checkpoint saving and of the
recovery a resume does; metrics.jsonl across a resume; malformed specdec-train command lines.
(Feature extraction and build_datastore: tests/test_faults_data.py.)

A kill is a Crash, a BaseException that no code under test catches, raised at a named point (the
trainer's ``checkpoint_hook``), so nothing after it runs; training is also SIGKILLed once as a real
subprocess. After every kill no partial checkpoint may be read as complete, no finished step may be
lost, and the resumed run must end exactly where an unbroken run ends (torch.equal weights,
byte-identical snapshots).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import drafters.training.trainer as trainer
from drafters.training.features import FeatureCache
from drafters.training.methods import build_method
from drafters.training.trainer import CRASH_POINTS, TrainConfig, latest_checkpoint, train
from faults import Crash, files_of, tiny_features, tiny_target
from specdec.target import HFTarget
from test_train_cli import one_line_error, specdec_train  # noqa: F401 (specdec_train: a fixture)

REPO = Path(__file__).resolve().parent.parent


def crash(where: str) -> None:
    raise Crash(where)


# -- training: every step, every checkpoint point, every recovery point -------------------------------

CONFIG = TrainConfig(steps=8, lr=1e-2, warmup_steps=2, checkpoint_every=3, log_every=2, snapshot_every=4)
CHECKPOINT_STEPS = (3, 6, 8)
FIRST_SAVE = ("rng-saved", "weights-saved", "optimizer-saved", "marked", "renamed")  # no old state/ to discard yet
LATER_SAVE = ("rng-saved", "weights-saved", "optimizer-saved", "marked", "old-unmarked", "old-removed", "renamed")
SAVE_EVENTS = FIRST_SAVE + LATER_SAVE * (len(CHECKPOINT_STEPS) - 1)
RECOVERY = ("leftover-unmarked", "leftover-removed", "promoted")


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


@pytest.mark.integration  # the fast tier keeps a kill at every save point (above)
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


@pytest.mark.slow  # heavy: CI runs it after the default suite
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
from faults import tiny_target
from test_faults_training import train_head
from pathlib import Path
train_head(tiny_target(), Path({features!r}), Path({run_dir!r}), crash_at_event={event},
           kill=lambda where: os.kill(os.getpid(), signal.SIGKILL))
"""


@pytest.mark.integration
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


# -- metrics.jsonl ------------------------------------------------------------------------------------


def test_jsonl_metrics_start_anew_or_keep_only_the_resumed_steps(tmp_path):
    from experiments.common.sinks import JsonlSink

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
        "batch_size", "loop.checkpoint_every", "loop.log_every", "threads", "data.conversations", "data.per_shard",
        "data.shards", "data.regenerate_tokens", "data.regenerate_batch", "eval.max_new_tokens", "eval.depth")},
    # eval.prompts=0: no evaluation (what the lent GPU machine's schedule runs with)
    **{name: (st.one_of(st.integers(max_value=-1), NOT_NUMBERS), st.integers(0, 50))
       for name in ("loop.steps", "loop.warmup_steps", "loop.snapshot_every", "eval.prompts")},
    "data.max_length": (st.one_of(st.integers(max_value=15), NOT_NUMBERS), st.integers(16, 512)),
    **{name: (st.one_of(st.floats(max_value=0.0), st.sampled_from([float("nan"), float("inf")]), NOT_NUMBERS),
              st.floats(1e-6, 1.0)) for name in ("loop.lr", "loop.grad_clip")},
    **{name: (st.one_of(st.floats(max_value=-1e-9), st.sampled_from([float("nan"), float("inf")]), NOT_NUMBERS),
              st.floats(0.0, 1.0)) for name in ("loop.weight_decay", "data.regenerate_temperature")},
    "eval.curve": (st.sampled_from(["maybe", "2", "yes please"]), st.just("false")),
    "logger": (st.sampled_from(["tensorboard", "mlflow", "json", "JSONL", "csv", "wand"]), st.sampled_from(["none", "jsonl"])),
    # unknown choices, and the ones specdec-run takes but training cannot
    "target": (st.sampled_from(["synthetic", "smollm2_bf16", "llama", "/no/such/model"]), st.just("smollm2")),
    "target.dtype": (st.sampled_from(["float64", "int8", "bfloat16", "half"]), st.just("float32")),
    **{name: (st.text("abcxyz0123", min_size=1, max_size=8).map(lambda tail: f"/no/such/{tail}"), st.nothing())
       for name in ("init", "resume")},
    # keys the schema lacks: a typo must not be dropped silently
    **{name: (st.integers(1, 9), st.nothing()) for name in ("batchsize", "learning_rate", "data.conversation", "eval.prompt")},
}
ONLY_BAD = ("init", "resume", "batchsize", "learning_rate", "data.conversation", "eval.prompt")


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


@pytest.mark.integration
@settings(max_examples=50, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=malformed_command_lines())
def test_every_malformed_command_line_is_one_line_naming_a_bad_option_before_the_target_loads(specdec_train, case):
    overrides, bad = case
    error = one_line_error(specdec_train(*overrides))
    # named as `option=value`, or as `unknown option 'value'` for a choice or value not among the known ones
    assert any(re.search(rf"(?<![\w.]){re.escape(name)}(=| ')", error) for name in bad), (overrides, error)
    assert specdec_train.loads == []
