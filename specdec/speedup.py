"""The analytic speedup model, and the measured T(n) profile it needs.

Per step the target verifies n tree tokens in time T(n) and the drafter spends T_draft; the step
emits tau tokens on average, where plain decoding emits one per T(1). Hence

    S = tau * T(1) / (T(n) + T_draft).

tau follows from the per-depth conditional acceptance alpha_d of the tree's accepted path:
tau = 1 + sum_d prod_{j <= d} alpha_j (the 1 is the bonus/correction token). For a chain with one
constant alpha and k drafts this is (1 - alpha^(k+1)) / (1 - alpha).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.tree import SiblingMode, chain_tree


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


def profile_forward(target, sizes: Sequence[int], context_length: int = 128, repeats: int = 5) -> ForwardProfile:
    """Median time of ``target.forward_tree`` (an HFTarget) over a chain of n - 1 nodes (n rows
    with the root) after a prefill of ``context_length`` tokens, at batch 1. Each repeat is rolled
    back, so every forward sees the same context."""
    generator = torch.Generator().manual_seed(0)
    vocab = target.vocab_size
    prompt = torch.randint(0, vocab, (context_length,), generator=generator)
    target.prefill([prompt], ())
    seconds = []
    for n in sizes:
        tree = chain_tree(torch.randint(0, vocab, (1, n - 1), generator=generator), SiblingMode.DETERMINISTIC)
        times = []
        for _ in range(repeats + 1):  # the first run warms up allocations
            start = time.perf_counter()
            target.forward_tree(tree, ())
            times.append(time.perf_counter() - start)
            target.rewind(target.cached_lengths, target.roots)  # drop the tree rows again
        seconds.append(sorted(times[1:])[len(times[1:]) // 2])
    return ForwardProfile(list(sizes), seconds, context_length)
