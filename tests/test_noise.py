"""Per-request counter-based randomness and the verifier's noise (specdec/noise.py)."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from specdec.noise import HashedNoise, RequestRNG, VerifyNoise, hash32, unit_interval

EULER_MASCHERONI = 0.5772156649015329


def correlation(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([x.flatten(), y.flatten()]))[0, 1])


# --- range and resolution --------------------------------------------------------------------


def test_uniforms_are_float64_in_the_open_unit_interval():
    u = RequestRNG(torch.arange(20)).uniform(10_000)
    assert u.dtype == torch.float64 and u.shape == (20, 10_000)
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    assert float(u.min()) < 1e-3 and float(u.max()) > 1 - 1e-3  # and they do cover it


def test_uniforms_have_more_than_32_bits_of_resolution():
    """A float32 or a single 32-bit word would put every value on the 2**-32 grid."""
    u = RequestRNG(torch.arange(4)).uniform(5_000)
    scaled = u * 2.0**32
    off_grid = (scaled != scaled.floor()).double().mean()
    assert float(off_grid) > 0.99
    scaled = u * 2.0**40
    assert float((scaled != scaled.floor()).double().mean()) > 0.99


def test_low_mantissa_bits_are_not_a_function_of_the_high_bits():
    """White-box check of the 52-bit claim against the construction's own hash."""
    u = RequestRNG(torch.arange(5)).uniform(400).flatten()
    mantissa = (u * 2.0**52 - 0.5).round().to(torch.int64)
    high26, low26 = mantissa >> 26, mantissa & ((1 << 26) - 1)
    candidates = (high26[:, None] << 6) | torch.arange(64)  # every possible `first` word
    predicted = hash32(candidates ^ 0x9E3779B9) >> 6
    predictable = (predicted == low26[:, None]).any(-1).double().mean()
    assert float(predictable) < 0.01  # ~64 / 2**26 by chance if the low bits were independent


def test_the_extreme_words_stay_strictly_inside_the_unit_interval():
    """The largest and smallest uniforms the construction can return, from its extreme words; the
    53-bit layout (27 bits of the first word) is the control: its largest value is exactly 1.0."""
    words = torch.tensor([0, (1 << 32) - 1])
    low, high = unit_interval(words, words).tolist()
    assert (low, high) == (2.0**-53, 1 - 2.0**-53)
    top = (words[1:] >> 5) * (1 << 26) + (words[1:] >> 6)
    assert ((top.to(torch.float64) + 0.5) * 2.0**-53).item() == 1.0


# --- independence from the batch and reproducibility -----------------------------------------


def draw_sequence(rng: RequestRNG) -> list[torch.Tensor]:
    """Several calls of different kinds and sizes, as a decode loop would make."""
    return [rng.uniform(7), rng.exponential(3), rng.gumbel(2, 3), rng.uniform(1), rng.uniform(50)]


@pytest.mark.parametrize("seed", [0, 12345, 2**40 + 7])
def test_same_seed_same_stream_whatever_the_batch(seed):
    alone = draw_sequence(RequestRNG(torch.tensor([seed])))
    others = torch.tensor([3, 1, 4, 1, 5, seed, 9, 2, 6])  # seed at index 5, duplicates elsewhere
    batched = draw_sequence(RequestRNG(others))
    for a, b in zip(alone, batched, strict=True):
        assert torch.equal(a[0], b[5])
    again = draw_sequence(RequestRNG(torch.tensor([seed])))
    assert all(torch.equal(a, b) for a, b in zip(alone, again, strict=True))


def test_successive_draws_differ():
    rng = RequestRNG(torch.tensor([0, 1]))
    first, second = rng.uniform(100), rng.uniform(100)
    assert not torch.isclose(first, second).any()


def test_different_seeds_give_different_streams():
    u = RequestRNG(torch.arange(1000)).uniform(4)
    assert u[:, 0].unique().numel() == 1000
    assert not torch.isclose(u[0], u[1]).any()


def test_different_stream_values_give_different_streams():
    seeds = torch.arange(50)
    draws = [RequestRNG(seeds, stream=s).uniform(20) for s in (0, 1, 2, 7)]
    for i in range(len(draws)):
        for j in range(i):
            # exact coincidences only: with 52-bit draws even one is a correlation, while
            # isclose(rtol=1e-5) over 1000 pairs would fire by chance a few % of the time
            assert not (draws[i] == draws[j]).any()
    assert torch.equal(draws[0], RequestRNG(seeds).uniform(20))  # stream 0 is the default


@pytest.mark.parametrize("a, b", [(0, -1), (1, 2**32), (0, 2**32 + 1), (5, 5 * 2**32)])
def test_seeds_differing_in_the_high_word_give_different_streams(a, b):
    u = RequestRNG(torch.tensor([a, b])).uniform(8)
    assert not torch.equal(u[0], u[1])


# --- select ----------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["select", "rows"])
def test_selected_draws_equal_the_parents_rows(how):
    seeds = torch.tensor([10, 11, 12, 13, 14, 15])
    rows = torch.tensor([4, 1, 3])
    rng = RequestRNG(seeds)
    expected = RequestRNG(seeds).uniform(6)[rows]
    drawn = rng.select(rows).uniform(6) if how == "select" else rng.uniform(6, rows=rows)
    assert torch.equal(drawn, expected)


def test_select_draw_after_a_full_draw_is_fresh():
    rng = RequestRNG(torch.tensor([10, 11, 12]))
    full = rng.uniform(8)
    selected = rng.select(torch.tensor([1])).uniform(8)
    assert not torch.isclose(full[1], selected[0]).any()


def test_select_advances_only_the_selected_rows():
    seeds = torch.tensor([10, 11, 12, 13, 14, 15])
    rows = torch.tensor([4, 1, 3])
    rng = RequestRNG(seeds)
    reference = RequestRNG(seeds)
    first, second = reference.uniform(6), reference.uniform(6)

    view = rng.select(rows)
    assert view.batch_size == 3
    assert view.uniform(6).shape == (3, 6)
    after = rng.uniform(6)
    selected = torch.zeros(6, dtype=torch.bool)
    selected[rows] = True
    assert torch.equal(after[selected], second[selected])
    assert torch.equal(after[~selected], first[~selected])


def test_nested_select_equals_flat_select():
    seeds = torch.arange(100, 108)
    nested = RequestRNG(seeds).select(torch.tensor([7, 6, 5, 0])).select(torch.tensor([1, 3]))
    flat = RequestRNG(seeds).select(torch.tensor([6, 0]))
    assert nested.batch_size == 2
    for _ in range(3):
        assert torch.equal(nested.exponential(5), flat.exponential(5))


# --- statistical sanity ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def many_uniforms() -> torch.Tensor:
    return RequestRNG(torch.arange(200)).uniform(1000)  # [200, 1000] = 200k values


def test_uniforms_pass_kolmogorov_smirnov(many_uniforms):
    result = stats.kstest(many_uniforms.flatten().numpy(), "uniform")
    assert result.pvalue > 1e-4, result


def test_uniform_bins_pass_chi_square(many_uniforms):
    """A finer look than KS at the bulk: 1000 equal bins."""
    counts = torch.bincount((many_uniforms.flatten() * 1000).long(), minlength=1000)
    assert stats.chisquare(counts.numpy()).pvalue > 1e-4


def test_no_correlation_between_consecutive_elements(many_uniforms):
    r = correlation(many_uniforms[:, :-1], many_uniforms[:, 1:])
    assert abs(r) < 5 / math.sqrt(many_uniforms[:, 1:].numel())


def test_no_correlation_between_consecutive_calls():
    rng = RequestRNG(torch.arange(400))
    first, second = rng.uniform(500), rng.uniform(500)
    assert abs(correlation(first, second)) < 5 / math.sqrt(first.numel())


def test_adjacent_seeds_are_independent():
    """Requests get seeds 0, 1, 2, ...: neighbours must not be correlated, even in low bits."""
    u = RequestRNG(torch.arange(100_001)).uniform(2)  # [seeds, 2]
    n = u.shape[0] - 1
    assert abs(correlation(u[:-1, 0], u[1:, 0])) < 5 / math.sqrt(n)
    assert abs(correlation(u[:-1, 1], u[1:, 1])) < 5 / math.sqrt(n)
    assert abs(correlation(u[:, 0], u[:, 1])) < 5 / math.sqrt(n)
    # joint 10x10 histogram of neighbours' first draws: catches non-linear dependence too
    cells = (u[:-1, 0] * 10).long() * 10 + (u[1:, 0] * 10).long()
    assert stats.chisquare(torch.bincount(cells, minlength=100).numpy()).pvalue > 1e-4


def test_exponential_mean_and_variance():
    e = RequestRNG(torch.arange(100), stream=3).exponential(2000).flatten()  # 200k
    assert e.dtype == torch.float64 and (e > 0).all() and torch.isfinite(e).all()
    tolerance = 5 / math.sqrt(e.numel())
    assert abs(float(e.mean()) - 1.0) < tolerance
    assert abs(float(e.var()) - 1.0) < 4 * tolerance  # var of the sample variance of Exp(1) is 8/n
    assert stats.kstest(e.numpy(), "expon").pvalue > 1e-4


def test_gumbel_mean_is_euler_mascheroni():
    g = RequestRNG(torch.arange(100), stream=4).gumbel(2000).flatten()  # 200k
    assert g.dtype == torch.float64 and torch.isfinite(g).all()
    assert abs(float(g.mean()) - EULER_MASCHERONI) < 5 * math.sqrt(math.pi**2 / 6 / g.numel())
    assert abs(float(g.var()) - math.pi**2 / 6) < 0.05
    assert stats.kstest(g.numpy(), "gumbel_r").pvalue > 1e-4


# --- VerifyNoise -----------------------------------------------------------------------------


@pytest.mark.parametrize("batch, max_nodes", [(1, 1), (3, 7), (5, 16)])
def test_verify_noise_shapes_and_dtypes(batch, max_nodes):
    rng = RequestRNG(torch.arange(batch))
    noise = VerifyNoise.draw(rng, max_nodes)
    assert noise.uniforms.shape == (batch, max_nodes) and noise.uniforms.dtype == torch.float64
    assert noise.final.shape == (batch,) and noise.final.dtype == torch.float64
    for u in (noise.uniforms, noise.final):
        assert ((u > 0) & (u < 1)).all()
    again = VerifyNoise.draw(rng, max_nodes)
    assert not torch.equal(again.uniforms, noise.uniforms) and not torch.equal(again.final, noise.final)


def test_verify_noise_is_per_request():
    """A request's coins do not depend on its neighbours (the batch-composition guarantee)."""
    alone = VerifyNoise.draw(RequestRNG(torch.tensor([42])), 6)
    batched = VerifyNoise.draw(RequestRNG(torch.tensor([7, 42, 8])), 6)
    assert torch.equal(alone.uniforms[0], batched.uniforms[1])
    assert torch.equal(alone.final[0], batched.final[1])


def test_verify_noise_for_an_empty_tree():
    noise = VerifyNoise.draw(RequestRNG(torch.arange(3)), 0)
    assert noise.uniforms.shape == (3, 0) and noise.final.shape == (3,)


def test_greedy_verify_noise_is_constant_and_hashes_nothing():
    rng = RequestRNG(torch.arange(2))
    first = VerifyNoise.draw(rng, 4, greedy=True)
    assert (first.uniforms == 0.5).all() and (first.final == 0.5).all()
    assert torch.equal(rng.uniform(3), RequestRNG(torch.arange(2)).uniform(3))  # no counter advanced


def test_the_final_uniform_does_not_depend_on_the_batchs_widest_tree():
    """N is the widest tree in the batch: a request's final token must not move with it."""
    narrow = VerifyNoise.draw(RequestRNG(torch.tensor([42])), 3)
    wide = VerifyNoise.draw(RequestRNG(torch.tensor([42])), 9)
    assert torch.equal(narrow.final, wide.final) and torch.equal(narrow.uniforms, wide.uniforms[:, :3])


def test_drawn_noise_is_two_draws_of_the_stream_hashed_where_read():
    """HashedNoise holds keys and counters only; its values are the stream's next two draws (the
    kernel hashes them itself from the same keys and counters), and the stream moves past both."""
    seeds = torch.tensor([3, 99, 2**33])
    rng, twin = RequestRNG(seeds), RequestRNG(seeds)
    rng.uniform(5)
    twin.uniform(5)
    noise = VerifyNoise.draw(rng.select(torch.tensor([2, 0])), 4)
    assert isinstance(noise, HashedNoise) and "uniforms" not in vars(noise)  # nothing hashed yet
    coins, final = twin.uniform(4, rows=torch.tensor([2, 0])), twin.uniform(1, rows=torch.tensor([2, 0]))[:, 0]
    assert torch.equal(noise.uniforms, coins) and torch.equal(noise.final, final)
    assert torch.equal(rng.uniform(3), twin.uniform(3))
    moved = noise.to("cpu")
    assert torch.equal(moved.uniforms, coins) and torch.equal(moved.final, final)
