"""The verifiers at Gemma 3's vocabulary, V = 262,144: the Triton kernel (in the interpreter on CPU,
compiled with SPECDEC_TRITON_GPU=1) against the reference bit for bit, with and without the split
pre-pass and through the final draw's descent over 128 tiles; and the first token's distribution
against a 262,144-token target distribution computed from the definition.

Few rows and big tiles keep the interpreter's work small in the default tier; the kernel's own tile
(2,048 tokens, 128 of them) runs in the slow tier. Each verify call still reads every visited row
whole, so these cases cost seconds, not milliseconds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sequence_stats import ALPHA, NEGATIVE_P, required_samples
from test_triton_verifier import DEVICE, SAMPLINGS, assert_same, make_case, to_device
from test_verifier_power import p_value, processed

from specdec.noise import GivenNoise, RequestRNG, VerifyNoise
from specdec.sampling import SamplingParams, probabilities
from specdec.tree import DraftTree, SiblingMode, empty_tree
from verifiers import reference

GEMMA3_VOCAB = 262_144
IID, WOR, DET = SiblingMode.SAMPLED_IID, SiblingMode.SAMPLED_WOR, SiblingMode.DETERMINISTIC


CASES = {"iid-T1": (IID, "T1"), "wor-T1": (WOR, "T1"), "det-T1": (DET, "T1"), "greedy": (WOR, "greedy"),
         "iid-topk": (IID, "T0.6-topk")}
# 8 tiles of 32,768 (the interpreter pays per tile), and the kernel's own tile of 2,048: 128 tiles
# (NUM_TILES = 128, none partial), as it runs on a GPU (slow)
TILES = [pytest.param(32_768, id="8-tiles"), pytest.param(2_048, id="128-tiles", marks=pytest.mark.slow)]


# the default tier keeps two (seconds each in the interpreter): the split pre-pass under rejections
# without replacement, and greedy's argmax across tiles in the walk
DEFAULT_TIER = {("wor-T1", True, 32_768), ("greedy", False, 32_768)}


@pytest.mark.parametrize(
    "case,split,block_v",
    [pytest.param(case, split, block_v, id=f"{case}-{'split' if split else 'walk'}-{128 if block_v == 2_048 else 8}-tiles",
                  marks=[] if (case, split, block_v) in DEFAULT_TIER else [pytest.mark.slow])
     for case in CASES for split in (False, True) for block_v in (32_768, 2_048)],
)
def test_triton_equals_the_reference_at_gemma3s_vocabulary(case, split, block_v):
    """Bushy trees at T > 0 reject and rewrite p' (and q') over the whole row before the final draw
    descends through the tile masses; greedy takes the first argmax across tiles."""
    mode, sampling = CASES[case]
    tree, logits, noise = make_case(5, 1, 4, GEMMA3_VOCAB, mode, SAMPLINGS[sampling], "bushy")
    assert_same(tree, logits, SAMPLINGS[sampling], noise, block_v=block_v, split=split)


@pytest.mark.slow
def test_triton_equals_the_reference_at_gemma3s_vocabulary_in_batches_of_bfloat16_logits():
    """Two requests, one with an empty tree, bfloat16 logits, top-p, in the kernel's own tile."""
    for seed, mode in enumerate([IID, WOR, DET]):
        tree, logits, noise = make_case(seed, 2, 6, GEMMA3_VOCAB, mode, SAMPLINGS["T1.3-topp"], "bushy",
                                        logits_dtype=torch.bfloat16)
        for split in (False, True):
            assert_same(tree, logits, SAMPLINGS["T1.3-topp"], noise, split=split)


TOP = 1 - 2.0**-53  # the largest uniform the noise draws


def boundary_logits(kind: str) -> tuple[torch.Tensor, float, int]:
    """(logits [V], final uniform, the token the draw must give) at the descent's boundaries."""
    logits = torch.zeros(GEMMA3_VOCAB)
    if kind == "half":  # equal weights: u * total lands exactly between the two halves, which goes right
        return logits, 0.5, GEMMA3_VOCAB // 2
    if kind == "quarter":  # the same boundary one level further down the descent
        return logits, 0.25, GEMMA3_VOCAB // 4
    # the top uniform with every tile but one empty: the draw must land on the last token of mass,
    # the vocabulary's last, not in an empty tile
    logits.fill_(-float("inf"))
    logits[[0, 100_000, GEMMA3_VOCAB - 1]] = torch.tensor([0.0, 1.0, 2.5])
    return logits, TOP, GEMMA3_VOCAB - 1


@pytest.mark.parametrize("block_v", TILES)
@pytest.mark.parametrize("kind", ["half", "quarter", "top"])
@pytest.mark.parametrize("split", [False, True], ids=["walk", "split"])
def test_the_final_draw_descends_to_the_right_token_at_gemma3s_vocabulary(kind, split, block_v):
    logits, final, want = boundary_logits(kind)
    noise = GivenNoise(torch.zeros(1, 0, dtype=torch.float64), torch.tensor([final], dtype=torch.float64))
    tree, logits, noise = to_device(empty_tree(1), logits[None, None], noise)
    result = assert_same(tree, logits, SAMPLINGS["T1"], noise, block_v=block_v, split=split)
    assert result.next_token.tolist() == [want]


# -- the first token against a 262,144-token distribution --

HEAVY = [0, 2_047, 2_048, 131_071, 131_072, 262_143]  # tile and half edges, the last token
BINS = 8  # the rest of the vocabulary in 8 ranges of 32,768 tokens


def wide_logits(seed: int, slope: float) -> torch.Tensor:  # [V]
    """A few heavy tokens at tile edges over a tail holding about a third of the mass, thinning
    along the vocabulary (so that a draw landing in the wrong half shows)."""
    generator = torch.Generator().manual_seed(seed)
    logits = -slope * torch.arange(GEMMA3_VOCAB) / GEMMA3_VOCAB + 0.5 * torch.randn(GEMMA3_VOCAB, generator=generator)
    logits[HEAVY] = torch.tensor([11.0, 10.6, 10.9, 10.3, 10.8, 10.1]) + torch.randn(len(HEAVY), generator=generator)
    return logits


TARGET_LOGITS, DRAFT_LOGITS = wide_logits(0, 1.5), wide_logits(1, 0.5)


def binned(per_token: np.ndarray) -> np.ndarray:  # [V] -> [len(HEAVY) + BINS]
    rest = per_token.copy()
    rest[HEAVY] = 0
    return np.concatenate([per_token[HEAVY], rest.reshape(BINS, -1).sum(1)])


def wide_first_tokens(mode: SiblingMode, params: SamplingParams, samples: int, seed: int, verify) -> np.ndarray:
    """Counts [V] of the first token of a step over three drafted children of the root (as
    test_verifier_power.first_tokens, in chunks small enough for rows of 262,144 tokens)."""
    q = probabilities(DRAFT_LOGITS, params)  # [V]
    counts = np.zeros(GEMMA3_VOCAB, dtype=np.int64)
    generator = torch.Generator().manual_seed(seed)
    chunk = 32
    for start in range(0, samples, chunk):
        batch = min(chunk, samples - start)
        if mode is DET:
            tokens = q.topk(3).indices.expand(batch, 3)
        else:
            tokens = torch.multinomial(q.expand(batch, -1), 3, replacement=mode is IID, generator=generator)
        tree = DraftTree(tokens, torch.full((batch, 3), -1), None if mode is DET else q.expand(batch, 3, -1),
                         torch.full((batch,), 3), mode, static_shape=True)
        noise = VerifyNoise.draw(RequestRNG(torch.arange(start, start + batch) + (seed << 32)), 3)
        result = verify(tree, TARGET_LOGITS.expand(batch, 4, -1), params, noise)
        accepted = tokens.gather(1, result.accepted_nodes[:, :1].clamp(min=0))[:, 0]
        first = torch.where(result.num_accepted > 0, accepted, result.next_token)
        counts += np.bincount(first.numpy(), minlength=GEMMA3_VOCAB)
    return counts


TV = 0.05  # what a few thousand rows of 262,144 tokens can see; a wrong tile or half moves far more


@pytest.mark.slow
@pytest.mark.parametrize("mode", [IID, WOR, DET], ids=lambda m: m.name)
def test_first_token_is_the_target_distribution_at_gemma3s_vocabulary(mode):
    params = SamplingParams(1.0)
    exact = binned(processed(TARGET_LOGITS.numpy(), params))
    samples = required_samples(len(exact), TV)
    p, tv = p_value(binned(wide_first_tokens(mode, params, samples, seed=3, verify=reference.verify)), exact)
    print(mode.name, f"p={p:.3g} TV={tv:.5f} N={samples}")
    assert p > ALPHA, f"{mode.name}: p={p:.3g} TV={tv:.5f} N={samples}"


@pytest.mark.slow
def test_control_a_final_draw_in_the_wrong_half_is_rejected():
    """Negative control: the correction token moved to the other half of the vocabulary."""

    def wrong_half(tree, logits, params, noise):
        result = reference.verify(tree, logits, params, noise)
        moved = torch.where(result.num_accepted > 0, result.next_token, (result.next_token + GEMMA3_VOCAB // 2) % GEMMA3_VOCAB)
        return type(result)(result.accepted_nodes, result.num_accepted, moved)

    params = SamplingParams(1.0)
    exact = binned(processed(TARGET_LOGITS.numpy(), params))
    samples = required_samples(len(exact), 2 * TV)  # the control's bias is far larger than TV
    p, tv = p_value(binned(wide_first_tokens(IID, params, samples, seed=4, verify=wrong_half)), exact)
    print(f"control: p={p:.3g} TV={tv:.5f} N={samples}")
    assert p < NEGATIVE_P, (p, tv)
