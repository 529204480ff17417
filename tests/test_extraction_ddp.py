"""Feature extraction sharded across torchrun processes (2 CPU processes on gloo): each computes only
its own shards, the cache equals a single process's byte for byte, and a partial or killed cache
resumes under any number of processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from extract_worker import extract, sequences

WORKER = Path(__file__).with_name("extract_worker.py")
ROOT = WORKER.parent.parent
SHARDS = 6  # extract_worker: 11 sequences, 2 per shard


def torchrun(*arguments: str, fails: bool = False) -> str:
    """Two processes under torchrun; returns their stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *arguments]
    done = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert (done.returncode != 0) == fails, done.stderr[-3000:]
    return done.stderr


def launch(directory: Path, stop_at: int = 0) -> list[list[int]]:
    """extract_worker in two processes; returns the shards each computed (none recorded for a killed run)."""
    torchrun(str(WORKER), str(directory), str(stop_at), "same", fails=bool(stop_at))
    calls = [Path(f"{directory}.calls-{rank}.json") for rank in (0, 1)]
    return [json.loads(path.read_text()) for path in calls if path.exists()]


def single_process(directory: Path) -> list[int]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the workers: the same kernels, so the same bits
    try:
        return extract(directory, distributed=False)[0]
    finally:
        torch.set_num_threads(threads)


def contents(directory: Path) -> dict[str, bytes]:
    """Every file of a cache (shards, labels, meta.json) by its path inside the folder."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def stamps(directory: Path) -> dict[str, tuple[int, int]]:
    """Inode and modification time of every file: a file rewritten (even identically) changes both."""
    return {name: (os.stat(directory / name).st_ino, os.stat(directory / name).st_mtime_ns) for name in contents(directory)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("extraction") / "single"
    assert single_process(directory) == list(range(SHARDS))
    assert len(contents(directory)) == 2 * SHARDS + 1  # shards, their labels (choices/) and meta.json
    return directory


@pytest.mark.slow  # heavy: CI runs it after the default suite
def test_two_processes_split_the_shards_and_write_the_single_process_cache(tmp_path, reference):
    assert launch(tmp_path / "two") == [[0, 2, 4], [1, 3, 5]]  # round robin, nothing computed twice
    assert contents(tmp_path / "two") == contents(reference)
    reports = json.loads((tmp_path / "two.progress.json").read_text())
    total = sum(len(s) for s in sequences())
    assert reports[-1] == [total, total]  # rank 0 reports the whole cache, the other rank's shards too
    assert [done for done, _ in reports] == sorted(done for done, _ in reports)


@pytest.mark.slow  # heavy: CI runs it after the default suite
def test_two_processes_resume_a_partial_cache(tmp_path, reference):
    # missing shards, a shard that lost its labels and a temporary left by a kill: the two processes
    # compute exactly the missing shards, relabel, and leave every other file untouched
    partial = tmp_path / "partial"
    shutil.copytree(reference, partial)
    for name in ("shard-00001.safetensors", "shard-00004.safetensors", "choices/shard-00001.safetensors",
                 "choices/shard-00004.safetensors", "choices/shard-00002.safetensors"):
        (partial / name).unlink()
    (partial / "tmpleftover.tmp").write_bytes(b"half a shard")
    kept = stamps(partial)
    assert launch(partial) == [[4], [1]]
    assert stamps(partial).items() >= kept.items()
    (partial / "tmpleftover.tmp").unlink()
    assert contents(partial) == contents(reference)


@pytest.mark.slow  # a third torchrun launch; test_two_processes_resume_a_partial_cache covers resuming by default
def test_a_killed_two_process_extraction_resumes_in_one_process(tmp_path, reference):
    killed = tmp_path / "killed"
    launch(killed, stop_at=2)  # process 1 dies as it starts its second shard (shard 3); torchrun stops process 0
    written = {p.name for p in killed.glob("shard-*.safetensors")}
    assert "shard-00001.safetensors" in written and "shard-00003.safetensors" not in written
    kept = {name: stamp for name, stamp in stamps(killed).items() if name.startswith("shard-")}
    # another world size: the one process computes just what the two did not write, whoever wrote it
    assert single_process(killed) == sorted(set(range(SHARDS)) - {int(name[6:11]) for name in written})
    assert stamps(killed).items() >= kept.items()
    for path in killed.glob("*.tmp"):  # what a kill in the middle of a write leaves behind
        path.unlink()
    assert contents(killed) == contents(reference)


def test_distributed_extraction_outside_torchrun_is_refused(tmp_path):
    with pytest.raises(ValueError, match="init_distributed"):
        extract(tmp_path / "cache", distributed=True)
    assert not (tmp_path / "cache" / "meta.json").exists()  # refused before anything is written


@pytest.mark.slow  # a torchrun launch for an error message
def test_processes_given_different_sequences_are_refused_before_any_work(tmp_path):
    stderr = torchrun(str(WORKER), str(tmp_path / "cache"), "0", "drop-last", fails=True)
    assert "process 0: 11, process 1: 10" in stderr
    assert not list((tmp_path / "cache").iterdir())  # no meta.json, no shard


@pytest.mark.slow  # two processes loading a model folder through the command
def test_the_command_under_torchrun_extracts_every_shard_and_rank_0_reports(tmp_path):
    from safetensors.torch import load_file
    from tiny_models import save_base_model

    model = save_base_model(tmp_path / "model")
    (tmp_path / "sequences.json").write_text(json.dumps(sequences()))
    out = tmp_path / "cache"
    stderr = torchrun("-m", "experiments.extract_features", "--out", str(out), "--target", str(model),
                      "--sequences", str(tmp_path / "sequences.json"), "--layers", "1", "3", "--per-shard", "2",
                      "--max-length", "64", "--threads", "1", "--device", "cpu")
    total = sum(len(s) for s in sequences())
    assert stderr.count(f"{total}/{total} tokens") == 1  # rank 0 alone prints the progress
    assert [p.name for p in sorted(out.glob("shard-*"))] == [f"shard-{i:05d}.safetensors" for i in range(SHARDS)]
    assert len(list((out / "choices").glob("shard-*"))) == SHARDS
    tokens = torch.cat([load_file(str(out / f"shard-{i:05d}.safetensors"))["tokens"] for i in range(SHARDS)])
    assert tokens.tolist() == [t for s in sequences() for t in s]
