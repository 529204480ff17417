"""SamplingParams validation and the one logits -> probabilities transform (specdec/sampling.py)."""

from __future__ import annotations

import math

import pytest
import torch

from specdec.sampling import SamplingError, SamplingParams, probabilities


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().float()


# --- SamplingParams --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.1}, r"temperature must be >= 0"),
        ({"temperature": -1}, r"temperature must be >= 0"),
        ({"temperature": math.nan}, r"temperature must be a finite number"),
        ({"temperature": math.inf}, r"temperature must be a finite number"),
        ({"temperature": -math.inf}, r"temperature must be a finite number"),
        ({"temperature": "1.0"}, r"temperature must be a finite number.*'1.0'"),
        ({"temperature": None}, r"temperature"),
        ({"top_k": -1}, r"top_k must be an integer >= 0"),
        ({"top_k": 2.0}, r"top_k must be an integer.*2.0"),
        ({"top_k": 1.5}, r"top_k must be an integer"),
        ({"top_k": True}, r"top_k must be an integer.*True"),
        ({"top_k": False}, r"top_k must be an integer"),
        ({"top_k": "3"}, r"top_k must be an integer"),
        ({"top_p": 0}, r"top_p must lie in \(0, 1\]"),
        ({"top_p": 0.0}, r"top_p must lie in \(0, 1\]"),
        ({"top_p": 1.0000001}, r"top_p must lie in \(0, 1\]"),
        ({"top_p": 2}, r"top_p must lie in \(0, 1\]"),
        ({"top_p": -0.5}, r"top_p must lie in \(0, 1\]"),
        ({"top_p": math.nan}, r"top_p must lie in \(0, 1\]"),
        ({"top_p": "0.9"}, r"top_p must lie in \(0, 1\]"),
    ],
)
def test_invalid_sampling_params_raise_clear_errors(kwargs, message):
    with pytest.raises(SamplingError, match=message):
        SamplingParams(**kwargs)


def test_sampling_error_is_a_value_error():
    """Callers (Hydra configs, CLIs) may catch ValueError generically."""
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"temperature": 0},
        {"temperature": 1},
        {"temperature": 0.7, "top_k": 0, "top_p": 1},
        {"top_k": 50},
        {"top_p": 1e-9},
        {"top_p": 1},
    ],
)
def test_valid_sampling_params(kwargs):
    SamplingParams(**kwargs)


def test_defaults_are_greedy_and_filters_off():
    params = SamplingParams()
    assert params.greedy and params.top_k == 0 and params.top_p == 1.0
    assert not SamplingParams(temperature=1e-6).greedy


def test_sampling_params_are_frozen():
    with pytest.raises(AttributeError):
        SamplingParams().temperature = 1.0


# --- greedy ----------------------------------------------------------------------------------


def test_greedy_is_one_hot_argmax():
    logits = torch.randn(4, 6, 11, generator=torch.Generator().manual_seed(0))
    probs = probabilities(logits, SamplingParams(temperature=0))
    assert probs.dtype == torch.float32 and probs.shape == logits.shape
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 11).float())


def test_greedy_takes_the_first_index_on_ties():
    logits = torch.tensor([[1.0, 3.0, 0.0, 3.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -1.0, -3.0]])
    probs = probabilities(logits, SamplingParams(temperature=0))
    assert probs.argmax(-1).tolist() == [1, 0, 0]
    assert probs.sum(-1).tolist() == [1.0, 1.0, 1.0]


def test_greedy_ignores_top_k_and_top_p():
    logits = torch.tensor([0.0, 2.0, 1.0])
    for params in (SamplingParams(0, top_k=2), SamplingParams(0, top_p=0.1)):
        assert probabilities(logits, params).tolist() == [0.0, 1.0, 0.0]


# --- temperature -----------------------------------------------------------------------------


def test_temperature_one_is_softmax():
    logits = torch.randn(3, 17, generator=torch.Generator().manual_seed(1)) * 3
    probs = probabilities(logits, SamplingParams(temperature=1.0))
    torch.testing.assert_close(probs, torch.softmax(logits.double(), -1).float())


@pytest.mark.parametrize("temperature", [0.25, 0.7, 1.5, 4.0])
def test_temperature_divides_the_logits(temperature):
    logits = torch.randn(3, 17, generator=torch.Generator().manual_seed(2)) * 3
    probs = probabilities(logits, SamplingParams(temperature=temperature))
    expected = torch.softmax(logits.double() / temperature, -1).float()
    torch.testing.assert_close(probs, expected)
    assert not torch.allclose(probs, torch.softmax(logits, -1), atol=1e-3)


def test_lower_temperature_sharpens():
    logits = torch.tensor([2.0, 1.0, 0.0])
    top = [float(probabilities(logits, SamplingParams(t))[0]) for t in (2.0, 1.0, 0.5, 0.1)]
    assert top == sorted(top) and top[-1] > 0.99


# --- top-k -----------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 5, 9])
def test_top_k_keeps_exactly_k_distinct_values(k):
    logits = torch.randn(5, 4, 10, generator=torch.Generator().manual_seed(k))
    probs = probabilities(logits, SamplingParams(temperature=0.8, top_k=k))
    kept = probs > 0
    assert (kept.sum(-1) == k).all()
    assert torch.equal(kept, logits >= logits.topk(k, -1).values[..., -1:])
    expected = torch.softmax((logits / 0.8).masked_fill(~kept, -math.inf).double(), -1).float()
    torch.testing.assert_close(probs, expected)


def test_top_k_keeps_every_token_tied_with_the_kth_value():
    """Ties at the k-th logit are all kept (threshold rule), so more than k tokens may survive."""
    logits = torch.tensor([3.0, 2.0, 0.5, 2.0, 1.0, 2.0])
    probs = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (probs > 0).tolist() == [True, True, False, True, False, True]
    torch.testing.assert_close(probs[[1, 3, 5]], probs[1].expand(3))


@pytest.mark.parametrize("k", [0, 6, 100])
def test_top_k_zero_or_at_least_vocab_is_off(k):
    logits = torch.randn(2, 6, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(
        probabilities(logits, SamplingParams(temperature=1.0, top_k=k)), torch.softmax(logits, -1)
    )


# --- top-p -----------------------------------------------------------------------------------

NUCLEUS = [
    0.05,
    0.5,
    0.1,
    0.2,
    0.15,
]  # sorted: 0.5, 0.2, 0.15, 0.1, 0.05; cumulative 0.5, 0.7, 0.85, 0.95


@pytest.mark.parametrize(
    "top_p, kept",
    [
        (1e-6, [1]),
        (0.3, [1]),
        (0.49, [1]),
        (0.51, [1, 3]),
        (0.69, [1, 3]),
        (0.71, [1, 3, 4]),
        (0.84, [1, 3, 4]),
        (0.86, [1, 2, 3, 4]),
        (0.96, [0, 1, 2, 3, 4]),
        (1.0, [0, 1, 2, 3, 4]),
    ],
)
def test_top_p_keeps_the_smallest_prefix_reaching_top_p(top_p, kept):
    probs = probabilities(logits_of(NUCLEUS), SamplingParams(temperature=1.0, top_p=top_p))
    assert (probs > 0).nonzero().flatten().tolist() == kept
    expected = torch.zeros(5, dtype=torch.float64)
    expected[kept] = torch.tensor(NUCLEUS, dtype=torch.float64)[kept]
    torch.testing.assert_close(probs, (expected / expected.sum()).float())


def test_top_p_always_keeps_the_top_token_even_when_it_alone_is_tiny():
    logits = torch.zeros(1000)
    logits[417] = 1e-3  # the top-1 has mass ~0.001
    probs = probabilities(logits, SamplingParams(temperature=1.0, top_p=1e-4))
    assert (probs > 0).nonzero().flatten().tolist() == [417]
    assert float(probs[417]) == 1.0


def test_top_p_per_row_on_a_batch():
    rows = [NUCLEUS, NUCLEUS[::-1], [0.9, 0.04, 0.03, 0.02, 0.01]]
    probs = probabilities(torch.stack([logits_of(r) for r in rows]), SamplingParams(1.0, top_p=0.6))
    assert (probs > 0).sum(-1).tolist() == [2, 2, 1]


def test_top_k_then_top_p_renormalises_in_between():
    """top-p sees the top-k survivors renormalised: [.4,.3,.2,.1], k=2 -> [4/7, 3/7], p=.5 -> top-1.

    Applying top-p to the unfiltered distribution first would keep two tokens (0.4 < 0.5).
    """
    logits = logits_of([0.1, 0.4, 0.2, 0.3])
    both = probabilities(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.5))
    assert both.tolist() == [0.0, 1.0, 0.0, 0.0]
    only_p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert (only_p > 0).tolist() == [False, True, False, True]


def test_temperature_applies_before_top_p():
    """At T=0.5 the top token's mass 0.4 -> 16/30 > 0.5, so the nucleus shrinks to one token."""
    logits = logits_of([0.1, 0.4, 0.2, 0.3])
    assert (probabilities(logits, SamplingParams(1.0, top_p=0.5)) > 0).sum() == 2
    assert (probabilities(logits, SamplingParams(0.5, top_p=0.5)) > 0).sum() == 1


# --- general properties ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(0.0),
        SamplingParams(1.0),
        SamplingParams(0.3),
        SamplingParams(1.7, top_k=3),
        SamplingParams(1.0, top_p=0.8),
        SamplingParams(0.6, top_k=10, top_p=0.5),
    ],
    ids=str,
)
def test_rows_sum_to_one_on_batched_input(params):
    logits = torch.randn(3, 5, 33, generator=torch.Generator().manual_seed(4)) * 4
    probs = probabilities(logits, params)
    assert probs.shape == (3, 5, 33) and probs.dtype == torch.float32
    assert (probs >= 0).all() and torch.isfinite(probs).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, 5))
    # each row is processed on its own: same as the row alone
    torch.testing.assert_close(probs[2, 4], probabilities(logits[2, 4], params))


@pytest.mark.parametrize(
    "params", [SamplingParams(0.0), SamplingParams(0.9, top_k=5, top_p=0.9)], ids=str
)
def test_bf16_logits_give_float32_probabilities(params):
    logits = (torch.randn(2, 3, 40, generator=torch.Generator().manual_seed(5)) * 3).bfloat16()
    probs = probabilities(logits, params)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, probabilities(logits.float(), params))
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 3))


def test_input_logits_are_not_modified():
    logits = torch.randn(2, 9, generator=torch.Generator().manual_seed(6))
    before = logits.clone()
    probabilities(logits, SamplingParams(0.5, top_k=3, top_p=0.7))
    assert torch.equal(logits, before)


def test_masked_logits_get_zero_probability():
    logits = torch.tensor([1.0, -math.inf, 0.5, -math.inf])
    probs = probabilities(logits, SamplingParams(1.0, top_k=3, top_p=0.99))
    assert probs[1] == 0 and probs[3] == 0
    torch.testing.assert_close(probs.sum(), torch.tensor(1.0))


# --- top-p ties ------------------------------------------------------------------------------


def nucleus_by_definition(probs: list[float], top_p: float) -> list[bool]:
    """The documented rule, token by token: keep a token iff the total probability of the tokens
    strictly more likely than it is below top_p."""
    return [math.fsum(q for q in probs if q > p) < top_p for p in probs]


@pytest.mark.parametrize(
    "row, top_p, kept",
    [
        ([0.4, 0.2, 0.2, 0.2], 0.5, [0, 1, 2, 3]),  # mass above the 0.2s is 0.4 < 0.5: all three stay
        ([0.1, 0.3, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1], 0.35, [0, 1, 2, 3, 4, 5, 6, 7, 8]),
        ([0.2, 0.35, 0.2, 0.05, 0.2], 0.4, [0, 1, 2, 4]),  # the cut-off falls inside the 0.2 group
    ],
)
def test_top_p_keeps_every_token_tied_at_the_cut_off(row, top_p, kept):
    probs = probabilities(logits_of(row), SamplingParams(temperature=1.0, top_p=top_p))
    assert (probs > 0).nonzero().flatten().tolist() == kept
    expected = torch.zeros(len(row), dtype=torch.float64)
    expected[kept] = torch.tensor(row, dtype=torch.float64)[kept]
    torch.testing.assert_close(probs, (expected / expected.sum()).float())


def test_top_p_drops_a_whole_tie_group_beyond_the_cut_off():
    row = [0.05, 0.5, 0.05, 0.3, 0.05, 0.05]  # mass above the 0.05s is 0.8 >= 0.75
    probs = probabilities(logits_of(row), SamplingParams(temperature=1.0, top_p=0.75))
    assert (probs > 0).nonzero().flatten().tolist() == [1, 3]


def test_top_p_keeps_all_tokens_tied_for_the_top():
    """The top-1 is always kept; when several tie for it, all of them are."""
    probs = probabilities(torch.zeros(2, 8), SamplingParams(temperature=1.0, top_p=0.01))
    assert (probs > 0).all()
    row = [0.1, 0.3, 0.3, 0.2, 0.1]
    probs = probabilities(logits_of(row), SamplingParams(temperature=1.0, top_p=1e-6))
    assert (probs > 0).nonzero().flatten().tolist() == [1, 2]
    torch.testing.assert_close(probs, torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0]))


def tied_logits(*shape: int, seed: int, levels: int = 4) -> torch.Tensor:
    """Logits taking only a few distinct values, so most tokens share their value with others."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, levels, shape, generator=g).float() * 0.7


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.5, 0.75, 0.9, 0.99])
def test_top_p_does_not_depend_on_where_tied_tokens_sit_in_the_vocabulary(top_p):
    logits = tied_logits(16, 24, seed=7)
    params = SamplingParams(temperature=1.0, top_p=top_p)
    probs = probabilities(logits, params)
    g = torch.Generator().manual_seed(8)
    for _ in range(5):
        perm = torch.randperm(24, generator=g)
        permuted = probabilities(logits[:, perm], params)
        assert torch.equal(permuted > 0, probs[:, perm] > 0)
        torch.testing.assert_close(permuted, probs[:, perm])  # the softmax sums in another order


@pytest.mark.parametrize("seed", range(4))
def test_top_p_agrees_with_the_per_token_definition_on_batched_rows_with_ties(seed):
    b, n, v = 3, 5, 40
    g = torch.Generator().manual_seed(100 + seed)
    logits = tied_logits(b, n, v, seed=seed, levels=3 + seed)
    logits[0] = torch.randn(n, v, generator=g)  # some rows without ties too
    top_ps = torch.rand(8, generator=g).tolist() + [1e-6, 0.999]
    for temperature, top_k in [(1.0, 0), (0.6, 0), (1.3, 12)]:
        unfiltered = probabilities(logits, SamplingParams(temperature=temperature, top_k=top_k))  # [B, N, V]
        for top_p in top_ps:
            probs = probabilities(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
            assert probs.shape == (b, n, v)
            for i in range(b):
                for j in range(n):
                    row = unfiltered[i, j].tolist()
                    keep = torch.tensor(nucleus_by_definition(row, top_p))
                    assert torch.equal(probs[i, j] > 0, keep & (unfiltered[i, j] > 0)), (i, j, top_p)
                    expected = unfiltered[i, j].double() * keep
                    torch.testing.assert_close(probs[i, j], (expected / expected.sum()).float())
