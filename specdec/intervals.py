"""Confidence intervals for what a run reports: a paired bootstrap over units.

Every figure a run reports is a ratio of totals: tau = tokens emitted / request-steps, a side's
tokens/s = tokens / seconds, a speedup = one side's tokens/s over another's. A *unit* (one prompt,
or a group of prompts decoded together) adds to every total of every side at once, so the units are
resampled with all their columns together: a prompt that is slow for the baseline is slow for the
drafter too, and a speedup's interval sees only what differs between the sides (a paired bootstrap).
Repeated passes over the same prompts add to a unit's totals and are resampled with it (a cluster
bootstrap): they shrink the timing noise inside a unit, never the spread between prompts.

Intervals are BCa (bias-corrected and accelerated) percentiles of 9999 resamples, through
scipy.stats.bootstrap, which correct the skew of a ratio of sums over a few units. The resampling
is seeded, so the same measurements give the same interval.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

CONFIDENCE = 0.95
RESAMPLES = 9999
WIDE = 0.10  # an interval reaching further than this share from its estimate cannot tell effects of that size
METHOD = f"BCa bootstrap over units, {RESAMPLES} resamples"


@dataclass(frozen=True)
class Interval:
    estimate: float  # the statistic over all units
    low: float
    high: float
    units: int  # how many units were resampled
    confidence: float = CONFIDENCE

    @property
    def relative_half_width(self) -> float:
        """How far the interval reaches from the estimate, as a share of it (its longer side)."""
        return max(self.high - self.estimate, self.estimate - self.low) / abs(self.estimate) if self.estimate else float("inf")

    def excludes(self, value: float) -> bool:
        return not self.low <= value <= self.high

    def is_wide(self, share: float = WIDE) -> bool:
        """Wider than +-share of the estimate: too few units (prompts, passes, tokens) to tell an effect that size."""
        return self.relative_half_width > share

    def as_list(self) -> list[float]:
        return [self.low, self.high]


def ratio_of_totals(
    columns: np.ndarray,  # [U, K] float: each unit's totals of K quantities
    statistic: Callable[[np.ndarray], np.ndarray],  # totals [..., K] -> [...]
    confidence: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> Interval | None:
    """The interval of ``statistic`` of the column totals, resampling units; None under 2 units."""
    from scipy import stats  # scipy.stats: ~1 s to import, for an interval alone

    columns = np.asarray(columns, dtype=np.float64)
    estimate = float(statistic(columns.sum(0)))
    if len(columns) < 2:
        return None

    def resampled(indices: np.ndarray, axis: int = -1) -> np.ndarray:
        return statistic(columns[np.moveaxis(indices, axis, -1)].sum(-2))

    with warnings.catch_warnings():
        # BCa is undefined when the leave-one-out statistics do not vary (every unit has the same ratio,
        # so every resample gives the estimate): scipy warns and returns NaN; percentiles then hold
        warnings.simplefilter("ignore")
        result = stats.bootstrap(
            (np.arange(len(columns)),), resampled, vectorized=True, method="BCa", n_resamples=resamples,
            confidence_level=confidence, rng=np.random.default_rng(seed),
        )
        low, high = result.confidence_interval
        if not (np.isfinite(low) and np.isfinite(high)):
            result = stats.bootstrap(
                (np.arange(len(columns)),), resampled, vectorized=True, method="percentile", n_resamples=resamples,
                confidence_level=confidence, rng=np.random.default_rng(seed),
            )
            low, high = result.confidence_interval
    return Interval(estimate, float(low), float(high), len(columns), confidence)


def _quotient(totals: np.ndarray) -> np.ndarray:
    return totals[..., 0] / totals[..., 1]


def _quotient_of_rates(totals: np.ndarray) -> np.ndarray:
    return (totals[..., 0] / totals[..., 1]) / (totals[..., 2] / totals[..., 3])


def ratio_interval(numerators, denominators, seed: int = 0) -> Interval | None:
    """sum(numerators) / sum(denominators) over units (tau: tokens emitted / request-steps), with its interval."""
    return ratio_of_totals(np.stack([numerators, denominators], axis=1), _quotient, seed=seed)


def rate_ratio_interval(tokens, seconds, reference_tokens, reference_seconds, seed: int = 0) -> Interval | None:
    """(sum(tokens) / sum(seconds)) / (sum(reference_tokens) / sum(reference_seconds)): one side's
    tokens/s over another's on the same units (a speedup), with its paired interval."""
    columns = np.stack([tokens, seconds, reference_tokens, reference_seconds], axis=1)
    return ratio_of_totals(columns, _quotient_of_rates, seed=seed)
