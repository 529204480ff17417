"""Sampling parameters and the one logits -> probabilities transform.

Exactness needs the drafter's q, the verifier's acceptance test and the bonus token to see the SAME
processed distribution, so every one of them calls :func:`probabilities`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


class SamplingError(ValueError):
    pass


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)):
            raise SamplingError(f"temperature must be a finite number >= 0; got {self.temperature!r}")
        if self.temperature < 0:
            raise SamplingError(f"temperature must be >= 0 (0 = greedy); got {self.temperature}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise SamplingError(f"top_k must be an integer >= 0 (0 = off); got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise SamplingError(f"top_p must lie in (0, 1] (1 = off); got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# top-p's fixed-point 1.0: the int64 sums keep room for a float32 softmax that sums a little over 1
_FIXED_ONE = 2**60


def probabilities(logits: Tensor, params: SamplingParams) -> Tensor:  # [..., V] -> [..., V] float32
    """Temperature, then top-k, then top-p (nucleus over the top-k survivors), renormalised.

    Top-k keeps every token whose logit is at least the k-th largest (ties at the k-th all kept).
    Top-p keeps a token iff the total probability of the tokens STRICTLY more likely than it is
    below top_p. So tokens tied at the cut-off are all kept or all dropped, the result does not
    depend on where tied tokens sit in the vocabulary, and the top-1 is always kept. That total is
    summed in fixed point (each probability rounded down to a multiple of 2**-60): integer sums are
    exact in any order, so the cut-off is the same on every call and device (a float cumsum on CUDA
    is not deterministic), and is off from the real-valued rule by at most V * 2**-60.

    Greedy returns the one-hot argmax (first index on ties), so greedy verification is the
    deterministic rule on a point-mass target and needs no code path of its own.
    """
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_probs = probs.sort(dim=-1, descending=True).values  # [..., V]
        mass = (sorted_probs * _FIXED_ONE).long().cumsum_(-1)  # [..., V] mass of the top 1, 2, ... tokens
        # the prefix of positions whose mass before them is below top_p (never empty) ends at the
        # value cut, which tied tokens share: below it, at least that whole prefix is more likely
        below = (mass < math.ceil(params.top_p * _FIXED_ONE)).sum(-1, keepdim=True)  # [..., 1]
        count = (below + 1).clamp(max=vocab)  # [..., 1]
        cut = sorted_probs.gather(-1, count - 1)  # [..., 1] the least probability kept
        probs = probs.masked_fill(probs < cut, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs
