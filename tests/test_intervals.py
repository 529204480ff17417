"""The paired bootstrap behind every reported interval (specdec/intervals.py): known answers, a
case that must come out wide, pairing, coverage."""

from __future__ import annotations

import math

import numpy as np
import pytest

from specdec.intervals import Interval, rate_ratio_interval, ratio_interval


def test_the_interval_of_a_mean_matches_the_normal_theory_interval():
    rng = np.random.default_rng(1)
    values = rng.normal(2.0, 0.5, size=400)
    interval = ratio_interval(values, np.ones_like(values))
    half = 1.96 * values.std(ddof=1) / math.sqrt(len(values))
    assert interval.estimate == pytest.approx(values.mean())
    assert interval.low == pytest.approx(values.mean() - half, rel=0.01)
    assert interval.high == pytest.approx(values.mean() + half, rel=0.01)
    assert interval.units == 400 and not interval.is_wide()


def test_units_with_one_ratio_give_a_point_interval():
    interval = ratio_interval([3.0, 6.0, 1.5, 9.0], [2.0, 4.0, 1.0, 6.0])
    assert (interval.low, interval.estimate, interval.high) == (1.5, 1.5, 1.5)
    assert not interval.excludes(1.5) and interval.excludes(1.4)


def test_a_few_scattered_units_report_a_wide_interval():
    # three prompts, one twice as fast as the baseline, one as fast, one half as fast
    interval = rate_ratio_interval([64, 64, 64], [1.0, 2.0, 4.0], [64, 64, 64], [2.0, 2.0, 2.0])
    assert interval.is_wide() and interval.relative_half_width > 0.3
    assert not interval.excludes(1.0)


def test_pairing_removes_what_the_sides_share():
    # prompts differ tenfold in cost; the drafter is 1.25x faster on each, to within 1% timing noise
    rng = np.random.default_rng(2)
    baseline = rng.uniform(1.0, 10.0, size=12)
    drafter = baseline / 1.25 * rng.normal(1.0, 0.01, size=12)
    tokens = np.full(12, 64.0)
    interval = rate_ratio_interval(tokens, drafter, tokens, baseline)
    assert interval.estimate == pytest.approx(1.25, rel=0.01)
    assert interval.relative_half_width < 0.02 and interval.excludes(1.0)


def test_the_interval_is_seeded_and_needs_two_units():
    a = rate_ratio_interval([10, 12, 9, 20], [1.0, 1.3, 0.8, 2.0], [10, 12, 9, 20], [1.2, 1.2, 1.0, 2.2])
    assert a == rate_ratio_interval([10, 12, 9, 20], [1.0, 1.3, 0.8, 2.0], [10, 12, 9, 20], [1.2, 1.2, 1.0, 2.2])
    assert ratio_interval([5.0], [2.0]) is None


@pytest.mark.statistical
def test_about_95_in_100_intervals_cover_the_true_ratio():
    # a ratio of sums over 20 units: unit costs uniform, per-unit ratios lognormal (E = exp(s^2 / 2))
    rng = np.random.default_rng(3)
    sigma, units, trials = 0.3, 20, 300
    truth = math.exp(sigma**2 / 2)
    covered = 0
    for trial in range(trials):
        cost = rng.uniform(1.0, 3.0, size=units)
        interval = ratio_interval(cost * rng.lognormal(0.0, sigma, size=units), cost, seed=trial)
        covered += not interval.excludes(truth)
    assert 0.90 <= covered / trials <= 0.985


def test_relative_half_width_takes_the_longer_side():
    assert Interval(2.0, 1.9, 2.3, units=5).relative_half_width == pytest.approx(0.15)
    assert Interval(2.0, 1.9, 2.3, units=5).is_wide() and not Interval(2.0, 1.9, 2.1, units=5).is_wide()
