import pytest

from specdec.speedup import ForwardProfile, chain_tau, expected_tau, predicted_speedup, profile_forward
from specdec.target import HFTarget
from tiny_models import tiny_model


def test_chain_tau_matches_the_closed_form():
    for alpha, k in [(0.7, 4), (0.3, 1), (0.9, 8)]:
        assert chain_tau(alpha, k) == pytest.approx((1 - alpha ** (k + 1)) / (1 - alpha))
    assert expected_tau([]) == 1.0 and expected_tau([1.0] * 5) == 6.0


def test_the_essay_example_predicts_about_two_x():
    """alpha 0.7, k 4, drafter cost 0.1 per draft token, verification as cheap as one token."""
    tau = chain_tau(0.7, 4)
    assert predicted_speedup(tau, 1.0, 1.0, 4 * 0.1) == pytest.approx(tau / 1.4)
    assert 1.9 < tau / 1.4 < 2.4


def test_profile_interpolates_and_ratios():
    profile = ForwardProfile([1, 4, 8], [0.1, 0.2, 0.4], 128)
    assert profile.time(2) == pytest.approx(0.1 + 0.1 / 3)
    assert profile.time(100) == 0.4 and profile.ratios()[8] == pytest.approx(4.0)


def test_profile_forward_keeps_the_context_fixed():
    target = HFTarget(tiny_model("llama"))
    profile = profile_forward(target, [1, 3, 5], context_length=16, repeats=2)
    assert profile.sizes == [1, 3, 5] and all(t > 0 for t in profile.seconds)
    assert int(target.cached_lengths[0]) == 15  # prefill caches all but the root, repeats roll back
