"""The split pre-pass (verifiers/triton_rows.py): each tile's statistics against torch's, the walk
that reads them against the reference, bit for bit, and the rule that picks it.

Runs in the Triton interpreter on CPU (conftest sets TRITON_INTERPRET=1) and on the GPU as is;
tiles are shrunk (``block_v``) so small vocabularies span several, the last one partial.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_triton_verifier import DEVICE, SAMPLINGS, assert_same, make_case

from specdec.sampling import SamplingParams, inverse_temperature, keep_thresholds, pairwise_sum, target_weights
from specdec.tree import SiblingMode
from verifiers import triton_rows


def tiled(rows: torch.Tensor, block_v: int, num_tiles: int, fill: float) -> torch.Tensor:
    """[R, V] -> [R, num_tiles, block_v], padded with ``fill`` past V."""
    padded = torch.nn.functional.pad(rows, (0, num_tiles * block_v - rows.shape[-1]), value=fill)
    return padded.unflatten(-1, (num_tiles, block_v))


@pytest.mark.parametrize("sampling", ["greedy", "T1", "T0.6-topk", "T1.3-topp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_tiles_statistics_are_torchs(sampling, dtype):
    params = SAMPLINGS[sampling]
    block_v, vocab = 16, 90  # six tiles, the last one partial, padded to eight
    num_tiles = 8
    g = torch.Generator().manual_seed(3)
    logits = (3 * torch.randn(2, 5, vocab, generator=g)).to(dtype)
    logits[0, 1, [5, 40, 81]] = 50  # ties for the max, across tiles: the first wins
    if params.greedy:
        logits[0, 2] = -math.inf  # no finite logit: index 0, as torch's argmax (no p at T > 0)
    logits[1, 3, 7:70] = -math.inf  # whole tiles without a finite logit
    logits = logits.to(DEVICE)
    least_logit, least_weight = (t.contiguous() for t in keep_thresholds(logits, params))
    scale = 1.0 if params.greedy else inverse_temperature(params)
    best, second = triton_rows.row_statistics(
        logits, least_logit, least_weight, scale, params.greedy, block_v, num_tiles
    )
    real = math.ceil(vocab / block_v)
    scaled = logits.float().cpu() * (1.0 if params.greedy else scale)  # [B, N+1, V]
    want_best = tiled(scaled, block_v, num_tiles, -math.inf).amax(-1)  # [B, N+1, tiles]
    assert torch.equal(best.cpu()[..., :real], want_best[..., :real])
    if params.greedy:
        tiles = tiled(scaled, block_v, num_tiles, -math.inf)
        first = tiles.argmax(-1) + torch.arange(num_tiles) * block_v  # torch's argmax takes the first
        assert torch.equal(second.cpu()[..., :real], first[..., :real])
        return
    weights = target_weights(scaled, least_logit.cpu(), least_weight.cpu()).double()  # [B, N+1, V]
    want_mass = pairwise_sum(tiled(weights, block_v, num_tiles, 0.0))[..., 0]  # [B, N+1, tiles]
    assert torch.equal(second.cpu()[..., :real], want_mass[..., :real])
    # the walk's mass: the tree over the tile masses, zero-padded: the row's pairwise_sum
    padded = torch.nn.functional.pad(second.cpu()[..., :real], (0, num_tiles - real))
    assert torch.equal(pairwise_sum(padded), pairwise_sum(weights))


# the fast tier keeps each mode once (greedy on the i.i.d. one); the rest of the grid runs with integration
FAST_SPLIT = {(SiblingMode.SAMPLED_IID, "greedy"), (SiblingMode.SAMPLED_WOR, "T0.6-topk"), (SiblingMode.DETERMINISTIC, "T1.3-topp")}


@pytest.mark.parametrize("mode,sampling", [(m, s) if (m, s) in FAST_SPLIT else pytest.param(m, s, marks=pytest.mark.integration)
                                           for m in SiblingMode for s in SAMPLINGS],
                         ids=lambda value: value.name if isinstance(value, SiblingMode) else value)
def test_the_split_walk_matches_the_reference(mode, sampling):
    """The walk itself is the same with or without the split (test_triton_verifier covers it on
    chains and bushes); here bushy trees, which visit and reject the most rows."""
    # four tiles, the last one partial; a batch whose requests stop at different depths
    tree, logits, noise = make_case(1, 3, 10, 1000, mode, SAMPLINGS[sampling], "bushy")
    assert_same(tree, logits, SAMPLINGS[sampling], noise, block_v=256, split=True)


@pytest.mark.parametrize("sampling", ["greedy", "T1.3-topp"])
def test_the_split_walk_on_bfloat16_logits(sampling):
    tree, logits, noise = make_case(7, 2, 8, 300, SiblingMode.SAMPLED_WOR, SAMPLINGS[sampling], "bushy",
                                    logits_dtype=torch.bfloat16)
    assert_same(tree, logits, SAMPLINGS[sampling], noise, block_v=64, split=True)


@pytest.mark.integration  # tiles in the fast tier through small block_v (above)
@pytest.mark.parametrize("mode,sampling", [(SiblingMode.SAMPLED_WOR, "T1"), (SiblingMode.DETERMINISTIC, "greedy")],
                         ids=["WOR-T1", "greedy"])
def test_a_large_vocabulary(mode, sampling):
    """V = 151,936 (Qwen) in the default tile: 75 of the pre-pass's 128 tiles are real."""
    tree, logits, noise = make_case(11, 1, 4, 151_936, mode, SAMPLINGS[sampling], "bushy")
    assert_same(tree, logits, SAMPLINGS[sampling], noise, split=True)


def test_the_rule_splits_small_steps_only():
    cpu = torch.device("cpu")  # the interpreter: one multiprocessor
    rows = triton_rows.ROWS_PER_MULTIPROCESSOR
    assert triton_rows.splits(1, rows - 1, cpu)
    assert not triton_rows.splits(1, rows, cpu)
    assert not triton_rows.splits(2, rows - 1, cpu)


def test_a_verify_call_without_split_follows_the_rule(monkeypatch):
    """split=None asks the rule; each answer gives the reference's result."""
    from verifiers import triton_tree

    asked = []

    def rule(batch, nodes, device):
        asked.append((batch, nodes))
        return len(asked) % 2 == 1

    monkeypatch.setattr(triton_tree, "splits", rule)
    params = SamplingParams(1.0)
    tree, logits, noise = make_case(1, 2, 6, 40, SiblingMode.SAMPLED_IID, params, "bushy")
    for _ in range(2):
        assert_same(tree, logits, params, noise, block_v=16)
    assert asked == [(2, 6), (2, 6)]


@pytest.mark.parametrize("sampling", ["greedy", pytest.param("T1", marks=pytest.mark.integration)])
def test_the_split_walk_reads_the_pre_pass(sampling, monkeypatch):
    """Negative control: statistics off by a little change the split walk's result (so the tests
    above compare the split path, not the walk's own passes)."""
    from verifiers import triton_tree

    params = SAMPLINGS[sampling]
    tree, logits, noise = make_case(2, 3, 10, 100, SiblingMode.SAMPLED_IID, params, "bushy")
    exact = triton_tree.verify(tree, logits, params, noise, block_v=32, split=True)
    real = triton_rows.row_statistics

    def off(*args):
        best, second = real(*args)
        # greedy: each tile's first maximum one index later; T > 0: every mass four times too big
        return best, second + 1 if params.greedy else second * 4

    monkeypatch.setattr(triton_tree, "row_statistics", off)
    wrong = triton_tree.verify(tree, logits, params, noise, block_v=32, split=True)
    assert any(not torch.equal(getattr(exact, f), getattr(wrong, f)) for f in ("num_accepted", "next_token"))
