"""The Triton tree verifier makes the reference's decisions, bit for bit, on the same noise.

tests/conftest.py sets TRITON_INTERPRET=1, so the kernel runs on CPU in the Triton interpreter,
where every program instance (one per request) costs milliseconds: batches stay small, and tiling
is exercised on small vocabularies by shrinking the tile (``block_v``) rather than growing V.
With SPECDEC_TRITON_GPU=1 on a CUDA machine the same tests run the compiled kernel on the GPU.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl
from sequence_stats import ALPHA, required_samples, sequence_verdict
from test_reference_sums import sequential_sum

from drafters.synthetic import SyntheticDrafter
from specdec.decode import SpecDecoder
from specdec.noise import GivenNoise, HashedNoise, RequestRNG, VerifyNoise, uniforms_at
from specdec.protocols import VerifyResult
from specdec.sampling import EXP_CUTOFF, SamplingParams, exp_weight, pairwise_sum, probabilities, target_probabilities
from specdec.synthetic import SyntheticTarget
from specdec.tree import DraftTree, SiblingMode, empty_tree
from verifiers import reference, triton_arith, triton_tree
from verifiers.select import select_verifier, warm_up_cases

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available() else "cuda"
IID, WOR, DET = SiblingMode.SAMPLED_IID, SiblingMode.SAMPLED_WOR, SiblingMode.DETERMINISTIC
SAMPLINGS = {
    "greedy": SamplingParams(0.0),
    "T1": SamplingParams(1.0),
    "T0.6-topk": SamplingParams(0.6, top_k=20),
    "T1.3-topp": SamplingParams(1.3, top_p=0.8),
}


def make_case(
    seed: int,
    batch: int,
    max_nodes: int,
    vocab: int,
    mode: SiblingMode,
    sampling: SamplingParams,
    shape: str,  # "chain", or "bushy": random parents[i] in [-1, i)
    logits_dtype: torch.dtype = torch.float32,
    with_draft_probs: bool = True,
) -> tuple[DraftTree, torch.Tensor, VerifyNoise]:
    """A random tree whose drafts resemble the target (so that walks go deep) with ragged sizes,
    duplicate siblings and tokens outside q's support (the point-mass rule)."""
    g = torch.Generator().manual_seed(seed)
    if shape == "chain":
        parents = torch.arange(-1, max_nodes - 1).expand(batch, max_nodes).clone()
    else:
        own = torch.arange(max_nodes)
        parents = (torch.rand(batch, max_nodes, generator=g) * (own + 1)).long() - 1
    num_nodes = torch.randint(0, max_nodes + 1, (batch,), generator=g)
    num_nodes[0] = max_nodes
    if batch > 1:
        num_nodes[1] = 0
    target_logits = 3 * torch.randn(batch, max_nodes + 1, vocab, generator=g)
    # siblings share q(.|parent path): a blurred copy of the target's row at their parent
    blurred = target_logits + 1.5 * torch.randn(target_logits.shape, generator=g)
    q_rows = probabilities(blurred, SamplingParams(1.0) if sampling.greedy else sampling)
    draft_probs = q_rows.gather(1, (parents + 1)[..., None].expand(-1, -1, vocab))  # [B, N, V]
    tokens = torch.multinomial(draft_probs.reshape(-1, vocab), 1, generator=g).reshape(batch, -1)
    stray = torch.rand(batch, max_nodes, generator=g) < 0.25
    tokens = torch.where(stray, torch.randint(0, 3, tokens.shape, generator=g), tokens)
    # padding that would be a candidate if the kernel ignored num_nodes
    padding = torch.arange(max_nodes) >= num_nodes[:, None]
    tokens, parents = tokens.masked_fill(padding, -1), parents.masked_fill(padding, -1)
    tree = DraftTree(tokens, parents, draft_probs, num_nodes, mode).validate(vocab)
    if not with_draft_probs or mode is DET:
        tree = dataclasses.replace(tree, draft_probs=None)
    noise = VerifyNoise.draw(RequestRNG(torch.arange(batch) + 1000 * seed), max_nodes)
    return to_device(tree, target_logits.to(logits_dtype), noise)


def to_device(tree: DraftTree, target_logits: torch.Tensor, noise: VerifyNoise, device: str = DEVICE):
    def move(x):
        return x if x is None else x.to(device)

    tensors = (move(getattr(tree, f)) for f in ("tokens", "parents", "draft_probs", "num_nodes"))
    noise = noise.to(device)
    return DraftTree(*tensors, tree.mode), target_logits.to(device), noise


def assert_same(tree, target_logits, sampling, noise, block_v=2048, split=None) -> VerifyResult:
    """The Triton result, after checking every field against the reference's."""
    expected = reference.verify(tree, target_logits, sampling, noise)
    actual = triton_tree.verify(tree, target_logits, sampling, noise, block_v=block_v, split=split)
    for field in dataclasses.fields(VerifyResult):
        want, got = getattr(expected, field.name), getattr(actual, field.name)
        assert torch.equal(want, got), f"{field.name}: reference {want.tolist()}, triton {got.tolist()}"
    return actual


# the fast tier keeps one sampling per mode on bushy trees and greedy on a chain (each through three
# tilings); the rest of the grid runs with integration (each case costs seconds in the interpreter)
FAST_GRID = {(IID, "T1.3-topp", "bushy"), (WOR, "T0.6-topk", "bushy"), (DET, "T1", "bushy"), (IID, "greedy", "chain")}


def grid(*parameters):
    return parameters if parameters in FAST_GRID else pytest.param(*parameters, marks=pytest.mark.integration)


@pytest.mark.parametrize("mode,sampling,shape", [grid(m, s, shape) for m in SiblingMode for s in SAMPLINGS
                                                 for shape in ("chain", "bushy")],
                         ids=lambda value: value.name if isinstance(value, SiblingMode) else value)
def test_matches_reference(mode, sampling, shape):
    max_nodes = 5 if shape == "chain" else 10
    # (batch, vocab, tile): several tiles with a partial last one, both ways round; one wide tile
    for seed, (batch, vocab, block_v) in enumerate([(1, 37, 16), (3, 1000, 256), (8, 37, 4096)]):
        tree, logits, noise = make_case(seed, batch, max_nodes, vocab, mode, SAMPLINGS[sampling], shape)
        assert_same(tree, logits, SAMPLINGS[sampling], noise, block_v)


@triton.jit
def _uniforms_through_the_kernel_hash(keys_ptr, counters_ptr, out_ptr, E: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    for e in tl.static_range(E):
        value = triton_arith.uniform(tl.load(keys_ptr + b), tl.load(counters_ptr + b), tl.full((), e, tl.int64))
        tl.store(out_ptr + b * E + e, value)


@triton.jit
def _exp_through_the_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0)
    tl.store(out_ptr + offsets, triton_arith.exp_weight(x), mask=offsets < n)


def test_the_kernels_exp_gives_exp_weight_bit_for_bit():
    """Over the whole range a row's weights take (x = scaled logit - row max <= 0), the cut-off and
    its neighbours, zero of both signs, a subnormal and -inf (a logit top-k masks, or padding)."""
    g = torch.Generator().manual_seed(0)
    cutoff = torch.tensor(EXP_CUTOFF)
    edges = [0.0, -0.0, -1e-40, -math.log(2) / 2, EXP_CUTOFF, -math.inf]
    edges += [torch.nextafter(cutoff, cutoff + 1).item(), torch.nextafter(cutoff, cutoff - 1).item()]
    x = torch.cat([torch.tensor(edges), -torch.rand(20_000, generator=g) * 90, -torch.rand(2_000, generator=g)])
    x = x.float().to(DEVICE)
    out = torch.empty_like(x)
    block = 1024
    _exp_through_the_kernel[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), BLOCK=block, enable_fp_fusion=False)
    assert torch.equal(out, exp_weight(x))


def test_the_kernels_hash_gives_the_references_uniforms_bit_for_bit():
    """Keys over their whole 32-bit range, counters past 2**32 (their high word is hashed too)."""
    g = torch.Generator().manual_seed(0)
    keys = torch.cat([torch.tensor([0, 2**32 - 1]), torch.randint(0, 2**32, (30,), generator=g)])  # [B]
    counters = torch.cat([torch.tensor([0, 2**40 + 3]), torch.randint(0, 2**62, (30,), generator=g)])  # [B]
    elements = 6
    want = uniforms_at(keys, counters, torch.arange(elements))  # [B, E]
    keys, counters = keys.to(DEVICE), counters.to(DEVICE)
    got = torch.empty(keys.shape[0], elements, dtype=torch.float64, device=DEVICE)
    _uniforms_through_the_kernel_hash[(keys.shape[0],)](keys, counters, got, E=elements)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("mode", [IID, pytest.param(WOR, marks=pytest.mark.integration),
                                  pytest.param(DET, marks=pytest.mark.integration)], ids=lambda m: m.name)
def test_hashed_noise_and_the_same_values_given_decide_alike(mode):
    """The kernel hashes a run's noise itself; given as tensors, the same values must give the same
    result (and both the reference's)."""
    for seed in range(2):
        tree, logits, noise = make_case(seed, 4, 10, 37, mode, SAMPLINGS["T1"], "bushy")
        assert isinstance(noise, HashedNoise)
        hashed = assert_same(tree, logits, SAMPLINGS["T1"], noise, block_v=16)
        given = assert_same(tree, logits, SAMPLINGS["T1"], GivenNoise(noise.uniforms, noise.final), block_v=16)
        for field in dataclasses.fields(VerifyResult):
            assert torch.equal(getattr(hashed, field.name), getattr(given, field.name)), field.name


def test_the_warm_up_rewrites_a_residual_in_every_mode():
    """auto's warm-up compares kernel and reference where a rejection rewrites the residual."""
    for tree, logits, sampling, noise in warm_up_cases(torch.device("cpu")):
        if not sampling.greedy:
            result = reference.verify(tree, logits, sampling, noise)
            assert 0 not in result.accepted_nodes[0].tolist(), tree.mode


def test_random_cases_reach_every_outcome():
    """The grid above proves little if every walk stops at the root or accepts everything."""
    outcomes = set()
    for mode in SiblingMode:
        for seed in range(4):
            tree, logits, noise = make_case(seed, 8, 10, 37, mode, SAMPLINGS["T1"], "bushy")
            accepted = reference.verify(tree, logits, SAMPLINGS["T1"], noise).num_accepted
            outcomes.update(zip((accepted > 0).tolist(), (accepted > 1).tolist()))
    assert outcomes == {(False, False), (True, False), (True, True)}


@pytest.mark.parametrize("mode,sampling", [(m, s) if s == "greedy" or (m, s) == (IID, "T1") else
                                           pytest.param(m, s, marks=pytest.mark.integration)
                                           for m in SiblingMode for s in ["greedy", "T1", "T0.6-topk"]],
                         ids=lambda value: value.name if isinstance(value, SiblingMode) else value)
def test_bfloat16_logits(mode, sampling):
    params = SAMPLINGS[sampling]
    tree, logits, noise = make_case(7, 3, 8, 1000, mode, params, "bushy", torch.bfloat16)
    assert_same(tree, logits, params, noise, block_v=512)


@pytest.mark.parametrize("mode", SiblingMode, ids=lambda m: m.name)
def test_greedy_without_draft_probs(mode):
    params = SAMPLINGS["greedy"]
    tree, logits, noise = make_case(3, 3, 8, 37, mode, params, "bushy", with_draft_probs=False)
    assert tree.draft_probs is None
    assert_same(tree, logits, params, noise)


@pytest.mark.integration  # tiling is in the fast tier through small tiles (block_v) above
@pytest.mark.parametrize("mode", SiblingMode, ids=lambda m: m.name)
def test_large_vocabulary(mode):
    """V = 151,936 (Qwen) in 75 tiles, never one block; T = 1 so that rejections rewrite p' and q'."""
    tree, logits, noise = make_case(11, 1, 4, 151_936, mode, SAMPLINGS["T1"], "bushy")
    assert_same(tree, logits, SAMPLINGS["T1"], noise)



def test_exhausted_without_replacement_group_and_duplicates():
    """Root children [a, a, b, c] under top-2 sampling: q = {a, b}. After a is rejected, WOR zeroes
    it in q', so the duplicate a (q'(a) = 0) and c (outside q) are tried as point masses."""
    vocab, batch = 8, 8
    sampling = SamplingParams(1.0, top_k=2)
    g = torch.Generator().manual_seed(5)
    target_logits = torch.randn(1, 5, vocab, generator=g).expand(batch, -1, -1).contiguous()
    q = probabilities(torch.randn(vocab, generator=g), sampling)
    a, b = q.topk(2).indices.tolist()
    c = next(t for t in range(vocab) if t not in (a, b))
    tokens = torch.tensor([a, a, b, c]).expand(batch, -1).contiguous()
    draft_probs = q.expand(batch, 4, -1).contiguous()
    tree = DraftTree(tokens, torch.full((batch, 4), -1), draft_probs, torch.full((batch,), 4), WOR)
    noise = VerifyNoise.draw(RequestRNG(torch.arange(batch)), 4)
    tree, target_logits, noise = to_device(tree, target_logits, noise)
    result = assert_same(tree, target_logits, sampling, noise)
    # some walks accept c as a point mass, some reject every child
    assert set(result.accepted_nodes[:, 0].tolist()) >= {-1, 3}


ULP_VOCAB, ULP_BLOCK_V, X1, X2 = 5000, 256, 2, 1


def one_ulp_case(mode: SiblingMode, children: list[int], device: str = DEVICE):
    """Root children ``children``, all rejected but the last, x2, whose test is u * q'(x2) < p'(x2)
    with p' = norm(p with x1 zeroed) (DETERMINISTIC) or norm(relu(p - q)) (sampled), over a
    vocabulary whose mass summed left to right is ~100 ulps below its pairwise mass (thousands of
    tiny entries), in 20 tiles of the kernel (not a power of two, the last one partial). Request
    0's coin puts u * q'(x2) exactly at the reference's p'(x2), request 1's one ulp below: a
    verifier rejects x2 in the first and accepts it in the second iff its p'(x2) is that value
    to the last bit. Every tensor is made on ``device``, and p is the verifiers' own
    (``target_probabilities``) of the very logits they get. Returns the case and p'(x2)."""
    sampling = SamplingParams(1.0)
    batch, num_children = 2, len(children)
    logits = torch.full((ULP_VOCAB,), -40.0, device=device)  # [V]
    logits[:3] = torch.tensor([-1.0, 0.0, -1.0], device=device)  # p ~ (0.21, 0.58, 0.21, 2.4e-18, ...)
    target_logits = logits.expand(batch, num_children + 1, -1).contiguous()  # [B, N+1, V]
    p = target_probabilities(target_logits, sampling)[0, 0]  # [V], the root row as the verifiers see it
    q = torch.zeros(ULP_VOCAB, device=device)  # [V]
    q[[X1, X2]] = 0.5  # siblings share q; 0.5 is a power of two, so u * q is exact below
    if mode is DET:
        residual, q_x2 = p.scatter(0, torch.tensor([X1], device=device), 0.0), 1.0
    else:
        # after x1, WOR's q' is q with x1 zeroed and renormalised: 1 at x2
        residual, q_x2 = (p - q.double()).clamp(min=0.0), 0.5 if mode is IID else 1.0
    p_x2 = (residual / pairwise_sum(residual)[0])[X2].item()
    coins = [p_x2 / q_x2, math.nextafter(p_x2, 0.0) / q_x2]
    assert all(0 < u < 1 for u in coins)

    tree = DraftTree(
        tokens=torch.tensor([children] * batch, device=device),
        parents=torch.full((batch, num_children), -1, device=device),
        draft_probs=None if mode is DET else q.expand(batch, num_children, -1).contiguous(),
        num_nodes=torch.full((batch,), num_children, device=device),
        mode=mode,
    ).validate(ULP_VOCAB)
    rejecting = [0.999] * (num_children - 1)  # above every p(x) and every p(x) / q(x) here
    uniforms = torch.tensor([rejecting + [u] for u in coins], dtype=torch.float64, device=device)  # [B, N]
    rng = RequestRNG(torch.arange(batch, device=device))
    noise = GivenNoise(uniforms, VerifyNoise.draw(rng, num_children).final)
    return tree, target_logits, noise, sampling, p_x2


@pytest.mark.parametrize("mode", [WOR, pytest.param(IID, marks=pytest.mark.integration),
                                  pytest.param(DET, marks=pytest.mark.integration)], ids=lambda m: m.name)
def test_decision_one_ulp_from_the_normalised_residual(mode, monkeypatch):
    """The kernel's normalising sums are the reference's to the last bit (see one_ulp_case)."""
    tree, target_logits, noise, sampling, _ = one_ulp_case(mode, [X1, X2])
    result = assert_same(tree, target_logits, sampling, noise, ULP_BLOCK_V)
    assert result.accepted_nodes[:, 0].tolist() == [-1, 1]
    # the case can fail: with the mass summed left to right, p'(x2) is larger and both accept
    monkeypatch.setattr(reference, "pairwise_sum", sequential_sum)
    left_to_right = reference.verify(tree, target_logits, sampling, noise)
    assert left_to_right.accepted_nodes[:, 0].tolist() == [1, 1]


def test_rejection_that_removes_no_mass_leaves_the_residual():
    """DETERMINISTIC children [x1, x1, x2]: the duplicate has p'(x1) = 0, so its rejection leaves
    p' as it is, in both verifiers; renormalising it would move p'(x2) by an ulp here."""
    tree, target_logits, noise, sampling, p_x2 = one_ulp_case(DET, [X1, X1, X2])
    result = assert_same(tree, target_logits, sampling, noise, ULP_BLOCK_V)
    assert result.accepted_nodes[:, 0].tolist() == [-1, 2]
    residual = target_probabilities(target_logits, sampling)[0, 0]  # [V], on the verifiers' device
    residual[X1] = 0.0
    residual /= pairwise_sum(residual)[0]
    assert (residual / pairwise_sum(residual)[0])[X2].item() != p_x2


def test_an_empty_residual_after_a_rewrite_keeps_the_rewritten_residual():
    """The kernel writes a rejection's residual into the other of two scratch rows, so that p' is
    still there when the new one has no mass. Children [x1, x2] at T = 1, p on {x1, x2} alone: x1
    is rejected and p' becomes the one-hot at x2 (in scratch); a coin of exactly 1 (outside the
    noise's (0, 1), to reach the rule) rejects x2, whose removal leaves nothing, so p' stays and
    the final draw gives x2, where an all-zero row would give token 0."""
    x1, x2, vocab = 3, 5, 40
    logits = torch.full((1, 3, vocab), -math.inf)  # [B, N+1, V]
    logits[..., x1], logits[..., x2] = 0.0, 0.5
    tree = DraftTree(torch.tensor([[x1, x2]]), torch.tensor([[-1, -1]]), None, torch.tensor([2]), DET)
    noise = GivenNoise(torch.tensor([[0.999, 1.0]], dtype=torch.float64), torch.tensor([0.7], dtype=torch.float64))
    tree, logits, noise = to_device(tree, logits, noise)
    result = assert_same(tree, logits, SAMPLINGS["T1"], noise, block_v=16)
    assert result.num_accepted.tolist() == [0] and result.next_token.tolist() == [x2]


@pytest.mark.parametrize("split", [False, True], ids=["walk", "split"])
def test_greedy_takes_the_first_of_tied_maxima_across_tiles(split):
    """The kernel's argmax runs tile by tile (in the walk, or in triton_rows' pre-pass): a tie
    between tiles goes to the earlier tile, a tie within one to the lower index, as torch's argmax;
    a child at a later tied index is rejected."""
    vocab = 100
    logits = torch.zeros(2, 2, vocab).bfloat16()  # [B, N+1, V]
    logits[0, :, [37, 20, 70]] = 5.0  # tiles of 16: 20 in the second tile, 37 the third
    logits[1, :, [90, 3, 5]] = 5.0  # 3 and 5 share the first tile
    tree = DraftTree(torch.tensor([[37], [90]]), torch.full((2, 1), -1), None, torch.tensor([1, 1]), DET)
    noise = VerifyNoise.draw(RequestRNG(torch.arange(2)), 1, greedy=True)
    tree, logits, noise = to_device(tree, logits, noise)
    result = assert_same(tree, logits, SAMPLINGS["greedy"], noise, block_v=16, split=split)
    assert result.num_accepted.tolist() == [0, 0] and result.next_token.tolist() == [20, 3]


TOP = 1 - 2.0**-53  # the largest uniform the noise draws (specdec.noise.unit_interval)
FINAL_DRAW_CASES = {
    # (logits, block_v, final uniform, token): equal weights put u * total exactly on the boundary
    # between two halves, which a draw must take to the right (`>` for `>=` goes left)
    "V4-half": ([0.0] * 4, 4, 0.5, 2),
    "V8-tiles-half": ([0.0] * 8, 2, 0.5, 4),
    # the top uniform with zero-mass tiles: after subtracting the left masses, rounding leaves the
    # target equal to a node's left mass while its right half has none (a draw that does not check
    # the right half's mass lands on a token of probability 0)
    "V4-top": ([0.0, 0.0, 2.5, -math.inf], 4, TOP, 2),
    "V8-tiles-top": ([0.0, 0.0, -math.inf, -math.inf, 2.5, -math.inf, -math.inf, -math.inf], 2, TOP, 4),
}


@pytest.mark.parametrize("case", FINAL_DRAW_CASES)
def test_the_final_draw_at_its_boundaries(case):
    """The final token of an empty tree at T = 1, in the reference and the kernel (within a tile,
    and across tiles of 2 with block_v = 2), at uniforms on the descent's boundaries."""
    logits, block_v, final, want = FINAL_DRAW_CASES[case]
    logits = torch.tensor([[logits]])  # [1, 1, V]
    noise = GivenNoise(torch.zeros(1, 0, dtype=torch.float64), torch.tensor([final], dtype=torch.float64))
    tree, logits, noise = to_device(empty_tree(1), logits, noise)
    result = assert_same(tree, logits, SAMPLINGS["T1"], noise, block_v=block_v)
    assert result.next_token.tolist() == [want]


@triton.jit
def _unit_interval_through_the_kernel(words_ptr, out_ptr):
    i = tl.program_id(0)
    word = tl.load(words_ptr + i)
    tl.store(out_ptr + i, triton_arith.unit_interval(word, word))


def test_the_kernels_uniforms_stay_strictly_inside_the_unit_interval():
    words = torch.tensor([0, (1 << 32) - 1], device=DEVICE)
    out = torch.empty(2, dtype=torch.float64, device=DEVICE)
    _unit_interval_through_the_kernel[(2,)](words, out)
    assert out.tolist() == [2.0**-53, TOP]


def test_given_noise_wider_than_the_tree_is_read_by_column():
    """Node i's coin is column i of the noise in both verifiers, whatever the noise's width: read
    with the tree's width as its row stride, request 1 would take request 0's columns 2 and 3,
    whose small coins accept where its own reject."""
    vocab, accept, reject = 8, 1e-3, 0.999
    logits = torch.zeros(2, 3, vocab)  # [B, N+1, V]: p = 1/8 everywhere, above the small coins
    tree = DraftTree(torch.tensor([[1, 2], [1, 2]]), torch.full((2, 2), -1), None, torch.tensor([2, 2]), DET)
    uniforms = torch.tensor([[reject, reject, accept, accept, reject], [reject] * 5], dtype=torch.float64)
    noise = GivenNoise(uniforms, torch.tensor([0.3, 0.6], dtype=torch.float64))
    tree, logits, noise = to_device(tree, logits, noise)
    result = assert_same(tree, logits, SAMPLINGS["T1"], noise, block_v=4)
    assert result.num_accepted.tolist() == [0, 0]
    narrow = GivenNoise(noise.uniforms[:, :1], noise.final)
    with pytest.raises(ValueError, match="coins for 1 of the tree's 2 slots"):
        triton_tree.verify(tree, logits, SAMPLINGS["T1"], narrow)


def test_empty_trees():
    no_slots = empty_tree(3)  # N = 0
    unused_slots = dataclasses.replace(
        no_slots, tokens=torch.zeros(3, 4, dtype=torch.int64), parents=torch.full((3, 4), -1)
    )
    for tree in (no_slots, unused_slots):
        logits = torch.randn(3, tree.max_nodes + 1, 37)
        noise = VerifyNoise.draw(RequestRNG(torch.arange(3)), tree.max_nodes)
        tree, logits, noise = to_device(tree, logits, noise)
        result = assert_same(tree, logits, SAMPLINGS["T1"], noise)
        assert result.num_accepted.tolist() == [0, 0, 0]


class CheckedTriton:
    """The Triton verifier driving the decode loop, checked against the reference at every step."""

    def __init__(self) -> None:
        self.request_steps = 0

    def __call__(self, tree, target_logits, sampling, noise) -> VerifyResult:
        self.request_steps += tree.batch_size
        return assert_same(tree, target_logits, sampling, noise)


LOOP_CASES = {
    "chain3-iid-T1": ((1, 1, 1), IID, SamplingParams(1.0)),
    "tree33-wor-topk": ((3, 3), WOR, SamplingParams(1.0, top_k=3)),  # width = top_k: q' exhausts
    "tree22-det-topp": ((2, 2), DET, SamplingParams(1.2, top_p=0.8)),
    "tree22-iid-greedy": ((2, 2), IID, SamplingParams(0.0)),
}


@pytest.mark.parametrize("case", [c if c == "tree22-iid-greedy" else pytest.param(c, marks=pytest.mark.integration)
                                  for c in LOOP_CASES])
def test_decode_loop_through_triton(case):
    """The whole loop on the synthetic workload, driven by the kernel's results, each step equal to
    the reference's on the very (tree, logits, noise) the loop produced."""
    branching, mode, sampling = LOOP_CASES[case]
    target = SyntheticTarget(vocab_size=6, sharpness=1.5, device=DEVICE)
    verifier = CheckedTriton()
    decoder = SpecDecoder(target, SyntheticDrafter(target, branching, mode, 0.5), verifier)
    generation = decoder.generate([[1, 2]] * 32, 4, sampling, seed=3)
    assert all(len(out) == 4 for out in generation.outputs)
    assert verifier.request_steps >= 64


@pytest.mark.slow  # heavy under the interpreter: CI runs it after the default suite, gpu_check.sh on the GPU
def test_sequence_distribution_through_triton():
    """Chi-square of the first two tokens through the Triton path. The interpreter limits it to
    ~500 sequences (detects TV >= 0.15); the full-power tests run through the reference, which
    the kernel matches bit for bit (above)."""
    vocab, length, sampling = 4, 2, SamplingParams(1.0)
    target = SyntheticTarget(vocab_size=vocab, sharpness=1.5, device=DEVICE)
    decoder = SpecDecoder(target, SyntheticDrafter(target, (2, 2), IID, 0.5), CheckedTriton())
    exact = target.sequence_distribution([1, 2], length, sampling)
    samples = required_samples(vocab**length, tv=0.15)
    verdict = sequence_verdict(decoder, exact, [1, 2], length, vocab, sampling, samples, seed=1)
    print(verdict)
    assert verdict.impossible == 0 and verdict.p_value > ALPHA, verdict


def test_select_verifier(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_verifier("reference") is reference.verify
    assert select_verifier("auto") is reference.verify
    assert select_verifier("triton") is triton_tree.verify
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="needs a CUDA device.*reference.*TRITON_INTERPRET=1"):
        select_verifier("triton")
    with pytest.raises(ValueError, match="unknown verifier 'trition'; choose one of auto, block, reference, traversal, triton"):
        select_verifier("trition")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # auto's warm-up may compile a variant no test has run yet
    assert select_verifier("auto") is triton_tree.verify


def test_core_never_imports_triton():
    code = (
        "import sys, specdec.decode, specdec.synthetic, drafters.synthetic, verifiers.reference, "
        "verifiers.select; assert 'triton' not in sys.modules, 'triton was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.integration
def test_bench_quick(tmp_path):
    from benchmarks import bench_verify

    path = tmp_path / "bench.csv"
    bench_verify.main(["--quick", "--csv", str(path)])
    lines = path.read_text().splitlines()
    rows = [dict(zip(lines[0].split(","), line.split(","))) for line in lines[1:]]
    assert {row["verifier"] for row in rows} == {"reference", "triton-walk", "triton-split"}
    assert {row["temperature"] for row in rows} == {"0.0", "1.0"}
    assert len(rows) == 2 * 1 * 2 * 3  # batches x vocabularies x temperatures x verifiers
    for row in rows:
        assert all(float(row[column]) > 0 for column in ("noise_ms", "verify_ms", "step_ms", "gb_per_s")), row


@pytest.mark.parametrize("verifier", ["reference", "triton", "block", "traversal", "typical_lossy"])
@pytest.mark.parametrize("mode", [DET, IID])
def test_at_temperature_zero_the_fixed_noise_gives_every_verdict_random_noise_gives(verifier, mode):
    """SpecDecoder draws no noise at T = 0 (VerifyNoise.draw(greedy=True)): sound only if no coin
    and no final uniform can change a greedy verdict, whatever the tree and the draft's q. The
    kernel reads no noise at T = 0, so its verdict on the fixed noise is held to the reference's
    on random noise; typical acceptance reads only the final uniform, and only with sample_first."""
    from verifiers.block import verify as block_verify

    if verifier == "typical_lossy":
        verify = select_verifier(verifier, sample_first=True)
    else:
        verify = block_verify if verifier == "block" else select_verifier(verifier)
    on_random_noise = reference.verify if verifier == "triton" else verify
    greedy = SamplingParams(0.0)
    for seed in range(12):
        tree, logits, noise = make_case(seed, 4, 6, 50, mode, greedy, "chain" if verifier == "block" else "bushy")
        fixed = VerifyNoise.draw(RequestRNG(torch.arange(4)).select(torch.arange(4)), 6, greedy=True)
        fixed = fixed.to(DEVICE)
        drawn, constant = on_random_noise(tree, logits, greedy, noise), verify(tree, logits, greedy, fixed)
        for field in dataclasses.fields(VerifyResult):
            assert torch.equal(getattr(drawn, field.name), getattr(constant, field.name)), (seed, field.name)
