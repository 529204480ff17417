"""What the fault-injection tests share: the kill they inject, the files they compare, and the tiny
target and feature cache the training-side suites run on."""

from __future__ import annotations

from pathlib import Path

import torch

from drafters.training.features import CacheMeta, extract_features
from specdec.target import HFTarget
from tiny_models import tiny_model


class Crash(BaseException):
    """A kill: raised where a test says, caught by nothing under test (no ``except Exception``), so
    nothing after it runs, as after SIGKILL."""


def files_of(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` but the temporaries a kill may leave (never read: see each test)."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and not any(part.startswith((".", "tmp")) for part in p.relative_to(directory).parts)}


def tiny_target() -> HFTarget:
    return HFTarget(tiny_model("llama", sharpness=4.0))


def tiny_features(target: HFTarget, directory: Path) -> Path:
    """Layers 1 and 3 of 8 random sequences, two a shard."""
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, 128, (24,), generator=generator).tolist() for _ in range(8)]
    meta = CacheMeta("tiny", target.hidden_size, target.num_layers, target.vocab_size, (1, 3), 64, 2)
    return extract_features(target, sequences, directory, meta, batch_size=2)
