"""Counter-based per-request randomness, and the verifier's noise.

Why not one ``torch.Generator`` per request (the first design): a batch of 250k statistical-test
requests would need 250k generator calls per step, and a continuous batch would need a Python loop
per request. A counter-based generator gives the same guarantee vectorised: every number a request
draws is a pure function of (its seed, its own draw counter, the element index), so its output
never depends on its batch neighbours, and the same seed replays the same run on any device.

The mixer is Wellons' "lowbias32" 32-bit hash (bias ~0.17 of the ideal), chained over the counter
words; two 32-bit outputs give one 52-bit float64 uniform (``unit_interval``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF


def _mul32(x: Tensor, constant: int) -> Tensor:
    """(x * constant) mod 2**32 for x in [0, 2**32) without overflowing int64."""
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & _MASK32


def hash32(x: Tensor) -> Tensor:  # int64 in [0, 2**32) -> int64 in [0, 2**32)
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _combine(state: Tensor, word: Tensor) -> Tensor:
    return hash32(state ^ (word & _MASK32))


def uniforms_at(keys: Tensor, counters: Tensor, elements: Tensor) -> Tensor:
    """[B, E] float64 in the open interval (0, 1): element ``elements[e]`` of draw ``counters[b]`` of
    the request keyed ``keys[b]`` (keys, counters: [B] int64; elements: [E] int64). Integer
    operations, then ``unit_interval``, so ``verifiers.triton_tree`` computes the same numbers in
    its kernel."""
    state = _combine(keys[:, None], counters[:, None])
    state = _combine(state, counters[:, None] >> 32)
    # two independent 32-bit words per element: the second is keyed differently, not derived
    first = _combine(state, elements[None, :])
    second = _combine(hash32(state ^ 0x9E3779B9), elements[None, :])
    return unit_interval(first, second)


def unit_interval(first: Tensor, second: Tensor) -> Tensor:  # [...] int64 words in [0, 2**32) each -> [...] float64
    """52 random bits (26 of each word), centred in their cell: (m + 0.5) / 2**52, both steps exact,
    so the values run from 2**-53 to 1 - 2**-53, strictly inside (0, 1). With 53 bits the top cell's
    centre, 1 - 2**-54, is not a float64 and rounds to exactly 1.0."""
    mantissa = (first >> 6) * (1 << 26) + (second >> 6)
    return (mantissa.to(torch.float64) + 0.5) * (1.0 / (1 << 52))


class RequestRNG:
    """One independent stream per request; ``draw`` advances each listed request's counter by one."""

    def __init__(self, seeds: Tensor, stream: int = 0) -> None:  # seeds: [B] int64, any values
        """``stream`` separates consumers (drafter, verifier) so one's draws never shift the other's."""
        seeds = seeds.to(torch.int64)
        keys = _combine(hash32((seeds & _MASK32) ^ 0x2545F491), seeds >> 32)  # order-sensitive
        self._keys = _combine(keys, torch.full_like(seeds, stream))  # [B]
        self._counters = torch.zeros_like(seeds)  # [B] int64

    @property
    def batch_size(self) -> int:
        return self._keys.shape[0]

    @property
    def device(self) -> torch.device:
        return self._keys.device

    def select(self, rows: Tensor) -> RequestRNG:
        """A view on some requests (rows: [R] int64 indices); draws advance the parent's counters."""
        return _SelectedRNG(self, rows)

    def reserve(self, draws: int, rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The requests' keys and counters ([B] int64 each), then every counter advanced by ``draws``:
        the caller owns draws counter .. counter + draws - 1 and hashes them where it needs them."""
        keys = self._keys if rows is None else self._keys[rows]
        counters = (self._counters if rows is None else self._counters[rows]).clone()
        if rows is None:
            self._counters += draws
        else:
            self._counters[rows] += draws
        return keys, counters

    def uniform(self, *shape: int, rows: Tensor | None = None) -> Tensor:
        """[B, *shape] float64 in the open interval (0, 1), one draw (``uniforms_at``)."""
        numel = 1
        for s in shape:
            numel *= s
        keys, counters = self.reserve(1, rows)
        u = uniforms_at(keys, counters, torch.arange(numel, device=keys.device, dtype=torch.int64))
        return u.reshape(keys.shape[0], *shape)

    def exponential(self, *shape: int, rows: Tensor | None = None) -> Tensor:
        """[B, *shape] float64 Exp(1), strictly positive and finite, so argmax(p / E) is defined."""
        return -torch.log(self.uniform(*shape, rows=rows))

    def gumbel(self, *shape: int, rows: Tensor | None = None) -> Tensor:
        return -torch.log(self.exponential(*shape, rows=rows))


class _SelectedRNG(RequestRNG):
    def __init__(self, parent: RequestRNG, rows: Tensor) -> None:
        self._parent = parent
        self._rows = rows

    @property
    def batch_size(self) -> int:
        return self._rows.shape[0]

    @property
    def device(self) -> torch.device:
        return self._parent.device

    def reserve(self, draws: int, rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return self._parent.reserve(draws, self._rows if rows is None else self._rows[rows])


class VerifyNoise(ABC):
    """All randomness one verify call consumes, fixed before the verifier runs:

    - ``uniforms``: [B, N] float64 in (0, 1), one acceptance coin per node;
    - ``final``: [B] float64 in (0, 1), picks the final token from the residual
      (``verifiers.reference.draw_from``).

    Two forms. ``HashedNoise`` (what ``draw`` gives a run) holds only each request's key and
    counter: torch verifiers read the values, hashed on first read, while the Triton kernel hashes
    the coins of the nodes its walk visits in registers, so on a GPU the noise costs no launches.
    ``GivenNoise`` holds the values themselves (fixed-noise tests, the warm-up check)."""

    uniforms: Tensor  # [B, N] float64
    final: Tensor  # [B] float64

    @staticmethod
    def draw(rng: RequestRNG, max_nodes: int, *, greedy: bool = False) -> VerifyNoise:
        """Two draws per request: the nodes' coins, then the final token's uniform, which must not
        sit at element N of the first: N is the batch's widest tree, so a request's final token would
        depend on its neighbours' trees.
        ``greedy``: at T = 0 every verifier applies the point-mass rule to a one-hot target, whose
        verdict no coin in (0, 1) can change and whose final token is the one (tested for each), so
        fixed values stand in and nothing is hashed. The requests' counters do not advance."""
        if greedy:
            return GivenNoise(torch.full((rng.batch_size, max_nodes), 0.5, dtype=torch.float64, device=rng.device),
                              torch.full((rng.batch_size,), 0.5, dtype=torch.float64, device=rng.device))
        keys, counters = rng.reserve(2)
        return HashedNoise(keys, counters, max_nodes)

    @abstractmethod
    def to(self, device: torch.device | str) -> VerifyNoise:
        """The same noise on another device (the same values there)."""


@dataclass(frozen=True)
class GivenNoise(VerifyNoise):
    uniforms: Tensor  # [B, N] float64 in (0, 1)
    final: Tensor  # [B] float64 in (0, 1)

    def to(self, device: torch.device | str) -> GivenNoise:
        return GivenNoise(self.uniforms.to(device), self.final.to(device))


@dataclass(frozen=True)
class HashedNoise(VerifyNoise):
    """The coins are element i of draw ``counters``, the final uniform element 0 of draw
    ``counters + 1`` (``uniforms_at``)."""

    keys: Tensor  # [B] int64 in [0, 2**32), each request's verifier-stream key
    counters: Tensor  # [B] int64, the coins' draw
    max_nodes: int

    @cached_property
    def uniforms(self) -> Tensor:  # [B, N] float64
        elements = torch.arange(self.max_nodes, device=self.keys.device, dtype=torch.int64)
        return uniforms_at(self.keys, self.counters, elements)

    @cached_property
    def final(self) -> Tensor:  # [B] float64
        return uniforms_at(self.keys, self.counters + 1, torch.zeros(1, dtype=torch.int64, device=self.keys.device))[:, 0]

    def to(self, device: torch.device | str) -> HashedNoise:
        return HashedNoise(self.keys.to(device), self.counters.to(device), self.max_nodes)
