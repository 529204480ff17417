"""Sampling parameters, and how logits become distributions.

Two transforms with one keep-set rule (temperature, then top-k, then top-p):

- :func:`probabilities` (float32, torch's softmax): what drafters draw from and report as q. A
  drafter's q only has to be the distribution its draft was drawn from, so any softmax will do,
  and torch's fused one is the cheapest on every device.
- :func:`target_probabilities` (float64): the target's p as every verifier sees it, for the
  acceptance tests and the bonus token alike. Its softmax is made of single IEEE operations
  (:func:`exp_weight`, :func:`pairwise_sum`), so that the Triton kernel can compute p for the rows
  its walk visits, from the logits, and get the reference's values bit for bit; torch's softmax and
  a kernel's exp differ in the last bit on some inputs. It agrees with :func:`probabilities` to a
  few float32 ulps.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch
import torch.nn.functional as F
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


# The target's softmax, as single float32 operations. Every constant is a float32 value, so any
# implementation reads the same number; the kernel is compiled without fp fusion, so each product
# is rounded before it is added, as here.
def _float32(value: float) -> float:  # the nearest float32 (no tensor: no device involved)
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # beyond float32's range
        return math.copysign(math.inf, value)


EXP_CUTOFF = -86.0  # exp_weight is 0 below: keeps 2**k and every product normal (no subnormals)
LOG2E = _float32(1 / math.log(2))
LN2_HI = 0.693145751953125  # ln 2 to 15 significant bits: k * LN2_HI is exact for |k| < 2**8
LN2_LO = _float32(math.log(2) - LN2_HI)
EXP_COEFFICIENTS = tuple(_float32(1 / math.factorial(n)) for n in range(7, -1, -1))  # Taylor, Horner order


def exp_weight(x: Tensor) -> Tensor:  # float32 [...] <= 0 (-inf allowed) -> float32 [...]
    """exp(x) within a few ulps, defined by its operations: k = floor(x log2 e + 1/2), r = x - k ln 2
    (Cody-Waite, two steps), a degree-7 Taylor polynomial in r by Horner's rule, times 2**k made from
    its bits; 0 for x < EXP_CUTOFF. Each step is one IEEE float32 operation, which every device and
    the Triton interpreter round alike (``verifiers.triton_arith.exp_weight`` is the same steps)."""
    # in place where it can be: on CPU a new tensor per step would cost more than the arithmetic
    clamped = x.clamp(min=EXP_CUTOFF)
    k = (clamped * LOG2E).add_(0.5).floor_()
    r = (clamped - k * LN2_HI).sub_(k * LN2_LO)
    poly = torch.full_like(r, EXP_COEFFICIENTS[0])
    for coefficient in EXP_COEFFICIENTS[1:]:
        poly.mul_(r).add_(coefficient)
    scale = k.to(torch.int32).add_(127).bitwise_left_shift_(23).view(torch.float32)  # 2**k, k in [-124, 0]
    return poly.mul_(scale).masked_fill_(x < EXP_CUTOFF, 0.0)


def inverse_temperature(params: SamplingParams) -> float:
    """1 / T rounded to float32: the target's logits are scaled by a multiplication (a division by
    a scalar is a multiplication by its reciprocal in torch's CUDA kernels, and not in others)."""
    return _float32(1 / params.temperature)


def keep_thresholds(logits: Tensor, params: SamplingParams) -> tuple[Tensor, Tensor]:
    """What top-k and top-p keep of the target's rows, as two thresholds per row ([..., V] ->
    [..., 1] float32 each): a token is kept iff its scaled logit is at least the first (the k-th
    largest; -inf when top-k is off) and its weight (:func:`target_weights`) at least the second (the
    least weight top-p keeps; 0 when off). Ties at either cut are all kept, as in
    :func:`probabilities`, whose fixed-point top-p rule this is, on the target's own weights. With
    neither filter on, the logits are not read."""
    shape = (*logits.shape[:-1], 1)
    least_logit = torch.full(shape, -math.inf, device=logits.device)
    least_weight = torch.zeros(shape, device=logits.device)
    vocab = logits.shape[-1]
    if not 0 < params.top_k < vocab and params.top_p == 1:
        return least_logit, least_weight
    scaled = logits.float() * inverse_temperature(params)
    if 0 < params.top_k < vocab:
        least_logit = scaled.topk(params.top_k, dim=-1).values[..., -1:]
    if params.top_p < 1:
        weights = target_weights(scaled, least_logit, least_weight)  # [..., V]
        total = pairwise_sum(weights.double())  # [..., 1]
        ranked = weights.sort(dim=-1, descending=True).values  # [..., V]
        mass = (ranked.double() / total * _FIXED_ONE).long().cumsum_(-1)  # [..., V] of the top 1, 2, ...
        below = (mass < math.ceil(params.top_p * _FIXED_ONE)).sum(-1, keepdim=True)  # [..., 1]
        least_weight = ranked.gather(-1, (below + 1).clamp(max=vocab) - 1)
    return least_logit, least_weight


def target_weights(scaled: Tensor, least_logit: Tensor, least_weight: Tensor) -> Tensor:  # -> float32 [..., V]
    """exp_weight(scaled - row max) where kept (:func:`keep_thresholds`), else 0; the row's max
    weighs exactly 1 and is always kept. ``scaled`` is float32 [..., V], the logits times
    :func:`inverse_temperature`; the thresholds are [..., 1]."""
    weights = exp_weight(scaled - scaled.amax(-1, keepdim=True))
    return weights.masked_fill_((scaled < least_logit) | (weights < least_weight), 0.0)


def target_probabilities(logits: Tensor, params: SamplingParams) -> Tensor:  # [..., V] -> [..., V] float64
    """The target's p as verifiers see it: each row's kept weights over their :func:`pairwise_sum`,
    in float64 (the sum is at least 1, the max's weight). Greedy is the one-hot argmax (first index
    on ties), as in :func:`probabilities`."""
    if params.greedy:
        return probabilities(logits, params).double()
    scaled = logits.float() * inverse_temperature(params)
    weights = target_weights(scaled, *keep_thresholds(logits, params)).double()
    return weights.div_(pairwise_sum(weights))


def pairwise_sum(x: Tensor) -> Tensor:  # [..., V] -> [..., 1]
    """Sum over the last dim in a fixed binary tree: the row zero-padded to the next power of two,
    then adjacent pairs added, level by level.

    ``x.sum`` adds in an order that depends on the device, the thread count and the vectorisation,
    and a kernel sums tile by tile: orders that can differ in the last bit and so flip a decision
    whose margin is that small. Each level here is an element-wise add, one IEEE rounding per
    element, so the result is defined by the tree alone, on any device. Cut into aligned
    power-of-two tiles, the tree is "the tree within each tile, then the tree over the tile sums
    (their count zero-padded to a power of two)", which ``verifiers.triton_tree`` reproduces.
    """
    width = x.shape[-1]
    x = F.pad(x, (0, (1 << (width - 1).bit_length()) - width))  # adding 0.0 changes no sum
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x
