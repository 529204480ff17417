"""Data-parallel training under torchrun: 2 CPU processes on gloo follow the same trajectory as one
process with the doubled batch, stay in sync, and resume from their shared checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("ddp_worker.py")
ROOT = WORKER.parent.parent


def launch(run_dir: Path, processes: int, steps: int, stop_at: int = 0) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "STOP_AT": str(stop_at)}
    if processes > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
                   str(WORKER), str(run_dir), "1", str(steps)]
    else:  # one process reading both processes' batches at every step
        command = [sys.executable, str(WORKER), str(run_dir), "2", str(steps)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert (done.returncode != 0) == bool(stop_at), done.stderr[-3000:]


def weights(path: Path) -> torch.Tensor:
    return torch.cat([t.flatten() for t in torch.load(path, weights_only=True).values()])


@pytest.mark.slow  # heavy: CI runs it after the default suite
def test_two_gloo_processes_match_one_process_with_the_doubled_batch(tmp_path):
    launch(tmp_path / "ddp", 2, 10)
    launch(tmp_path / "single", 1, 10)
    rank0, rank1 = weights(tmp_path / "ddp" / "final-0.pt"), weights(tmp_path / "ddp" / "final-1.pt")
    single = weights(tmp_path / "single" / "final-0.pt")
    assert torch.equal(rank0, rank1)  # gradients averaged every step: the replicas never drift
    assert torch.allclose(rank0, single, atol=1e-5)  # only the summation order differs
    assert not torch.allclose(rank0, weights_at_start(), atol=1e-3)  # it did train

    # a kill of both processes at step 7 (after the step-4 checkpoint), then the same command:
    # it resumes with each process's own RNG state and lands exactly where the straight run did
    launch(tmp_path / "killed", 2, 10, stop_at=7)
    assert (tmp_path / "killed" / "state" / "rng-1.pt").exists()
    launch(tmp_path / "killed", 2, 10)
    assert torch.equal(weights(tmp_path / "killed" / "final-0.pt"), rank0)


def weights_at_start() -> torch.Tensor:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return torch.cat([t.detach().flatten() for t in model.state_dict().values()])
