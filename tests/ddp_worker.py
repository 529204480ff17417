"""Run by tests/test_training_ddp.py, under torchrun or alone: trains a small regression with the
shared trainer and saves the final weights. Batches depend only on their index, so W processes
with batch b and one process with batch W * b see the same examples at every step."""

from __future__ import annotations

import os
import sys

import torch

from drafters.training.trainer import TrainConfig, init_distributed, train

DATA = torch.Generator().manual_seed(7)
X, Y = torch.randn(256, 8, generator=DATA), torch.randn(256, 1, generator=DATA)


def batches_of(size: int, merge: int):
    """Batch i holds examples [i*size, (i+1)*size); with merge=W one batch is W consecutive ones."""

    def batches(step: int):
        while True:
            index = torch.arange(step * merge * size, (step + 1) * merge * size) % len(X)
            yield X[index], Y[index]
            step += 1

    return batches


def main(run_dir: str, merge: int, steps: int) -> None:
    torch.set_num_threads(1)
    rank, world = init_distributed()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    stop_at, calls = int(os.environ.get("STOP_AT", "0")), [0]

    def loss_fn(batch):
        calls[0] += 1
        if calls[0] == stop_at:  # every process dies at the same step, between two checkpoints
            raise SystemExit(3)
        x, y = batch
        noise = 0.01 * torch.randn(())  # per-process RNG use must continue identically after a resume
        return ((model(x) - y) ** 2).mean() + noise, {}

    config = TrainConfig(steps=steps, lr=1e-2, warmup_steps=2, checkpoint_every=4, log_every=2)
    train(model, batches_of(4, merge), loss_fn, config, run_dir)
    torch.save(model.state_dict(), f"{run_dir}/final-{rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
