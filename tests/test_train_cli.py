"""specdec-train end to end, in-process on a tiny target: bad options end in one line and exit
status 2 before the target loads, loop.steps=0 only extracts, a killed run resumes (resume=latest,
resume=PATH) bitwise equal to an unbroken one and logs every step once, broken model folders are
named in one line.

The command runs through Hydra as from the shell (sys.argv), with target=smollm2, the ShareGPT
conversations and the MT-bench prompts replaced by tiny stand-ins (target=hf opens real folders).
"""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from faults import Crash
from test_training import WordTokenizer
from tiny_models import save_base_model, tiny_model

import drafters.training.trainer as trainer
from experiments.common import prompt_sets
from experiments.common.prompt_sets import Prompt
from specdec import assets, target_loader
from specdec.assets import Conversation
from specdec.target import HFTarget
from specdec.target_loader import TargetConfig, TargetHandle

REPO = Path(__file__).resolve().parent.parent
WORDS = "the a cat dog sat ran on under mat log big small red blue why how what is was".split()
TINY = ["batch_size=2", "loop.steps=6", "loop.checkpoint_every=2", "loop.log_every=1", "loop.warmup_steps=1", "data.conversations=8",
        "data.max_length=32", "data.per_shard=2", "eval.prompts=2", "eval.max_new_tokens=4", "eval.depth=2",
        "train.draft_vocab=64"]


def conversations() -> list[Conversation]:
    chance = random.Random(0)
    text = lambda: " ".join(chance.choice(WORDS) for _ in range(12))
    return [Conversation(f"c{i}", (("user", text()), ("assistant", text()))) for i in range(8)]


MTBENCH = [Prompt(" ".join(WORDS[i : i + 6]), "writing", f"mtbench-{i}", True) for i in range(2)]


@dataclass(frozen=True)
class Result:
    code: int
    out: str
    err: str


def invoke(args: list[str], capsys) -> Result:
    """specdec-train ``args``, as the shell would run it."""
    from experiments import train

    capsys.readouterr()
    sys_argv = sys.argv
    sys.argv = ["specdec-train", *args]
    try:
        train.main()
        code = 0
    except SystemExit as error:
        code = error.code
    finally:
        sys.argv = sys_argv
    captured = capsys.readouterr()
    return Result(code, captured.out, captured.err)


class TinyTrain:
    """specdec-train with a tiny 4-layer target as target=smollm2; run dirs in
    <root>/outputs/train/eagle/<name>."""

    def __init__(self, root: Path, capsys) -> None:
        self.root, self.capsys = root, capsys
        self.loads: list[str] = []  # the targets whose weights were loaded
        self.target = HFTarget(tiny_model("llama", sharpness=4.0, layers=4))

    def open_target(self, cfg: TargetConfig, with_tokenizer: bool) -> TargetHandle:
        if cfg.name != "smollm2":
            return target_loader.open_target(cfg, with_tokenizer)
        return TargetHandle(label="tiny", key="smollm2", cache_name="tiny", vocab_size=self.target.vocab_size, max_length=None,
                            tokenizer=WordTokenizer(), eos_token_id=None, load=self.load)

    def load(self) -> HFTarget:
        self.loads.append("smollm2")
        return self.target

    def run_dir(self, name: str) -> Path:
        return self.root / "outputs" / "train" / "eagle" / name

    def __call__(self, *overrides: str, name: str = "run") -> Result:
        return invoke([*TINY, *overrides, f"hydra.run.dir={self.run_dir(name)}"], self.capsys)


@pytest.fixture
def specdec_train(tmp_path, monkeypatch, capsys) -> TinyTrain:
    from experiments.train import sources

    tiny = TinyTrain(tmp_path, capsys)
    monkeypatch.setattr(sources, "open_target", tiny.open_target)
    monkeypatch.setattr(assets, "load_sharegpt_conversations", lambda count: conversations()[:count])
    monkeypatch.setattr(prompt_sets, "load_mtbench", lambda: MTBENCH)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("COLUMNS", "1000")  # rich would wrap long paths in the middle
    return tiny


def one_line_error(result: Result) -> str:
    assert result.code == 2 and result.err.count("\n") == 1 and result.err.startswith("specdec-train: error: "), result
    return result.err


def metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(step lines, summary lines) of a run's metrics.jsonl."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "step" in r], [r for r in records if "summary" in r]


def kill_at(point: str, occurrence: int, monkeypatch) -> None:
    """Crash the next training at the occurrence-th time it reaches a checkpoint point."""
    seen = []

    def hook(reached: str) -> None:
        seen.append(reached)
        if seen.count(point) == occurrence and reached == point:
            raise Crash(point)

    monkeypatch.setattr(trainer, "checkpoint_hook", hook)


@pytest.mark.parametrize("overrides,message", [
    (["loop.checkpoint_every=0"], "loop.checkpoint_every must be >= 1"),
    (["loop.log_every=0"], "loop.log_every must be >= 1"),
    (["batch_size=0"], "batch_size must be >= 1"),
    (["loop.steps=-1"], "loop.steps must be >= 0"),
    (["loop.lr=0"], "loop.lr must be a finite number > 0"),
    (["loop.lr=nan"], "loop.lr must be a finite number > 0"),
    (["loop.grad_clip=-1"], "loop.grad_clip must be a finite number > 0"),
    (["loop.weight_decay=inf"], "loop.weight_decay must be a finite number >= 0"),
    (["loop.warmup_steps=-5"], "loop.warmup_steps must be >= 0"),
    (["loop.snapshot_every=-1"], "loop.snapshot_every must be >= 0"),
    (["threads=0"], "threads must be >= 1 or null"),
    (["data.conversations=0"], "data.conversations must be >= 1"),
    (["data.max_length=8"], "data.max_length must be >= 16"),
    (["data.per_shard=0"], "data.per_shard must be >= 1"),
    (["data.shards=0"], "data.shards must be >= 1 or null"),
    (["data.regenerate_batch=0"], "data.regenerate_batch must be >= 1"),
    (["data.regenerate_temperature=-0.5"], "data.regenerate_temperature must be a finite number >= 0"),
    (["eval.prompts=-1"], "eval.prompts must be >= 0"),
    (["eval.depth=0"], "eval.depth must be >= 1"),
    (["eval.curve=true"], "eval.curve=true measures the snapshots, and loop.snapshot_every=0 keeps none"),
    (["logger=tensorboard"], "unknown logger 'tensorboard'; choose one of jsonl, none, stdout, wandb"),
    (["logger.name=tensorboard"], "unknown logger 'tensorboard'; choose one of jsonl, none, stdout, wandb"),
    (["loop.steps=0", "data.extract=false"], "loop.steps=0 extracts the features and stops, and data.extract=false"),
    (["loop.steps=0", "resume=latest"], "loop.steps=0 trains nothing"),
    (["init=/no/such/head"], "init=/no/such/head: no such folder"),
    (["target=/no/such/model"], "unknown target '/no/such/model'; choose one of gemma3_270m, gemma3_270m_bf16, hf, smollm2, smollm2_bf16, synthetic"),
    (["target=hf"], "target=hf needs a model folder: target.path=DIR"),
    (["target=hf", "target.path=/no/such/model"], "target.path=/no/such/model is not a folder"),
    (["target=synthetic"], "train=eagle needs a model target, a HeadTarget (target=smollm2, target=gemma3_270m or "
                           "target=hf) to read features from; target=synthetic is of kind 'synthetic'"),
    (["target=smollm2_bf16"], "features=cached trains on the float32 target; got target.dtype=bfloat16"),
    (["target.dtype=float64"], "unknown target.dtype 'float64'"),
    (["target.device=cuda"], "features=cached trains on the CPU; got target.device=cuda"),
    (["features=disk"], "features='disk': choose one of cached, online"),
    (["features=online", "train=medusa"], "train=medusa trains on cached features only (it registered without online=True)"),
    (["features=online", "loop.steps=0"], "data.extract=false or features=online extracts none: nothing to do"),
    (["features=online", "online.batch_tokens=0"], "online.batch_tokens must be >= 1"),
    (["data.extract=false", "data.features_dir=/no/such/cache"], "data.extract=false trains on the cached features"),
    (["resume=/no/such/run"], "resume=/no/such/run: no such folder"),
    (["resume=latest"], "resume=latest: no unfinished run with a checkpoint"),
    (["train.name=nope"], "train='nope': unknown training method"),
    (["+train.unrol=3"], "unknown setting(s) unrol"),
    (["train.unrol=3"], "Could not override 'train.unrol'"),
    (["train=nope"], "unknown train 'nope'; choose one of dflash, domino, eagle, eagle3"),
    (["batch_size=abc"], "batch_size=abc; Value 'abc' of type 'str' could not be converted to Integer"),
    (["learning_rate=0.1"], "Key 'learning_rate' not in 'TrainRunConfig'"),
    (["loop.steps=10,20"], "loop.steps=10,20 lists several values; add -m"),
    (["steps=10"], "Key 'steps' not in 'TrainRunConfig'"),
])
def test_a_bad_option_is_one_line_and_exit_2_before_the_target_loads(specdec_train, overrides, message):
    assert message in one_line_error(specdec_train(*overrides))
    assert specdec_train.loads == []


def usage_examples() -> list[str]:
    """The specdec-train command lines of docs/usage.md (``a | b`` lists alternatives), but those that
    need a model folder a fresh machine lacks, or a feature cache extracted before them."""
    text = (REPO / "docs" / "usage.md").read_text()
    lines = re.findall(r"^    \.venv/bin/specdec-train(.*)$", text, flags=re.MULTILINE)
    return [example.strip() for line in lines if "target.path=/models" not in line and "data.extract=false" not in line
            for example in line.split("#")[0].split(" | ")]


def test_the_usage_examples_pass_the_command_line_check(specdec_train):
    from experiments.cli import check_overrides
    from experiments.train import command as train

    assert len(usage_examples()) >= 8
    for example in usage_examples():
        check_overrides(shlex.split(example), train.CONFIG_DIR, "train", train.check_config)


@pytest.mark.parametrize("target", ["gemma3_270m", "gemma3_270m_bf16"])
def test_a_target_whose_config_picks_specdec_runs_drafter_composes(target):
    """target/gemma3_270m.yaml overrides specdec-run's drafter group; train.yaml lists that group so
    the same target composes here, a base model (chat: false)."""
    from hydra import compose, initialize_config_dir

    from experiments.train import command as train
    from experiments.train.schema import checked_settings

    with initialize_config_dir(config_dir=str(train.CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"target={target}", "train=eagle3", "features=online"])
    settings = checked_settings(cfg)
    assert settings.target.name == "gemma3_270m" and settings.target.chat is False


def test_steps_0_extracts_the_features_and_stops(specdec_train):
    result = specdec_train("loop.steps=0")
    assert result.code == 0 and "loop.steps=0: the features are in" in result.out, result
    cache = specdec_train.root / "cache" / "features" / "tiny-sharegpt"
    assert (cache / "meta.json").is_file() and len(list(cache.glob("shard-*.safetensors"))) == 4
    run_dir = specdec_train.run_dir("run")
    assert not any((run_dir / name).exists() for name in ("head", "state", "train_results.json", "metrics.jsonl"))


def test_online_features_train_without_a_cache_and_the_head_drafts_greedy_equal(specdec_train):
    result = specdec_train("features=online", "online.batch_tokens=64", "online.label_tokens=100")
    assert result.code == 0, result
    results = json.loads((specdec_train.run_dir("run") / "train_results.json").read_text())
    assert results["features"] == "online" and results["steps"] == 6 and results["greedy_equal"] is True
    assert len(results["per_depth_attempts"]) == len(results["per_depth_alpha"]) and results["per_depth_attempts"][0] > 0
    assert (specdec_train.run_dir("run") / "head" / "config.json").is_file()
    assert not (specdec_train.root / "cache" / "features").exists()  # nothing extracted


def test_a_second_training_into_a_run_dir_in_use_is_refused_in_one_line(specdec_train):
    from experiments.cli import hold_lock
    from experiments.train.command import LOCK_FILE

    busy = specdec_train.run_dir("busy")
    with hold_lock(busy / LOCK_FILE, "held by this test", "-"):
        error = one_line_error(specdec_train(name="busy"))
    assert f"the run dir {busy} is in use by process {os.getpid()}" in error
    assert specdec_train.loads == [] and not (busy / ".hydra").exists()  # refused before Hydra wrote there
    assert not (busy / LOCK_FILE).exists()  # and the free dir trains (the control)
    assert specdec_train("loop.steps=0", name="busy").code == 0


@pytest.mark.integration
def test_a_killed_run_resumes_with_resume_latest_bitwise_equal_logging_every_step_once(specdec_train, monkeypatch):
    assert specdec_train(name="straight").code == 0
    straight = specdec_train.run_dir("straight")
    kill_at("marked", 2, monkeypatch)  # step 4's checkpoint is complete, the old one not yet removed
    with pytest.raises(Crash):
        specdec_train(name="killed")
    monkeypatch.setattr(trainer, "checkpoint_hook", None)
    killed = specdec_train.run_dir("killed")

    (straight / "train_results.json").unlink()  # now unfinished too, but its checkpoint is older
    result = specdec_train("resume=latest", name="resumer")
    assert result.code == 0, result
    assert f"resuming from step 4 of {killed}" in result.out
    assert not specdec_train.run_dir("resumer").exists()  # the run went on in the killed run's dir
    for name in ("state/model.safetensors", "head/model.safetensors"):
        assert (killed / name).read_bytes() == (straight / name).read_bytes()
    steps, summaries = metrics(killed)
    expected, _ = metrics(straight)
    assert [s["step"] for s in steps] == list(range(1, 7)) and len(summaries) == 1
    assert [s["loss"] for s in steps] == [s["loss"] for s in expected]


@pytest.mark.integration
def test_an_online_run_resumes_on_its_checkpoints_draft_vocabulary_without_counting_it_again(specdec_train, monkeypatch):
    """A killed features=online run resumes with the draft vocabulary its checkpoint's head holds
    instead of a second pass of the target over the data to count it, and ends bitwise equal to an
    unbroken run."""
    from experiments.train import recipe

    online = ("features=online", "online.batch_tokens=64", "online.label_tokens=100")
    assert specdec_train(*online, name="straight").code == 0
    kill_at("marked", 2, monkeypatch)
    with pytest.raises(Crash):
        specdec_train(*online, name="killed")
    monkeypatch.setattr(trainer, "checkpoint_hook", None)
    counted = []
    count = recipe.choice_vocabulary
    monkeypatch.setattr(recipe, "choice_vocabulary", lambda *args: counted.append(args) or count(*args))
    straight, killed = specdec_train.run_dir("straight"), specdec_train.run_dir("killed")
    result = specdec_train("resume=latest", *online, name="resumer")
    assert result.code == 0, result
    assert f"resuming from step 4 of {killed}" in result.out and counted == []
    for name in ("state/model.safetensors", "head/model.safetensors"):
        assert (killed / name).read_bytes() == (straight / name).read_bytes()


@pytest.mark.integration
def test_resume_refuses_a_run_of_other_settings_or_without_a_checkpoint(specdec_train, monkeypatch):
    kill_at("rng-saved", 2, monkeypatch)
    with pytest.raises(Crash):
        specdec_train("loop.lr=0.002", name="first")
    monkeypatch.setattr(trainer, "checkpoint_hook", None)
    first = specdec_train.run_dir("first")
    specdec_train.loads.clear()
    error = one_line_error(specdec_train(f"resume={first}", "loop.lr=0.003", name="second"))
    assert f"resume={first}: that run started with loop.lr=0.002, this command has loop.lr=0.003" in error
    assert "its command line: " in error and "loop.lr=0.002" in error
    error = one_line_error(specdec_train(f"resume={first}", "loop.lr=0.002", "features=online", name="second"))
    assert "that run started with features='cached'" in error and "this command has features='online'" in error
    recorded = (first / ".hydra" / "config.yaml").read_text()
    error = one_line_error(specdec_train(f"resume={first}", "loop.lr=0.002", name="first"))  # hydra.run.dir=first
    assert f"resume={first} is also hydra.run.dir: a resumed run trains in its own dir, so drop hydra.run.dir" in error
    assert (first / ".hydra" / "config.yaml").read_text() == recorded  # the settings it started with, kept
    empty = specdec_train.root / "empty"
    empty.mkdir()
    assert "holds no complete checkpoint" in one_line_error(specdec_train(f"resume={empty}", name="third"))
    assert specdec_train.loads == []
    # a run started before features= and online.* existed trained on cached features: it resumes,
    # and online.* (unused by cached features) may differ
    recorded = first / ".hydra" / "config.yaml"
    recorded.write_text("\n".join(line for line in recorded.read_text().splitlines()
                                  if not line.startswith(("features:", "online:", "  batch_tokens:", "  label_tokens:"))))
    assert "features:" not in recorded.read_text() and "online:" not in recorded.read_text()
    result = specdec_train(f"resume={first}", "loop.lr=0.002", "online.batch_tokens=7", name="fourth")
    assert result.code == 0 and f"of {first}" in result.out and "resuming from step" in result.out, result


@pytest.mark.integration
def test_a_rerun_into_a_used_dir_does_not_mix_two_runs(specdec_train, monkeypatch):
    """A finished run resumed for more steps and killed no longer looks finished (its old
    train_results.json goes first); a new run into a used dir starts a new metrics.jsonl."""
    assert specdec_train("loop.steps=2", name="used").code == 0
    used = specdec_train.run_dir("used")
    kill_at("marked", 1, monkeypatch)
    with pytest.raises(Crash):
        specdec_train(f"resume={used}", "loop.steps=4", name="more")
    monkeypatch.setattr(trainer, "checkpoint_hook", None)
    assert not (used / "train_results.json").exists()
    result = specdec_train("resume=latest", "loop.steps=4", name="again")
    assert result.code == 0 and f"resuming from step 4 of {used}" in result.out
    steps, summaries = metrics(used)
    assert [s["step"] for s in steps] == [1, 2, 3, 4] and len(summaries) == 1

    shutil.rmtree(used / "state")  # no checkpoint: the same dir now holds a new run
    assert specdec_train("loop.steps=2", name="used").code == 0
    steps, summaries = metrics(used)
    assert [s["step"] for s in steps] == [1, 2] and len(summaries) == 1


@pytest.fixture(scope="module")
def model_folders(tmp_path_factory) -> dict[str, Path]:
    """A tiny model folder with a chat template, and broken copies of it."""
    root = tmp_path_factory.mktemp("models")
    good = save_base_model(root / "good")
    config = json.loads((good / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    (good / "tokenizer_config.json").write_text(json.dumps(config))
    folders = {}
    for name, damage in [
        ("empty", lambda path: [p.unlink() for p in path.iterdir()]),
        ("config not JSON", lambda path: (path / "config.json").write_text("{not json")),
        ("config a list", lambda path: (path / "config.json").write_text("[]")),
        ("no weights", lambda path: (path / "model.safetensors").unlink()),
        ("weights not safetensors", lambda path: (path / "model.safetensors").write_bytes(b"garbage" * 10)),
        ("weights cut short", lambda path: (path / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes()[:999])),
        ("no tokenizer", lambda path: (path / "tokenizer.json").unlink()),
    ]:
        folders[name] = root / name.replace(" ", "-")
        shutil.copytree(good, folders[name])
        damage(folders[name])
    return folders


@pytest.mark.parametrize("damage", ["empty", "config not JSON", "config a list", "no weights", "weights not safetensors",
                                    "weights cut short", "no tokenizer"])
def test_a_broken_target_folder_is_one_line_naming_it(model_folders, damage, capsys, tmp_path):
    folder = model_folders[damage]
    error = one_line_error(invoke(["target=hf", f"target.path={folder}", f"hydra.run.dir={tmp_path / 'run'}"], capsys))
    assert f"target.path={folder}" in error
    assert "model_type" not in error or damage == "config a list"  # an empty folder lacks config.json, not a key


def test_a_broken_init_folder_is_one_line_naming_it(specdec_train):
    init = specdec_train.root / "head"
    init.mkdir()
    (init / "config.json").write_text("{not json")
    (init / "model.safetensors").write_bytes(b"garbage")
    assert f"init={init}: cannot load it (the EAGLE checkpoint at {init} is corrupt" in one_line_error(specdec_train(f"init={init}"))


@pytest.mark.slow  # two torchrun processes: CI runs it after the default suite
def test_under_torchrun_every_process_extracts_its_share_into_the_single_process_cache(specdec_train, tmp_path):
    """Process 0 used to extract alone while the others waited at a barrier (gloo gives up after 30
    minutes by default); now each computes its own shards, and the cache is the one a single
    process writes, byte for byte (one thread each, as the workers run)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert specdec_train("loop.steps=0").code == 0
    finally:
        torch.set_num_threads(threads)
    single = specdec_train.root / "cache" / "features" / "tiny-sharegpt"
    shared = tmp_path / "torchrun"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}",
           "SPECDEC_CACHE": str(shared / "cache"), "COLUMNS": "1000"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(REPO / "tests" / "train_worker.py"), str(shared / "record"), *TINY, "loop.steps=0",
               f"hydra.run.dir={shared / 'run'}"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    calls = [json.loads((shared / f"record.calls-{rank}.json").read_text()) for rank in (0, 1)]
    assert all(calls) and sum(len(c) for c in calls) == len(list(single.glob("shard-*.safetensors"))), calls
    cache = shared / "cache" / "features" / "tiny-sharegpt"
    files = sorted(p.relative_to(single) for p in single.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(cache) for p in cache.rglob("*") if p.is_file())
    for name in files:
        assert (single / name).read_bytes() == (cache / name).read_bytes(), name
