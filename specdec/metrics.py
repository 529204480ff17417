"""Acceptance statistics of a generation run.

tau = tokens emitted per target forward (accepted drafts + the bonus/correction token), over
request-steps in which the request was still generating. Per-depth alpha_d = P(a node at depth d is
accepted | the walk reached depth d-1 and that node had children): the conditional acceptance the
analytic speedup model takes as input.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields

import torch
from torch import Tensor

from specdec.protocols import VerifyResult
from specdec.tree import DraftTree


@dataclass(frozen=True)
class TimeSplit:
    draft_s: float = 0.0
    target_s: float = 0.0  # target forwards over the trees (prefill excluded)
    verify_s: float = 0.0  # acceptance walk + sampling
    other_s: float = 0.0  # commits, bookkeeping, host syncs: the loop's overhead
    total_s: float = 0.0
    prefill_s: float = 0.0  # target prefills of the prompts (at the start and on admission)

    @property
    def overhead_share(self) -> float:
        """Share of the wall time spent outside drafting, the target's forwards and verification:
        1 - (prefill + draft + target + verify) / total."""
        return self.other_s / self.total_s if self.total_s > 0 else 0.0

    @classmethod
    def sum(cls, parts: Sequence[TimeSplit], scale: float = 1.0) -> TimeSplit:
        """Part by part, times ``scale`` (1 / passes: the mean of repeated passes)."""
        return cls(*(scale * sum(getattr(part, f.name) for part in parts) for f in fields(cls)))


@dataclass(frozen=True)
class AcceptanceStats:
    num_requests: int
    num_steps: int  # decode steps of the batch (target forwards)
    request_steps: int  # (request, step) pairs in which the request was generating
    generated_tokens: int  # tokens kept in the outputs (after max_new_tokens / EOS truncation)
    tau: float
    per_depth_alpha: list[float]  # index d-1 for depth d
    per_depth_attempts: list[int]  # how often depth d was reached (alpha's denominator)
    per_depth_accepted: list[int]  # how often a node at depth d was accepted (alpha's numerator)
    survival: list[float]  # P(num_accepted >= d) for d = 0..max depth
    accepted_histogram: list[int]  # request-steps with exactly n drafts accepted, n = 0..
    accepted_rank_histogram: list[int]  # accepted nodes by sibling rank (0 = the drafter's first)
    mean_tree_nodes: float
    tokens_per_s: float
    time: TimeSplit = field(default_factory=TimeSplit)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def merged(cls, parts: Sequence[AcceptanceStats], time: TimeSplit | None = None) -> AcceptanceStats:
        """Several runs' statistics as if they were one run: counts add (alpha is recomputed from
        them, never averaged), means are weighed by request-steps. ``time``: the merged run's time
        split (None = the parts' times added)."""
        time = time if time is not None else TimeSplit.sum([p.time for p in parts])
        request_steps = sum(p.request_steps for p in parts)
        attempts = _sum_counts([p.per_depth_attempts for p in parts])
        accepted = _sum_counts([p.per_depth_accepted for p in parts])
        histogram = _sum_counts([p.accepted_histogram for p in parts])
        generated = sum(p.generated_tokens for p in parts)
        return cls(
            num_requests=sum(p.num_requests for p in parts),
            num_steps=sum(p.num_steps for p in parts),
            request_steps=request_steps,
            generated_tokens=generated,
            tau=sum((n + 1) * count for n, count in enumerate(histogram)) / max(request_steps, 1),
            per_depth_alpha=[a / n if n else 0.0 for a, n in zip(accepted, attempts)],
            per_depth_attempts=attempts,
            per_depth_accepted=accepted,
            survival=[sum(histogram[d:]) / request_steps for d in range(len(histogram))] if request_steps else [],
            accepted_histogram=histogram,
            accepted_rank_histogram=_sum_counts([p.accepted_rank_histogram for p in parts]),
            mean_tree_nodes=sum(p.mean_tree_nodes * p.request_steps for p in parts) / max(request_steps, 1),
            tokens_per_s=generated / time.total_s if time.total_s > 0 else 0.0,
            time=time,
        )


def sibling_rank(tree: DraftTree) -> Tensor:  # [B, N] int64, 0 for the first child of its parent
    same_parent = tree.parents[:, :, None] == tree.parents[:, None, :]  # [B, N(i), N(j)]
    earlier = torch.ones_like(same_parent[0]).tril(-1)  # j < i
    return (same_parent & earlier & tree.node_valid()[:, None, :]).sum(-1)


class StatsRecorder:
    """Collects per-step tensors on the device; everything is reduced once in :meth:`finish`."""

    def __init__(self) -> None:
        self._steps: list[dict[str, Tensor]] = []

    def record(self, requests: Tensor, tree: DraftTree, result: VerifyResult) -> None:
        """requests: [A] int64, the request index of each batch row (all still generating)."""
        accepted_ranks = sibling_rank(tree).gather(1, result.accepted_nodes.clamp(min=0))
        self._steps.append(
            {
                "requests": requests.clone(),
                "num_accepted": result.num_accepted.clone(),
                "num_nodes": tree.num_nodes.clone(),
                "reached": _reached_depths(tree, result).sum(0),  # [N] per depth
                "accepted_ranks": torch.where(result.accepted_nodes >= 0, accepted_ranks, -1),
            }
        )

    def per_step_records(self) -> list[dict]:
        """One row per step (for JSONL logs): batch means over the requests still generating."""
        return [
            {
                "step": step,
                "active_requests": len(s["requests"]),
                "mean_accepted": float(s["num_accepted"].double().mean()),
                "mean_tree_nodes": float(s["num_nodes"].double().mean()),
                "requests": s["requests"].tolist(),
                "num_accepted": s["num_accepted"].tolist(),
            }
            for step, s in enumerate(self._steps)
        ]

    def finish(self, num_requests: int, generated_tokens: int, time: TimeSplit) -> AcceptanceStats:
        if not self._steps:
            return AcceptanceStats(num_requests, 0, 0, generated_tokens, 0.0, [], [], [], [], [], [], 0.0, 0.0, time)
        width = max(s["reached"].shape[0] for s in self._steps)
        num_accepted = torch.cat([s["num_accepted"] for s in self._steps])  # [request-steps]
        num_nodes = torch.cat([s["num_nodes"] for s in self._steps])
        attempts = torch.stack([_pad(s["reached"], width) for s in self._steps]).sum(0)  # [width]
        depths = torch.arange(1, width + 1, device=num_accepted.device)
        accepted_at_depth = (num_accepted[:, None] >= depths).sum(0)  # [width]
        ranks = torch.cat([s["accepted_ranks"].flatten() for s in self._steps])
        ranks = ranks[ranks >= 0]
        max_accepted = int(num_accepted.max())
        depth_limit = int((attempts > 0).sum())
        wall = time.total_s
        return AcceptanceStats(
            num_requests=num_requests,
            num_steps=len(self._steps),
            request_steps=num_accepted.numel(),
            generated_tokens=generated_tokens,
            tau=float((num_accepted + 1).double().mean()),
            per_depth_alpha=(accepted_at_depth / attempts.clamp(min=1)).tolist()[:depth_limit],
            per_depth_attempts=attempts.tolist()[:depth_limit],
            per_depth_accepted=accepted_at_depth.tolist()[:depth_limit],
            survival=[float((num_accepted >= d).double().mean()) for d in range(max_accepted + 1)],
            accepted_histogram=torch.bincount(num_accepted, minlength=max_accepted + 1).tolist(),
            accepted_rank_histogram=torch.bincount(ranks).tolist() if ranks.numel() else [],
            mean_tree_nodes=float(num_nodes.double().mean()),
            tokens_per_s=generated_tokens / wall if wall > 0 else 0.0,
            time=time,
        )


def _reached_depths(tree: DraftTree, result: VerifyResult) -> Tensor:  # [B, N] bool
    """Column d-1: the walk stood at depth d-1 on a node that had at least one valid child."""
    batch, n = tree.tokens.shape
    valid = tree.node_valid()
    # path[b, j] = node the walk stood on at depth j (-1 = root), for j <= num_accepted
    path = torch.cat([torch.full((batch, 1), -1, device=tree.tokens.device), result.accepted_nodes], 1)
    on_path = torch.arange(n + 1, device=path.device) <= result.num_accepted[:, None]  # [B, N+1]
    has_child = (valid[:, None, :] & (tree.parents[:, None, :] == path[:, :, None])).any(-1)
    return (has_child & on_path)[:, :n]


def _sum_counts(counts: Sequence[Sequence[int]]) -> list[int]:
    """Element-wise sum of count lists of different lengths."""
    total = [0] * max((len(c) for c in counts), default=0)
    for part in counts:
        for n, count in enumerate(part):
            total[n] += count
    return total


def _pad(x: Tensor, width: int) -> Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[-1]))
