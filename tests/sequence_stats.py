"""Sequence-level exactness: run the whole decode loop many times and compare the histogram of the
first L generated tokens with the exact autoregressive distribution (chi-square, plus TV)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from scipy.optimize import brentq
from scipy.stats import chi2, chisquare, ncx2

from specdec.decode import SpecDecoder
from specdec.sampling import SamplingParams

ALPHA = 1e-4  # an exact rule must pass at this level; fixed seeds make each verdict reproducible
NEGATIVE_P = 1e-6  # a known-wrong rule must be rejected at least this strongly
POWER = 0.9


@lru_cache(maxsize=None)
def required_samples(num_bins: int, tv: float, alpha: float = ALPHA, power: float = POWER) -> int:
    """Samples for the chi-square test to detect total variation >= tv with the given power.

    The noncentrality of a distribution at TV distance d is N * sum (p_i - q_i)^2 / p_i, which by
    Cauchy-Schwarz is at least N * 4 d^2, so N >= lambda / (4 d^2) suffices.
    """
    df = num_bins - 1
    critical = chi2.isf(alpha, df)
    lam = brentq(lambda x: ncx2.sf(critical, df, x) - power, 1e-6, 1e6)
    return math.ceil(lam / (4 * tv * tv))


@dataclass(frozen=True)
class Verdict:
    p_value: float
    tv: float
    samples: int
    impossible: int  # samples that landed on a sequence of probability 0

    def __str__(self) -> str:
        return f"p={self.p_value:.3g} TV={self.tv:.4f} N={self.samples} impossible={self.impossible}"


def sequence_verdict(
    decoder: SpecDecoder,
    exact: torch.Tensor,  # [V ** L] float64, exact distribution of the first L tokens
    prompt: list[int] | torch.Tensor,
    length: int,
    vocab_size: int,
    sampling: SamplingParams,
    samples: int,
    seed: int = 0,
) -> Verdict:
    generation = decoder.generate([prompt] * samples, length, sampling, seed=seed)
    # the statistics run on the host, whatever device decoded
    outputs = torch.tensor(generation.outputs, device="cpu")  # [S, L]
    assert outputs.shape == (samples, length), "every request must produce exactly L tokens"
    weights = vocab_size ** torch.arange(length - 1, -1, -1, device="cpu")  # [L]
    counts = torch.bincount((outputs * weights).sum(1), minlength=vocab_size**length).double().numpy()
    expected = exact.cpu().numpy()
    possible = expected > 0
    # bins with tiny expectation break the chi-square approximation: pool them into one bin
    small = possible & (expected * samples < 5)
    observed_bins = np.append(counts[possible & ~small], counts[small].sum())
    expected_bins = np.append(expected[possible & ~small], expected[small].sum()) * samples
    if expected_bins[-1] == 0:
        observed_bins, expected_bins = observed_bins[:-1], expected_bins[:-1]
    expected_bins *= observed_bins.sum() / expected_bins.sum()
    p_value = chisquare(observed_bins, expected_bins).pvalue if len(expected_bins) > 1 else 1.0
    tv = 0.5 * float(np.abs(counts / samples - expected).sum())
    return Verdict(float(p_value), tv, samples, int(counts[~possible].sum()))
