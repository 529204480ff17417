"""The verifiers' p (``specdec.sampling.target_probabilities``) and its exp (``exp_weight``): close to
the float64 softmax, the keep-set rule of ``probabilities``, each row on its own bit for bit (the
reference and the kernel compute only the rows a walk visits), and only those rows computed."""

from __future__ import annotations

import math

import pytest
import torch

from specdec.noise import GivenNoise
from specdec.sampling import (
    EXP_CUTOFF,
    SamplingParams,
    exp_weight,
    keep_thresholds,
    probabilities,
    target_probabilities,
)
from specdec.tree import DraftTree, SiblingMode
from verifiers import reference

SETTINGS = [
    SamplingParams(1.0),
    SamplingParams(0.3),
    SamplingParams(1.7, top_k=3),
    SamplingParams(1.0, top_p=0.8),
    SamplingParams(0.6, top_k=10, top_p=0.5),
]


def test_exp_weight_is_within_one_and_a_half_ulps_of_exp():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([-torch.rand(1_000_000, generator=g) * -EXP_CUTOFF, -torch.rand(100_000, generator=g)])
    got = exp_weight(x.float())
    want = torch.exp(x.float().double())
    nearest = want.float()
    ulp = (torch.nextafter(nearest, torch.tensor(math.inf)) - nearest).double()
    assert ((got.double() - want).abs() < 1.5 * ulp).all()
    assert (got == nearest).double().mean() > 0.85  # mostly the correctly rounded value


def test_exp_weight_edges():
    cutoff = torch.tensor(EXP_CUTOFF)
    x = torch.tensor([0.0, -0.0, EXP_CUTOFF, torch.nextafter(cutoff, cutoff - 1).item(), -math.inf, -1e-40])
    got = exp_weight(x)
    assert got[0] == 1 and got[1] == 1 and got[5] == 1  # the row's max weighs exactly 1
    assert got[2] >= torch.finfo(torch.float32).tiny  # normal at the cut-off: no subnormal anywhere
    assert got[3] == 0 and got[4] == 0


@pytest.mark.parametrize("params", SETTINGS, ids=str)
def test_close_to_probabilities_with_the_same_keep_set(params):
    logits = torch.randn(3, 5, 33, generator=torch.Generator().manual_seed(4)) * 4
    got, drafters = target_probabilities(logits, params), probabilities(logits, params)
    assert got.dtype == torch.float64 and got.shape == logits.shape
    assert torch.equal(got > 0, drafters > 0)
    torch.testing.assert_close(got, drafters.double(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got.sum(-1), torch.ones(3, 5, dtype=torch.float64), rtol=1e-15, atol=1e-15)


@pytest.mark.parametrize("params", SETTINGS, ids=str)
def test_each_row_on_its_own_bit_for_bit(params):
    """What the lazy reference and the kernel rely on: a row's p does not depend on its neighbours."""
    logits = torch.randn(4, 6, 500, generator=torch.Generator().manual_seed(5)) * 3
    whole = target_probabilities(logits, params)
    for b, r in [(0, 0), (3, 5), (2, 1)]:
        assert torch.equal(whole[b, r], target_probabilities(logits[b, r], params))
    assert torch.equal(whole[:, 2], target_probabilities(logits[:, 2].contiguous(), params))


def test_bf16_logits_widen_exactly():
    logits = (torch.randn(2, 3, 40, generator=torch.Generator().manual_seed(5)) * 3).bfloat16()
    params = SamplingParams(0.9, top_k=5, top_p=0.9)
    assert torch.equal(target_probabilities(logits, params), target_probabilities(logits.float(), params))


def test_greedy_is_the_one_hot_argmax_in_float64():
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0]])
    assert target_probabilities(logits, SamplingParams(0.0)).tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_masked_logits_get_zero_and_the_input_stays():
    logits = torch.tensor([1.0, -math.inf, 0.5, -math.inf])
    before = logits.clone()
    probs = target_probabilities(logits, SamplingParams(1.0, top_k=3, top_p=0.99))
    assert probs[1] == 0 and probs[3] == 0 and torch.equal(logits, before)


@pytest.mark.parametrize(
    "row, top_p, kept",
    [
        ([0.4, 0.2, 0.2, 0.2], 0.5, [0, 1, 2, 3]),  # mass above the 0.2s is 0.4 < 0.5: all three stay
        ([0.2, 0.35, 0.2, 0.05, 0.2], 0.4, [0, 1, 2, 4]),  # the cut-off falls inside the 0.2 group
        ([0.05, 0.5, 0.05, 0.3, 0.05, 0.05], 0.75, [1, 3]),  # a whole tie group beyond the cut-off
        ([0.1, 0.3, 0.3, 0.2, 0.1], 1e-6, [1, 2]),  # every token tied for the top
    ],
)
def test_top_p_keeps_or_drops_tied_tokens_together(row, top_p, kept):
    logits = torch.tensor(row, dtype=torch.float64).log().float()
    probs = target_probabilities(logits, SamplingParams(1.0, top_p=top_p))
    assert (probs > 0).nonzero().flatten().tolist() == kept


def test_thresholds_without_filters_do_not_read_the_logits():
    logits = torch.empty(2, 3, 1000, device="meta")  # no data: any read would fail
    least_logit, least_weight = keep_thresholds(logits, SamplingParams(0.7))
    assert least_logit.shape == least_weight.shape == (2, 3, 1)


def test_the_reference_computes_only_the_rows_its_walks_visit(monkeypatch):
    """A chain of four nodes whose first two are accepted and third rejected: rows 0, 1 and 2 of
    p are computed (row 0 for every request, each accepted row for the requests that accept it),
    never rows 3 and 4."""
    batch, depth, vocab = 2, 4, 50
    logits = torch.randn(batch, depth + 1, vocab, generator=torch.Generator().manual_seed(0))
    rows_seen = []

    def counting(rows, params):
        rows_seen.append(next(r for r in range(depth + 1) if torch.equal(rows[0], logits[0, r])))
        return target_probabilities(rows, params)

    monkeypatch.setattr(reference, "target_probabilities", counting)
    tokens = logits[:, :depth].argmax(-1)  # each node is its row's likeliest token
    tree = DraftTree(tokens, torch.arange(-1, depth - 1).expand(batch, -1), None, torch.full((batch,), depth),
                     SiblingMode.DETERMINISTIC)
    coins = torch.tensor([[1e-9, 1e-9, 1 - 1e-9, 1e-9]] * batch, dtype=torch.float64)
    result = reference.verify(tree, logits, SamplingParams(1.0), GivenNoise(coins, torch.full((batch,), 0.5)))
    assert result.num_accepted.tolist() == [2, 2]
    assert rows_seen == [0, 1, 2]
