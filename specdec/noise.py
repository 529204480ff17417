"""Counter-based per-request randomness, and the verifier's noise.

Why not one ``torch.Generator`` per request (the first design): a batch of 250k statistical-test
requests would need 250k generator calls per step, and a continuous batch would need a Python loop
per request. A counter-based generator gives the same guarantee vectorised: every number a request
draws is a pure function of (its seed, its own draw counter, the element index), so its output
never depends on its batch neighbours, and the same seed replays the same run on any device.

The mixer is Wellons' "lowbias32" 32-bit hash (bias ~0.17 of the ideal), chained over the counter
words; two 32-bit outputs give one 53-bit float64 uniform.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    def _bits(self, rows: Tensor | None, numel: int) -> tuple[Tensor, Tensor]:
        keys = self._keys if rows is None else self._keys[rows]
        counters = (self._counters if rows is None else self._counters[rows]).clone()
        if rows is None:
            self._counters += 1
        else:
            self._counters[rows] += 1
        element = torch.arange(numel, device=keys.device, dtype=torch.int64)
        state = _combine(keys[:, None], counters[:, None])
        state = _combine(state, counters[:, None] >> 32)
        # two independent 32-bit words per element: the second is keyed differently, not derived
        first = _combine(state, element[None, :])
        second = _combine(hash32(state ^ 0x9E3779B9), element[None, :])
        return first, second

    def uniform(self, *shape: int, rows: Tensor | None = None) -> Tensor:
        """[B, *shape] float64 in the open interval (0, 1): 53 random bits, centred in their cell."""
        numel = 1
        for s in shape:
            numel *= s
        first, second = self._bits(rows, numel)
        mantissa = (first >> 5) * (1 << 26) + (second >> 6)  # 27 + 26 = 53 bits
        u = (mantissa.to(torch.float64) + 0.5) * (1.0 / (1 << 53))
        return u.reshape(first.shape[0], *shape)

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

    def _bits(self, rows: Tensor | None, numel: int) -> tuple[Tensor, Tensor]:
        return self._parent._bits(self._rows if rows is None else self._rows[rows], numel)


@dataclass(frozen=True)
class VerifyNoise:
    """All randomness one verify call consumes, drawn outside the verifier (and any kernel)."""

    uniforms: Tensor  # [B, N] float64 in (0, 1), one acceptance coin per node
    final: Tensor  # [B] float64 in (0, 1), picks the final token from the residual (``verifiers.reference.draw_from``)

    @staticmethod
    def draw(rng: RequestRNG, max_nodes: int, *, greedy: bool = False) -> VerifyNoise:
        """Two draws per request: the nodes' coins, then the final token's uniform, which must not
        sit at element N of the first: N is the batch's widest tree, so a request's final token would
        depend on its neighbours' trees.
        ``greedy``: at T = 0 every verifier applies the point-mass rule to a one-hot target, whose
        verdict no coin in (0, 1) can change and whose final token is the one (tested for each), so
        fixed values stand in and nothing is hashed. The requests' counters do not advance."""
        if greedy:
            return VerifyNoise(torch.full((rng.batch_size, max_nodes), 0.5, dtype=torch.float64, device=rng.device),
                               torch.full((rng.batch_size,), 0.5, dtype=torch.float64, device=rng.device))
        return VerifyNoise(rng.uniform(max_nodes), rng.uniform(1)[:, 0])
