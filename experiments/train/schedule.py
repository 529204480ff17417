"""specdec-train schedule=NAME (configs/schedule/): several methods trained in turn through the one
recipe on shares of one time budget, features=online.

Within schedule.budget_s seconds of its start the run (1) lets the target answer opening prompts
itself for schedule.generate_s seconds (experiments.common.answers.answered_prompts), adding those
answers to the training data; (2) trains each of schedule.methods in turn on its share of the time
left when it starts (time one leaves unused goes to the next): a few timed steps decide its number
of steps, so its learning-rate schedule ends when its time does, and the trainer's deadline stops it
with a complete checkpoint should the estimate be off; (3) exports each head as soon as it is
trained into output/<method> and, with eval.prompts > 0, measures it as specdec-train does. A
method that fails is recorded and the next still runs: the time is spent either way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import yaml

from drafters.training.methods import build_method, check_feature_source

STEPS_PLACEHOLDER = "${loop.steps}"  # configs/train/*.yaml values that follow the run's length (Domino's curriculum)


@dataclass
class ScheduleConfig:
    budget_s: float = 480.0  # seconds from the start to the last export
    methods: List[str] = field(default_factory=list)  # configs/train/<name>.yaml, trained in this order
    shares: List[float] = field(default_factory=list)  # each method's share of the time left when it starts
    generate_s: float = 0.0  # seconds of the target's own answers before training (0: none)
    reserve_s: float = 15.0  # seconds each method keeps for its export and evaluation
    max_steps: Optional[int] = None  # cap each method's steps (null: as many as its time allows)
    # settings on top of configs/train/<method>.yaml, e.g. +schedule.train.eagle3.unroll=2
    train: Dict[str, Dict[str, Any]] = field(default_factory=dict)


def check_schedule(schedule: ScheduleConfig) -> None:
    """Raises ValueError naming the option; the methods' own settings are checked by building them."""
    if not schedule.budget_s > 0 or schedule.generate_s < 0 or schedule.reserve_s < 0:
        raise ValueError(f"schedule.budget_s must be > 0, schedule.generate_s and schedule.reserve_s >= 0; got "
                         f"{schedule.budget_s}, {schedule.generate_s}, {schedule.reserve_s}")
    if not schedule.methods or len(schedule.shares) != len(schedule.methods) or min(schedule.shares) <= 0:
        raise ValueError(f"schedule.shares: one positive share per method of schedule.methods; got "
                         f"{list(schedule.shares)} for {list(schedule.methods)}")
    if schedule.max_steps is not None and schedule.max_steps < 1:
        raise ValueError(f"schedule.max_steps must be >= 1 or null; got {schedule.max_steps}")
    unknown = sorted(set(schedule.train) - set(schedule.methods))
    if unknown:
        raise ValueError(f"schedule.train.{unknown[0]}: not one of schedule.methods ({', '.join(schedule.methods)})")


def method_options(schedule: ScheduleConfig, name: str, steps: int, config_dir: Path) -> dict[str, Any]:
    """<config_dir>/train/<name>.yaml (what train=<name> picks) with schedule.train.<name> on top,
    the values that follow loop.steps set to ``steps``."""
    path = config_dir / "train" / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in path.parent.glob("*.yaml")))
        raise ValueError(f"schedule.methods: no configs/train/{name}.yaml; known methods: {known}")
    options = yaml.safe_load(path.read_text())
    options = {**options.get("train", options), **schedule.train.get(name, {})}  # global-package files: their train: section
    return {key: steps if value == STEPS_PLACEHOLDER else value for key, value in options.items()}


def share_end(schedule: ScheduleConfig, index: int, started: float) -> float:
    """When method ``index`` must be done (time.monotonic()): its share of the time left now."""
    left = started + schedule.budget_s - time.monotonic()
    return time.monotonic() + left * schedule.shares[index] / sum(schedule.shares[index:])


def step_seconds(prepared, loss_fn, steps: int = 2) -> float:
    """Seconds per training step (the target's forward, the loss, backward), from ``steps`` steps
    after a first that warms the kernels up; gradients are dropped, nothing is updated."""
    device = next(prepared.model.parameters()).device
    batches = prepared.batches(0)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        loss, _ = loss_fn(next(batches))
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    prepared.model.zero_grad(set_to_none=True)
    return sum(times[1:]) / steps


def check_methods(schedule: ScheduleConfig, config_dir: Path) -> None:
    """Each method's settings build, and it trains on online features; raises ValueError naming it."""
    for name in schedule.methods:
        check_feature_source(build_method(method_options(schedule, name, 1, config_dir)).name, "online")
