"""budget.mode=auto: the drafter's depth and tree size chosen to maximise predicted tokens/s, from
the target's measured T(n) and the drafter's measured acceptance (specdec.speedup.choose_tree_budget).

Which options to set, the drafter declares when it registers (``drafters.base.BudgetKnobs``): a
depth (``depth``, ``num_draft``, ...) and, for tree drafters, a node count (``total_tokens``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from drafters import base as drafter_registry
from experiments.cli import SpecdecUserError, require
from experiments.run.build import Pieces, build_drafter
from experiments.run.measure import DecoderSide, decode
from specdec.decode import SpecDecoder
from specdec.speedup import (
    ForwardProfile,
    choose_tree_budget,
    load_profile,
    measured_alphas,
    profile_forward,
    rank_share,
)


@dataclass(frozen=True)
class Acceptance:
    """What the budget chooser needs to know about a drafter."""

    per_depth_alpha: list[float]
    rank_share: list[float]  # fraction of accepted nodes that were their parent's rank-r child
    draft_s_per_depth: float  # drafter time per drafting pass, at the run's batch size
    source: str  # "calibration" or the results.json it came from


def choose_budget(pieces: Pieces) -> tuple[dict[str, Any], dict[str, Any]]:
    """The drafter's options with its budget knobs set, and the record for results.json."""
    cfg, options = pieces.settings.budget, dict(pieces.settings.drafter)
    name = options.get("name")
    knobs = drafter_registry.budget_knobs(name) if name is not None else drafter_registry.BudgetKnobs()
    require(
        knobs.depth is not None or knobs.nodes is not None,
        f"budget.mode=auto sets a drafter's depth or tree size, and drafter {name} declares neither "
        f"(drafters.base.BudgetKnobs); use budget.mode=fixed",
    )

    def sized(depth: int, num_nodes: int) -> dict[str, int]:
        chosen = {knobs.depth: depth} if knobs.depth else {}
        return {**chosen, knobs.nodes: num_nodes} if knobs.nodes else chosen

    factory_options = {k: v for k, v in options.items() if k != "name"}
    # a head trained for so many positions drafts no deeper (Domino's block, Medusa's heads, ...)
    deepest = drafter_depth_limit(pieces, options, knobs)
    max_depth = cfg.max_depth if deepest is None else min(cfg.max_depth, deepest)
    profile = load_profile(cfg.profile) if cfg.profile else measure_profile(pieces)
    if cfg.acceptance:
        acceptance = read_acceptance(Path(cfg.acceptance), knobs.depth, profile)
    else:
        acceptance = calibrate(pieces, {**options, **sized(max_depth, cfg.max_nodes)}, max_depth)
    tree = knobs.nodes is not None  # the others are modelled as chains
    budget = choose_tree_budget(
        profile,
        acceptance.per_depth_alpha,
        acceptance.draft_s_per_depth,
        acceptance.rank_share if tree else (1.0,),
        max_depth,
        cfg.max_nodes,
        drafter_registry.tree_shape(name, factory_options),
    )
    chosen = sized(budget.best.depth, budget.best.num_nodes)
    record = {
        "mode": "auto",
        "chosen": chosen,
        "max_depth": max_depth,  # budget.max_depth, or less where the drafter cannot draft that deep
        "predicted": asdict(budget.best),
        "curve": [asdict(point) for point in budget.curve],
        "profile": {**asdict(profile), "source": cfg.profile or "measured"},
        "acceptance": asdict(acceptance),
    }
    return {**options, **chosen}, record


def drafter_depth_limit(pieces: Pieces, options: dict[str, Any], knobs: drafter_registry.BudgetKnobs) -> int | None:
    """The deepest the configured drafter can draft (``DrafterBase.max_depth``; None: no bound),
    read from one built with its budget knobs at their defaults when it declares such a bound."""
    if knobs.depth is None or not knobs.bounded:
        return None
    unsized = {k: v for k, v in options.items() if k not in (knobs.depth, knobs.nodes)}
    return build_drafter(unsized, pieces.target).max_depth


def measure_profile(pieces: Pieces) -> ForwardProfile:
    """T(n) at the run's batch size, after a context as long as a typical request's mid-generation."""
    settings, target = pieces.settings, pieces.target
    require(
        target.kind == "model",
        "budget.mode=auto needs the target's T(n), and only a model target can be timed; pass a measured "
        "profile: budget.profile=CSV",
    )
    largest = settings.budget.max_nodes + 1
    steps = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
    sizes = sorted({n for n in steps if n < largest} | {largest})
    typical = sum(len(r.prompt) for r in pieces.requests) // len(pieces.requests) + settings.max_new_tokens // 2
    context = max(1, min(typical, target.max_length - largest))
    with pieces.console.status(f"measuring T(n) for n <= {largest} at batch {settings.batch_size}"):
        return profile_forward(target, sizes, context, repeats=3, batch_size=settings.batch_size)


def calibrate(pieces: Pieces, options: dict[str, Any], depth: int) -> Acceptance:
    """Acceptance at the largest budget (``options`` drafting ``depth`` deep) on the first prompts,
    so every depth the chooser may pick has been measured (a depth reached too rarely counts as
    unmeasured: speedup.measured_alphas)."""
    settings = pieces.settings
    decoder = SpecDecoder(pieces.target, build_drafter(options, pieces.target), pieces.verifier)
    calibration = pieces.requests[: settings.budget.calibration_prompts]
    with pieces.console.status(f"calibrating {options['name']} on {len(calibration)} prompts"):
        stats = decode(DecoderSide(decoder), calibration, pieces.plan()).decoded.stats
    require(
        bool(stats.per_depth_alpha),
        f"the calibration run drafted nothing on {len(calibration)} prompts, so acceptance is unknown; raise "
        f"budget.calibration_prompts or pass budget.acceptance=<an earlier results.json>",
    )
    draft_s_per_step = stats.time.draft_s / max(stats.num_steps, 1)
    return Acceptance(
        measured_alphas(stats.per_depth_alpha, stats.per_depth_attempts),
        rank_share(stats.accepted_rank_histogram),
        draft_s_per_step / depth,
        "calibration",
    )


def read_acceptance(path: Path, depth_key: str | None, profile: ForwardProfile) -> Acceptance:
    """Acceptance from an earlier run's results.json; its drafter cost ratio c (per step, in units
    of T(1)) becomes seconds per drafting pass through this profile's T(1)."""
    try:
        previous = json.loads(path.read_text())
        alpha, cost = previous["per_depth_alpha"], previous["drafter_cost_ratio"]
        attempts = previous.get("per_depth_attempts")
        drafter = previous["config"]["drafter"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise SpecdecUserError(
            f"budget.acceptance={path} is not a specdec-run results.json with per_depth_alpha, "
            f"drafter_cost_ratio and config.drafter ({error})"
        ) from error
    require(alpha, f"budget.acceptance={path}: that run measured no acceptance (no draft was ever tried)")
    passes = drafter.get(depth_key) if depth_key else None
    return Acceptance(
        measured_alphas(alpha, attempts),
        rank_share(previous.get("accepted_rank_histogram", [])),
        cost * profile.time(1) / (passes or len(alpha)),  # the run drafted every depth it measured
        str(path),
    )
