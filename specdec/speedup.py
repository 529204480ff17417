"""The analytic speedup model, and the measured T(n) profile it needs.

Per step the target verifies n tree tokens in time T(n) and the drafter spends T_draft; the step
emits tau tokens on average, where plain decoding emits one per T(1). Hence

    S = tau * T(1) / (T(n) + T_draft).

tau follows from the per-depth conditional acceptance alpha_d of the tree's accepted path:
tau = 1 + sum_d prod_{j <= d} alpha_j (the 1 is the bonus/correction token). For a chain with one
constant alpha and k drafts this is (1 - alpha^(k+1)) / (1 - alpha).
"""

from __future__ import annotations

import csv
import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specdec.tree import SiblingMode, chain_tree

if TYPE_CHECKING:  # the core imports no transformers: the HF backend is only named here
    from specdec.target import HFTarget


def expected_tau(per_depth_alpha: Sequence[float]) -> float:
    tau, survive = 1.0, 1.0
    for alpha in per_depth_alpha:
        survive *= alpha
        tau += survive
    return tau


def chain_tau(alpha: float, k: int) -> float:
    return expected_tau([alpha] * k)


def predicted_speedup(tau: float, target_time_1: float, target_time_n: float, draft_time: float) -> float:
    """S = tau * T(1) / (T(n) + T_draft); all times per step in the same unit."""
    return tau * target_time_1 / (target_time_n + draft_time)


@dataclass(frozen=True)
class ForwardProfile:
    sizes: list[int]  # tree tokens n (root included)
    seconds: list[float]  # median wall time of one forward over n tokens
    context_length: int
    batch_size: int = 1  # requests in the forward, each with n tokens

    def time(self, n: int) -> float:
        """T(n), interpolated linearly between measured sizes (clamped at the ends)."""
        sizes, seconds = self.sizes, self.seconds
        if n <= sizes[0]:
            return seconds[0]
        for (n0, t0), (n1, t1) in zip(zip(sizes, seconds), zip(sizes[1:], seconds[1:])):
            if n <= n1:
                return t0 + (t1 - t0) * (n - n0) / (n1 - n0)
        return seconds[-1]

    def ratios(self) -> dict[int, float]:
        """T(n) / T(1) per measured n (T(1) must have been measured)."""
        t1 = self.time(1)
        return {n: t / t1 for n, t in zip(self.sizes, self.seconds)}


def load_profile(path: str | Path) -> ForwardProfile:
    """A T(n) profile from a CSV with columns n and seconds (and optionally context, batch), as
    ``python -m benchmarks.bench_target --out`` writes it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"no T(n) profile at {path}; write one with python -m benchmarks.bench_target --out FILE"
        )
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or not {"n", "seconds"} <= rows[0].keys():
        raise ValueError(f"{path} is not a T(n) profile: it needs a header with columns n and seconds")
    rows.sort(key=lambda row: int(row["n"]))
    return ForwardProfile(
        sizes=[int(row["n"]) for row in rows],
        seconds=[float(row["seconds"]) for row in rows],
        context_length=int(rows[0].get("context") or 0),
        batch_size=int(rows[0].get("batch") or 1),
    )


def profile_forward(
    target: HFTarget, sizes: Sequence[int], context_length: int = 128, repeats: int = 5, batch_size: int = 1
) -> ForwardProfile:
    """Median time of ``target.forward_tree`` (an HFTarget) over a chain of n - 1 nodes (n rows
    with the root) per request, after a prefill of ``context_length`` tokens, for ``batch_size``
    requests. Each repeat is rolled back, so every forward sees the same context. The sizes take
    turns within each round, so a machine that speeds up or slows down during the profile (a shared
    VM does) moves every T(n) alike instead of bending the curve."""
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.vocab_size, (context_length,), generator=generator)
    target.prefill([prompt] * batch_size, ())
    seconds = median_seconds({n: chain_forward(target, n, generator) for n in sizes}, repeats, target.device)
    return ForwardProfile(list(sizes), [seconds[n] for n in sizes], context_length, batch_size)


def chain_forward(target: HFTarget, n: int, generator: torch.Generator) -> Callable[[], None]:
    """One forward over a random chain of n - 1 draft tokens per request of the target's batch,
    rolled back again: calling it repeatedly times T(n) on an unchanged context."""
    batch = target.cached_lengths.numel()
    tokens = torch.randint(0, target.vocab_size, (1, n - 1), generator=generator).expand(batch, -1)
    tree = chain_tree(tokens.to(target.device), SiblingMode.DETERMINISTIC)

    def forward() -> None:
        target.forward_tree(tree, ())
        target.rewind(target.cached_lengths, target.roots)  # drop the tree rows again

    return forward


def median_seconds(variants: dict, repeats: int, device: torch.device) -> dict:
    """Median wall time of each variant (name: function) over ``repeats`` rounds after one warm-up
    round (it warms up allocations); within a round the variants take turns in rotating order, so machine noise
    hits all alike and no variant always follows the same other. CUDA work is synchronised."""
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for turn in range(repeats + 1):
        for name in names[turn % len(names):] + names[: turn % len(names)]:
            sync()
            start = time.perf_counter()
            variants[name]()
            sync()
            times[name].append(time.perf_counter() - start)
    return {name: sorted(t[1:])[len(t[1:]) // 2] for name, t in times.items()}


# -- choosing the tree budget from the hardware and the drafter ------------------------------------


@dataclass(frozen=True)
class BudgetPoint:
    depth: int  # drafting depth (one drafter pass per depth)
    num_nodes: int  # draft tokens in the tree (the target verifies num_nodes + 1 rows)
    tau: float  # predicted tokens per step and request
    step_s: float  # T(num_nodes + 1) + depth * draft cost per depth
    speedup: float  # predicted, against plain decoding at the profile's batch size
    tokens_per_s: float  # predicted, all requests of the profile's batch together


@dataclass(frozen=True)
class TreeBudget:
    best: BudgetPoint
    curve: list[BudgetPoint]  # every candidate, by depth then num_nodes


# a depth's acceptance measured on fewer attempts is noise: a deep tree's last depth, reached a few
# times, can score full acceptance where the depths above it hold half of it
MIN_ALPHA_ATTEMPTS = 20


def measured_alphas(
    per_depth_alpha: Sequence[float], attempts: Sequence[int] | None, min_attempts: int = MIN_ALPHA_ATTEMPTS
) -> list[float]:
    """The per-depth acceptance up to the first depth reached fewer than ``min_attempts`` times
    (depth 1 always kept; all of it without attempt counts, as in results.json files older than
    them): a budget chooser then credits nothing past it instead of a chance figure."""
    kept = len(per_depth_alpha) if attempts is None else 1
    while kept < len(per_depth_alpha) and attempts[kept] >= min_attempts:
        kept += 1
    return list(per_depth_alpha[:kept])


def rank_share(histogram: Sequence[int]) -> list[float]:
    """Accepted nodes by sibling rank (a results.json ``accepted_rank_histogram``) as fractions;
    [1.0] (a chain) when nothing was accepted."""
    total = sum(histogram)
    return [count / total for count in histogram] if total else [1.0]


@dataclass(frozen=True)
class TreeShape:
    """The trees a drafter can build, as the budget chooser needs them: each node has at most
    ``children`` children, and below the root at most ``parents`` nodes of a depth have any (EAGLE-2
    expands only its top_k best frontier nodes). None = no bound."""

    children: int | None = None
    parents: int | None = None

    def capacity(self, depth: int) -> int | None:
        """The most nodes a tree of ``depth`` levels can hold (None = no bound)."""
        if self.children is None:
            return None
        total, level = 0, 1  # nodes at the depth above: the root first
        for _ in range(depth):
            level = (level if self.parents is None else min(level, self.parents)) * self.children
            total += level
        return total


def best_tree_taus(
    per_depth_alpha: Sequence[float], rank_share: Sequence[float], max_depth: int, max_nodes: int,
    shape: TreeShape = TreeShape(),
) -> list[float]:
    """Predicted tau of the best tree with 1..max_nodes nodes and depth <= max_depth.

    A node reached by sibling ranks (r_1, .., r_d) lies on the accepted path with probability
    prod_j alpha_j * share_{r_j}: alpha_j is the measured acceptance at depth j and share_r the
    measured fraction of accepted nodes that were their parent's rank-r child (so a node's
    children together are accepted with probability alpha_j, the rate measured). tau = 1 + the sum
    over the tree's nodes; the best tree of each size grows greedily, a node's next sibling and
    first child becoming candidates once it is in, within ``shape`` (so every tree is one the
    drafter can build: nodes enter by falling value, so the parents a depth keeps are its best
    nodes, as EAGLE-2's frontier). Depths past the measured alphas and ranks past the measured
    shares are worth nothing.
    """
    alpha = list(per_depth_alpha)[:max_depth]
    ranks = len(rank_share) if shape.children is None else min(len(rank_share), shape.children)
    taus, tau = [], 1.0
    candidates: list[tuple[float, int, int, float]] = []  # (-value, depth, rank, parent value)
    parents_used = [0] * (len(alpha) + 1)  # per depth: its nodes that have children in the tree

    def offer(depth: int, rank: int, parent_value: float) -> None:
        if depth <= len(alpha) and rank < ranks:
            heapq.heappush(candidates, (-parent_value * alpha[depth - 1] * rank_share[rank], depth, rank, parent_value))

    offer(1, 0, 1.0)
    while candidates and len(taus) < max_nodes:
        negative, depth, rank, parent_value = heapq.heappop(candidates)
        if rank == 0 and depth > 1:  # a first child makes its parent one of its depth's parents
            if shape.parents is not None and parents_used[depth - 1] >= shape.parents:
                continue
            parents_used[depth - 1] += 1
        tau -= negative
        taus.append(tau)
        offer(depth, rank + 1, parent_value)
        offer(depth + 1, 0, -negative)
    return taus + [tau] * (max_nodes - len(taus))  # more nodes than are worth anything add nothing


def choose_tree_budget(
    profile: ForwardProfile,
    per_depth_alpha: Sequence[float],
    draft_s_per_depth: float,
    rank_share: Sequence[float] = (1.0,),
    max_depth: int = 8,
    max_nodes: int | None = None,
    shape: TreeShape = TreeShape(),
) -> TreeBudget:
    """The (depth, num_nodes) that maximises predicted tokens/s = tau / (T(n + 1) + depth * c).

    ``rank_share`` (1.0,) describes a chain drafter: the tree is then its depth long. ``profile``
    gives T(n) at the batch size the run will use; ``draft_s_per_depth`` is the drafter's measured
    time per drafting pass at that batch size. ``shape``: the trees the drafter can build
    (drafters.base.tree_shape), so the curve lists and credits only those.
    """
    if not per_depth_alpha or max_depth < 1:
        raise ValueError("choosing a tree budget needs measured per-depth acceptance and max_depth >= 1")
    if abs(sum(rank_share) - 1) > 1e-6 or any(share < 0 for share in rank_share):
        raise ValueError(f"rank_share must be fractions summing to 1; got {list(rank_share)}")
    chain = len(rank_share) == 1
    max_nodes = max_depth if chain or max_nodes is None else max_nodes
    t1 = profile.time(1)
    curve = []
    for depth in range(1, max_depth + 1):
        taus = best_tree_taus(per_depth_alpha, rank_share, depth, max_nodes, shape)
        bound = shape.capacity(depth)
        largest = max_nodes if bound is None else min(max_nodes, bound)
        for num_nodes in [depth] if chain else range(depth, largest + 1):
            tau = taus[num_nodes - 1]
            step_s = profile.time(num_nodes + 1) + depth * draft_s_per_depth
            speedup = predicted_speedup(tau, t1, profile.time(num_nodes + 1), depth * draft_s_per_depth)
            curve.append(BudgetPoint(depth, num_nodes, tau, step_s, speedup, profile.batch_size * tau / step_s))
    return TreeBudget(max(curve, key=lambda point: point.tokens_per_s), curve)
