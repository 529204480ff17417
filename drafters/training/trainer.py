"""A small, resumable training loop shared by every drafter head (no Hydra, no W&B here).

A run directory holds ``state/`` (the latest checkpoint: model weights in safetensors, optimizer
and scheduler state, the step and each process's RNG state), written every ``checkpoint_every``
steps and at the end, so a killed run resumes from its last checkpoint with the same data order and
ends bitwise equal to an unbroken run. ``snapshot_every`` also keeps the weights of those steps in
``snapshots/`` (for acceptance-against-training-tokens curves).

A checkpoint is complete when its ``progress.json`` exists: it is written last, atomically, and
removed first when a checkpoint is discarded. A new checkpoint is written into ``.state.step-N/``,
then the old ``state/`` is unmarked and removed and the new one renamed into its place; a kill at any
point leaves at least one complete checkpoint, and a resume takes the newest complete one among
``state/`` and ``.state.*/`` (promoting it to ``state/`` and removing the rest). ``checkpoint_hook``
lets fault-injection tests crash at each named point of that sequence (``CRASH_POINTS``).

Data parallel under ``torchrun`` (gloo on CPU, nccl on GPU): process r of W takes batches
s * W + r at step s and gradients are averaged across processes before every optimizer step, so
W processes with batch b follow the same trajectory as one process with batch W * b (tested).
Gradients are all-reduced explicitly rather than through DistributedDataParallel because heads
train through methods other than ``forward`` (e.g. ``forward_sequence``), which DDP's hooks would
not see. Process 0 alone logs and writes checkpoints.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, is_dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from specdec.files import write_atomically

STATE_DIR = "state"
MARKER = "progress.json"  # written last: a checkpoint folder without it is incomplete
# where checkpoint saving, and the recovery a resume does first, can be interrupted, in order
CRASH_POINTS = ("rng-saved", "weights-saved", "optimizer-saved", "marked", "old-unmarked", "old-removed", "renamed",
                "leftover-unmarked", "leftover-removed", "promoted")
# Fault-injection tests set this to a callable that raises or kills the process when it is called
# with one of CRASH_POINTS; real runs leave it None.
checkpoint_hook: Callable[[str], None] | None = None


# The loop's settings and their one set of defaults: specdec-train's schema nests this class as its
# `loop` node (experiments/train/schema.py). Not frozen: OmegaConf makes a frozen dataclass read-only, and
# Hydra merges YAML and overrides into the node.
@dataclass
class TrainConfig:
    steps: int = 600
    lr: float = 5e-4  # AdamW's peak learning rate
    warmup_steps: int = 30  # linear warmup, then cosine decay to 10% of lr (lr_at)
    weight_decay: float = 0.0
    grad_clip: float = 0.5  # the largest gradient norm
    checkpoint_every: int = 50
    log_every: int = 10
    seed: int = 0  # the RNG at step 0 (seed + rank per process); specdec-train also seeds the head and data order
    snapshot_every: int = 0  # also keep the weights every N steps in snapshots/ (0: never)


def init_distributed() -> tuple[int, int]:
    """Join the process group torchrun describes (WORLD_SIZE > 1); returns (rank, world size)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        # every process waits at the end of feature extraction for the slowest one's share (a slower
        # machine's can take hours), so the group gets a longer timeout than torch's default
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=timedelta(hours=24))
    return _rank_and_world()


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


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
    deadline: float | None = None,  # time.monotonic() by which to stop: the step reached is checkpointed
) -> int:
    """Train until config.steps, or until ``deadline`` passes (a run on a time budget: it stops with
    a complete checkpoint, not a killed one), resuming from run_dir/state if present; returns the
    final step."""
    rank, world = _rank_and_world()
    if deadline is not None and world > 1:
        # each process would read its own clock and stop at a different step, leaving the others
        # waiting in the gradient all-reduce
        raise ValueError("train(deadline=...) runs in one process; under torchrun, plan config.steps instead")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.95))
    step = _resume(model, optimizer, run_dir, config, rank, world)  # restores the RNG too: a resumed run continues exactly
    if step == 0:
        torch.manual_seed(config.seed + rank)
    model.train()
    iterator = itertools.islice(batches(step * world + rank), 0, None, world)
    start, window = time.perf_counter(), []
    while step < config.steps:
        batch = next(iterator)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config)
        loss, metrics = loss_fn(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if world > 1:
            _average_gradients(parameters, world)
        grad_norm = torch.nn.utils.clip_grad_norm_(parameters, config.grad_clip)
        optimizer.step()
        step += 1
        window.append({**metrics, "loss": float(loss.detach()), "grad_norm": float(grad_norm)})
        if step % config.log_every == 0 or step == config.steps:
            averaged = {k: sum(m[k] for m in window) / len(window) for k in window[0]}
            averaged.update(lr=lr_at(step - 1, config), seconds=time.perf_counter() - start)
            if rank == 0:  # process 0's own batches: the others train on different ones, identically
                log(step, averaged)
            window = []
        if rank == 0 and config.snapshot_every and step % config.snapshot_every == 0:
            _snapshot(model, run_dir, step)
        out_of_time = deadline is not None and time.monotonic() >= deadline
        if step % config.checkpoint_every == 0 or step == config.steps or out_of_time:
            _checkpoint(model, optimizer, run_dir, step, config, rank, world)
        if out_of_time:
            break
    model.eval()
    return step


def _average_gradients(parameters: list[nn.Parameter], world: int) -> None:
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
    flat = torch.cat([g.flatten() for g in grads])  # one collective per step, not one per tensor
    dist.all_reduce(flat)
    flat /= world
    for p, chunk in zip(parameters, flat.split([g.numel() for g in grads])):
        p.grad = chunk.view_as(p).clone()


def snapshots(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, weights file) of every snapshot a run kept, by step."""
    found = [(int(path.stem.split("-")[1]), path) for path in (Path(run_dir) / "snapshots").glob("step-*.safetensors")]
    return sorted(found)


def _snapshot(model: nn.Module, run_dir: Path, step: int) -> None:
    directory = run_dir / "snapshots"
    directory.mkdir(exist_ok=True)
    final = directory / f"step-{step:06d}.safetensors"
    temporary = final.with_name(f".{final.name}.tmp")
    save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, str(temporary))
    os.replace(temporary, final)


def _checkpoint(model: nn.Module, optimizer, run_dir: Path, step: int, config: TrainConfig, rank: int, world: int) -> None:
    """Every process writes its RNG state into .state.step-N, process 0 the weights, the optimizer and,
    once all are on disk, the marker; only then is the old state/ discarded and the new one renamed
    into its place (see the module docstring for why a kill at any point loses nothing)."""
    temporary = run_dir / f".{STATE_DIR}.step-{step}"
    if rank == 0:
        temporary.mkdir()
    _barrier()
    torch.save(torch.get_rng_state(), temporary / f"rng-{rank}.pt")
    _reached("rng-saved")
    if rank == 0:
        save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, str(temporary / "model.safetensors"))
        _reached("weights-saved")
        torch.save({"optimizer": optimizer.state_dict()}, temporary / "optimizer.pt")
        _reached("optimizer-saved")
    _barrier()  # the marker may only claim what every process has written
    if rank == 0:
        progress = {"step": step, "world": world, "config": asdict(config), "model_config": _model_config(model)}
        write_atomically(temporary / MARKER, lambda path: path.write_text(json.dumps(progress)))
        _reached("marked")
        final = run_dir / STATE_DIR
        if final.exists():
            _discard(final, "old")
        os.replace(temporary, final)
        _reached("renamed")
    _barrier()


def _discard(folder: Path, role: str) -> None:
    """Unmark first: a folder half removed must never look like a complete checkpoint."""
    (folder / MARKER).unlink(missing_ok=True)
    _reached(f"{role}-unmarked")
    shutil.rmtree(folder)
    _reached(f"{role}-removed")


def _reached(point: str) -> None:
    if checkpoint_hook is not None:
        checkpoint_hook(point)


def _checkpoint_folders(run_dir: Path) -> list[Path]:
    """state/ and every .state.*/ a killed save left (.state.stale: written by earlier versions)."""
    return [p for p in [run_dir / STATE_DIR, *sorted(run_dir.glob(f".{STATE_DIR}.*"))] if p.is_dir()]


def _completed_step(folder: Path) -> int | None:
    """The step of a complete checkpoint; None for one whose marker was never written or was removed."""
    marker = folder / MARKER
    if not marker.exists():
        return None
    try:
        return int(json.loads(marker.read_text())["step"])
    except (ValueError, KeyError, TypeError) as error:
        # the marker is renamed into place whole, so only damage from outside makes it unreadable
        raise ValueError(f"cannot resume from {folder}: its {MARKER} is unreadable ({error}); delete {folder} to start over") from error


def latest_checkpoint(run_dir: str | Path) -> tuple[int, Path] | None:
    """(step, folder) of the newest complete checkpoint in ``run_dir`` (state/ at a tie), or None."""
    complete = [(step, folder.name == STATE_DIR, folder) for folder in _checkpoint_folders(Path(run_dir))
                if (step := _completed_step(folder)) is not None]
    if not complete:
        return None
    step, _, folder = max(complete)
    return step, folder


def checkpoint_draft_ids(folder: Path) -> Tensor | None:  # [K] token ids
    """The draft vocabulary the head in checkpoint ``folder`` drafts from (None: a head without
    one), so that a resume builds the head on it instead of counting the target's choices again."""
    try:
        with safe_open(str(folder / "model.safetensors"), "pt") as weights:
            return weights.get_tensor("draft_ids") if "draft_ids" in weights.keys() else None
    except Exception as error:
        raise ValueError(f"cannot resume from {folder}: {error}; delete it to start over") from error


def _recover(run_dir: Path) -> None:
    """Leave the newest complete checkpoint as state/ and nothing else; each step keeps it complete,
    so a kill here is recovered by the next resume the same way."""
    latest = latest_checkpoint(run_dir)
    final = run_dir / STATE_DIR
    if latest is None and final.exists():
        raise ValueError(f"cannot resume from {final}: it holds no {MARKER}, so it is incomplete; delete it to start over")
    for folder in _checkpoint_folders(run_dir):
        if latest is None or folder != latest[1]:
            _discard(folder, "leftover")
    if latest is not None and latest[1] != final:
        os.replace(latest[1], final)
        _reached("promoted")


def _model_config(model: nn.Module) -> dict | None:
    """The head's config as JSON would hold it (tuples as lists): kept in every checkpoint so that a
    resume which would rebuild the head differently (weights of the same shapes, e.g. another RoPE
    base) fails instead of training on silently."""
    config = getattr(model, "config", None)
    return json.loads(json.dumps(asdict(config))) if is_dataclass(config) else None


def _resume(model: nn.Module, optimizer, run_dir: Path, config: TrainConfig, rank: int, world: int) -> int:
    if rank == 0:
        _recover(run_dir)
    _barrier()
    state = run_dir / STATE_DIR
    if not state.exists():
        return 0
    try:
        progress = json.loads((state / MARKER).read_text())
        model.load_state_dict(load_file(str(state / "model.safetensors")))
        saved = torch.load(state / "optimizer.pt", weights_only=True)
        rng = torch.load(state / f"rng-{rank}.pt", weights_only=True) if progress.get("world", 1) == world else None
    except Exception as error:
        raise ValueError(f"cannot resume from {state}: {error}; delete it to start over") from error
    if rng is None:
        raise ValueError(f"{state} was written by {progress['world']} processes; resume it with the same number (got {world})")
    saved_config, built = progress.get("model_config"), _model_config(model) or {}
    if saved_config is not None and saved_config != built:
        changed = [k for k in saved_config if built.get(k) != saved_config[k]]
        raise ValueError(
            f"{state} was trained as a head with {', '.join(f'{k}={saved_config[k]!r}' for k in changed)}, but this run "
            f"builds {', '.join(f'{k}={built.get(k)!r}' for k in changed)} (the code or the settings changed since it "
            f"started); resume with the settings and code it started with, or start a new run dir"
        )
    optimizer.load_state_dict(saved["optimizer"])
    torch.set_rng_state(rng)
    if progress["config"]["steps"] != config.steps:
        # a longer schedule is a different cosine: say so rather than silently bending it
        print(f"note: resuming a run planned for {progress['config']['steps']} steps with steps={config.steps}")
    return int(progress["step"])
