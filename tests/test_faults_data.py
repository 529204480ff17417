"""Fault injection for the data training and retrieval read: a kill before, after or halfway through
every file write of feature extraction and of build_datastore, a SIGKILL at a random moment of an
extraction, and bad build_datastore and extract_features inputs.

A kill is a Crash, a BaseException that no code under test catches, raised around a write the test
wraps, so nothing after it runs. After every kill no partial shard may be listed, no partial
datastore folder may appear, and a rerun must write byte-identical files.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from drafters.training.features import CacheMeta, FeatureCache, extract_features
from faults import Crash, files_of, tiny_features, tiny_target
from specdec import packaged_models
from specdec.target import HFTarget
from tiny_models import save_base_model

REPO = Path(__file__).resolve().parent.parent


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


@pytest.fixture(scope="module")
def extracted(tmp_path_factory) -> tuple[HFTarget, Path]:
    """The tiny target and its features, extracted without a kill."""
    target = tiny_target()
    return target, tiny_features(target, tmp_path_factory.mktemp("features"))


def test_a_kill_at_any_write_of_feature_extraction_reruns_to_identical_files(extracted, tmp_path, monkeypatch):
    import safetensors.torch

    target, features = extracted
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
from test_faults_data import many_shards
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


@pytest.mark.integration  # the fast tier keeps a kill at every write (above)
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


def bad_jsonl(directory: Path) -> Path:
    path = directory / "corpus.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "cut\n')
    return path


@pytest.mark.parametrize("arguments,message", [
    (lambda d, c: ["--jsonl", str(d / "none.jsonl"), "--tokenizer", str(c / "tokenizer")], "--jsonl: prompt file"),
    (lambda d, c: ["--jsonl", str(bad_jsonl(d)), "--tokenizer", str(c / "tokenizer")], "line 2 is not valid JSON"),
    (lambda d, c: ["--jsonl", str(c / "corpus.jsonl"), "--tokenizer", str(d / "none")], "cannot load a tokenizer"),
    (lambda d, c: ["--jsonl", str(c / "corpus.jsonl"), "--tokenizer", str(d)], "cannot load a tokenizer"),
    (lambda d, c: ["--generate", str(d / "none")], "not a packaged target (smollm2, gemma3_270m) and not a Hugging Face model folder"),
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
    (["--target", "/no/such/model"], "--target /no/such/model: not a packaged target (smollm2, gemma3_270m) and not a"),
])
def test_a_bad_extract_features_option_is_named_before_the_model_loads(tmp_path, capsys, monkeypatch, arguments, message):
    from experiments import extract_features as command

    monkeypatch.setattr(packaged_models, "load_smollm2", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(SystemExit) as exit:
        command.main(["--out", str(tmp_path / "features"), *arguments])
    assert exit.value.code == 2 and message in capsys.readouterr().err
