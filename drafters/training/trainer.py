"""A small, resumable training loop shared by every drafter head (no Hydra, no W&B here).

A run directory holds ``state/`` (the latest checkpoint: model weights in safetensors, optimizer
and scheduler state, the step and the RNG state), written atomically every ``checkpoint_every``
steps and at the end, so a killed run resumes from its last checkpoint with the same data order.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

STATE_DIR = "state"


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    lr: float = 3e-4
    warmup_steps: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    checkpoint_every: int = 100
    log_every: int = 10
    seed: int = 0


def lr_at(step: int, config: TrainConfig) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def train(
    model: nn.Module,
    batches: Callable[[int], Iterator],  # step -> an iterator of batches starting at that step
    loss_fn: Callable[[object], tuple[Tensor, dict[str, float]]],
    config: TrainConfig,
    run_dir: str | Path,
    log: Callable[[int, dict[str, float]], None] = lambda step, metrics: None,
) -> int:
    """Train until config.steps, resuming from run_dir/state if present; returns the final step."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.95))
    step = _resume(model, optimizer, run_dir, config)  # restores the RNG too: a resumed run continues exactly
    if step == 0:
        torch.manual_seed(config.seed)
    model.train()
    iterator = batches(step)
    start, window = time.perf_counter(), []
    while step < config.steps:
        batch = next(iterator)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config)
        loss, metrics = loss_fn(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(parameters, config.grad_clip)
        optimizer.step()
        step += 1
        window.append({**metrics, "loss": float(loss.detach()), "grad_norm": float(grad_norm)})
        if step % config.log_every == 0 or step == config.steps:
            averaged = {k: sum(m[k] for m in window) / len(window) for k in window[0]}
            averaged.update(lr=lr_at(step - 1, config), seconds=time.perf_counter() - start)
            log(step, averaged)
            window = []
        if step % config.checkpoint_every == 0 or step == config.steps:
            _checkpoint(model, optimizer, run_dir, step, config)
    model.eval()
    return step


def _checkpoint(model: nn.Module, optimizer, run_dir: Path, step: int, config: TrainConfig) -> None:
    from safetensors.torch import save_file

    temporary = Path(tempfile.mkdtemp(dir=run_dir, prefix=f".{STATE_DIR}."))
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, str(temporary / "model.safetensors"))
        torch.save({"optimizer": optimizer.state_dict(), "rng": torch.get_rng_state()}, temporary / "optimizer.pt")
        (temporary / "progress.json").write_text(json.dumps({"step": step, "config": asdict(config)}))
        final = run_dir / STATE_DIR
        if final.exists():
            stale = run_dir / f".{STATE_DIR}.stale"
            shutil.rmtree(stale, ignore_errors=True)
            os.replace(final, stale)
            os.replace(temporary, final)
            shutil.rmtree(stale)
        else:
            os.replace(temporary, final)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def _resume(model: nn.Module, optimizer, run_dir: Path, config: TrainConfig) -> int:
    from safetensors.torch import load_file

    state = run_dir / STATE_DIR
    if not state.exists():
        return 0
    try:
        progress = json.loads((state / "progress.json").read_text())
        model.load_state_dict(load_file(str(state / "model.safetensors")))
        saved = torch.load(state / "optimizer.pt", weights_only=True)
    except Exception as error:
        raise ValueError(f"cannot resume from {state}: {error}; delete it to start over") from error
    optimizer.load_state_dict(saved["optimizer"])
    torch.set_rng_state(saved["rng"])
    if progress["config"]["steps"] != config.steps:
        # a longer schedule is a different cosine: say so rather than silently bending it
        print(f"note: resuming a run planned for {progress['config']['steps']} steps with steps={config.steps}")
    return int(progress["step"])
