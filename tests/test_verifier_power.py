"""The verifier's first token, with the power to see small biases, against distributions computed
without any of the code under test.

The sequence-level tests (test_exactness.py) run the whole loop and can afford ~10^5 samples, which
sees total variation ~0.02; a subtle rule error (without-replacement drafts verified by the i.i.d.
rule) moves the first token by a few thousandths. Here one verify call is one sample: a small tree
over V = 6 (three children of the root; for block and traversal verification also a chain and a
two-level tree), millions of rows at once, so TV 0.002 is detected with 90% power.
The exact distribution is a float64 numpy transform written from the definitions (temperature, top-k,
top-p), never ``specdec.sampling``'s transforms, so a bug there is caught rather than copied.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from sequence_stats import ALPHA, NEGATIVE_P, required_samples

from specdec.noise import GivenNoise, RequestRNG, VerifyNoise
from specdec.sampling import SamplingParams, probabilities, target_probabilities
from specdec.tree import DraftTree, SiblingMode
from verifiers import block, reference, traversal, triton_tree

IID, WOR, DET = SiblingMode.SAMPLED_IID, SiblingMode.SAMPLED_WOR, SiblingMode.DETERMINISTIC
VOCAB, TV = 6, 0.002
TARGET_LOGITS = torch.tensor([1.6, 1.1, 0.9, 0.2, -0.4, -1.3])  # [V]
DRAFT_LOGITS = torch.tensor([0.3, 1.5, 0.8, 1.2, -0.2, -1.0])  # [V] a drafter that disagrees
CHUNK = 1 << 19


def processed(logits: np.ndarray, params: SamplingParams) -> np.ndarray:  # [V] float64 -> [V]
    """The target's distribution by definition, one token at a time: greedy is the first argmax;
    top-k keeps a token unless k others are strictly more likely; top-p keeps a token while the
    tokens strictly more likely than it hold less than top_p (so ties are kept or dropped together)."""
    logits = np.asarray(logits, dtype=np.float64)
    if params.temperature == 0:
        return np.eye(len(logits))[int(np.argmax(logits))]
    scaled = logits / params.temperature
    keep = np.ones(len(logits), dtype=bool)
    if params.top_k:
        keep = np.array([(scaled > s).sum() < params.top_k for s in scaled])
    weights = np.where(keep, np.exp(scaled - scaled[keep].max()), 0.0)
    probs = weights / weights.sum()
    if params.top_p < 1:
        keep = np.array([probs[probs > p].sum() < params.top_p for p in probs])
        probs = np.where(keep, probs, 0.0) / probs[keep].sum()
    return probs


STAR, CHAIN, TREE = (-1, -1, -1), (-1, 0, 1), (-1, 0, 0, -1)  # parents: depth 1; a chain; two levels


def draw_tokens(mode: SiblingMode, q: torch.Tensor, parents: tuple[int, ...], batch: int,
                generator: torch.Generator) -> torch.Tensor:  # q: [V] -> [B, N]
    """Each sibling group's tokens from q (the drafter's q is the same at every node here): i.i.d.,
    without replacement, or its top candidates, the same in every row."""
    tokens = torch.empty(batch, len(parents), dtype=torch.int64)
    for parent in sorted(set(parents)):
        group = [i for i, own in enumerate(parents) if own == parent]
        if mode is DET:
            tokens[:, group] = q.topk(len(group)).indices.expand(batch, len(group))
        else:
            drawn = torch.multinomial(q.expand(batch, VOCAB), len(group), replacement=mode is IID, generator=generator)
            tokens[:, group] = drawn
    return tokens


def first_tokens(mode: SiblingMode, rule: SiblingMode, params: SamplingParams, samples: int, seed: int,
                 verify=reference.verify, device: str = "cpu", parents: tuple[int, ...] = STAR) -> np.ndarray:
    """Counts [V] of the first token a step emits: a tree of ``parents`` (each node's parent, -1 =
    the root) drafted under ``mode`` from q, handed to ``verify`` (the reference unless told)
    labelled ``rule``, on ``device``. The target is the same at every node, so every path's first
    token should follow it."""
    q = probabilities(DRAFT_LOGITS, params if not params.greedy else SamplingParams(1.0))  # [V]
    nodes = len(parents)
    counts = np.zeros(VOCAB, dtype=np.int64)
    generator = torch.Generator().manual_seed(seed)
    for start in range(0, samples, CHUNK):
        batch = min(CHUNK, samples - start)
        tokens = draw_tokens(mode, q, parents, batch, generator).to(device)
        tree = DraftTree(
            tokens=tokens,  # [B, N]
            parents=torch.tensor(parents, device=device).expand(batch, nodes),  # [B, N]
            draft_probs=None if rule is DET else q.to(device).expand(batch, nodes, VOCAB),  # [B, N, V]
            num_nodes=torch.full((batch,), nodes, device=device),  # [B]
            mode=rule,
            static_shape=True,  # the shape is fixed before any token is drawn
        )
        logits = TARGET_LOGITS.to(device).expand(batch, nodes + 1, VOCAB)  # [B, N+1, V]
        seeds = torch.arange(start, start + batch, device=device) + (seed << 32)
        noise = VerifyNoise.draw(RequestRNG(seeds), nodes)
        result = verify(tree, logits, params, noise)
        accepted_token = tokens.gather(1, result.accepted_nodes[:, :1].clamp(min=0))[:, 0]
        first = torch.where(result.num_accepted > 0, accepted_token, result.next_token)  # [B]
        counts += np.bincount(first.cpu().numpy(), minlength=VOCAB)
    return counts


def p_value(counts: np.ndarray, exact: np.ndarray) -> tuple[float, float]:
    """(chi-square p-value over the support, TV); any count outside the support is a p-value of 0."""
    samples = counts.sum()
    tv = 0.5 * float(np.abs(counts / samples - exact).sum())
    if counts[exact == 0].any():
        return 0.0, tv
    support = exact > 0
    if support.sum() == 1:  # a point mass: every sample on it is all there is to check
        return 1.0, tv
    return float(chisquare(counts[support], exact[support] * samples).pvalue), tv


CASES = {
    "iid-T1": (IID, SamplingParams(1.0)),
    "wor-T1": (WOR, SamplingParams(1.0)),
    "det-T1": (DET, SamplingParams(1.0)),
    "wor-T0.7-topk4": (WOR, SamplingParams(0.7, top_k=4)),
    "iid-T1.3-topp": (IID, SamplingParams(1.3, top_p=0.85)),
    "wor-greedy": (WOR, SamplingParams(0.0)),
}


# Every case runs at full power (TV) with the statistical tests. The fast tier runs the rule it is
# easiest to get subtly wrong (without replacement) and the control below at FAST_TV, a sixth of the
# samples: the control's bias (~0.0076) is still rejected there by many orders of magnitude.
FAST_TV = 0.005


def tiers(cases, fast: set[str]) -> list:
    full = [pytest.param(case, TV, marks=pytest.mark.statistical) for case in cases]
    return [pytest.param(case, FAST_TV, id=f"{case}-fast") for case in cases if case in fast] + full


@pytest.mark.parametrize("case,tv", tiers(CASES, {"wor-T1"}))
def test_first_token_is_the_target_distribution(case, tv):
    mode, params = CASES[case]
    exact = processed(TARGET_LOGITS.numpy(), params)
    samples = 10_000 if params.greedy else required_samples(int((exact > 0).sum()), tv)
    counts = first_tokens(mode, mode, params, samples, seed=len(case))
    p, tv = p_value(counts, exact)
    print(case, f"p={p:.3g} TV={tv:.5f} N={samples}")
    assert p > ALPHA, f"{case}: p={p:.3g} TV={tv:.5f} N={samples}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_first_token_through_the_compiled_kernel(case):
    """The same power through the Triton kernel compiled for a GPU (seconds there; the interpreter
    on CPU would take hours), so the kernel is held to the definition, not only to the reference."""
    mode, params = CASES[case]
    exact = processed(TARGET_LOGITS.numpy(), params)
    samples = 10_000 if params.greedy else required_samples(int((exact > 0).sum()), TV)
    counts = first_tokens(mode, mode, params, samples, seed=len(case) + 1, verify=triton_tree.verify, device="cuda")
    p, tv = p_value(counts, exact)
    print(case, f"p={p:.3g} TV={tv:.5f} N={samples}")
    assert p > ALPHA, f"{case}: p={p:.3g} TV={tv:.5f} N={samples}"


def wrong_rule_tv(params: SamplingParams) -> float:
    """Exact TV between the target and the first token when without-replacement children are
    verified by the i.i.d. rule, by enumerating the ordered draws (independent of the verifier)."""
    p = processed(TARGET_LOGITS.numpy(), params)
    q = processed(DRAFT_LOGITS.numpy(), params)
    law = np.zeros(VOCAB)
    for draw in itertools.permutations(range(VOCAB), len(STAR)):
        weight, left = 1.0, 1.0
        for x in draw:
            weight *= q[x] / left
            left -= q[x]
        residual, reach = p.copy(), weight
        for x in draw:
            accept = min(1.0, residual[x] / q[x])
            law[x] += reach * accept
            reach *= 1 - accept
            residual = np.maximum(residual - q, 0.0)
            residual /= residual.sum()
        law += reach * residual
    return 0.5 * float(np.abs(law - p).sum())


@pytest.mark.parametrize("verifier,detectable", [("reference", FAST_TV), pytest.param("reference", TV, marks=pytest.mark.statistical),
                                                 pytest.param("traversal", TV, marks=pytest.mark.statistical)])
def test_control_without_replacement_drafts_under_the_iid_rule_are_rejected(verifier, detectable):
    """On a depth-1 tree traversal verification is RRS with weight 1 at the root, so the control's
    bias is the same there."""
    params = SamplingParams(1.0)
    bias = wrong_rule_tv(params)
    assert bias > 1.5 * detectable, f"the control's bias {bias:.4f} must lie well above the detectable {detectable}"
    exact = processed(TARGET_LOGITS.numpy(), params)
    samples = required_samples(VOCAB, detectable)
    verify = traversal.verify if verifier == "traversal" else reference.verify
    p, tv = p_value(first_tokens(WOR, IID, params, samples, seed=7, verify=verify), exact)
    print(f"control: p={p:.3g} TV={tv:.5f} (exact bias {bias:.5f}) N={samples}")
    assert p < NEGATIVE_P and math.isclose(tv, bias, abs_tol=detectable), (p, tv, bias)


JOINT_CASES = {
    # block verification judges a chain jointly; its first token must still follow the target
    "block-chain-iid-T1": (block.verify, CHAIN, IID, SamplingParams(1.0)),
    "block-chain-det-T1": (block.verify, CHAIN, DET, SamplingParams(1.0)),
    "block-chain-iid-T1.3-topp": (block.verify, CHAIN, IID, SamplingParams(1.3, top_p=0.85)),
    # traversal verification: depth 1 (RRS with weights), a chain (block verification) and two levels
    "traversal-star-iid-T1": (traversal.verify, STAR, IID, SamplingParams(1.0)),
    "traversal-star-wor-T1": (traversal.verify, STAR, WOR, SamplingParams(1.0)),
    "traversal-star-det-T1": (traversal.verify, STAR, DET, SamplingParams(1.0)),
    "traversal-tree-wor-T0.7-topk4": (traversal.verify, TREE, WOR, SamplingParams(0.7, top_k=4)),
    "traversal-chain-iid-T1": (traversal.verify, CHAIN, IID, SamplingParams(1.0)),
}


@pytest.mark.statistical
@pytest.mark.parametrize("case", JOINT_CASES)
def test_first_token_through_the_joint_verifiers(case):
    """The power of the tests above (TV 0.002) through block and traversal verification: their
    sequence-level tests see only TV ~0.02, and losing traversal's without-replacement update would
    move the first token by less than 0.01."""
    verify, parents, mode, params = JOINT_CASES[case]
    exact = processed(TARGET_LOGITS.numpy(), params)
    samples = required_samples(int((exact > 0).sum()), TV)
    counts = first_tokens(mode, mode, params, samples, seed=len(case) + 2, verify=verify, parents=parents)
    p, tv = p_value(counts, exact)
    print(case, f"p={p:.3g} TV={tv:.5f} N={samples}")
    assert p > ALPHA, f"{case}: p={p:.3g} TV={tv:.5f} N={samples}"


SETTINGS = [
    SamplingParams(0.0),
    SamplingParams(1.0),
    SamplingParams(0.6),
    SamplingParams(1.0, top_k=3),
    SamplingParams(0.8, top_p=0.7),
    SamplingParams(1.2, top_k=5, top_p=0.9),
]


@pytest.mark.parametrize("transform", [probabilities, target_probabilities], ids=lambda f: f.__name__)
@pytest.mark.parametrize("params", SETTINGS, ids=str)
def test_probabilities_agree_with_the_definition(params, transform):
    """The drafters' ``probabilities`` (float32) and the verifiers' ``target_probabilities``
    (float64, its own exp) against the definition (float64) on random rows, many with tied logits
    (rounded to a coarse grid), which is where top-k and top-p cut-offs are ambiguous."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 12, generator=generator) * 2  # [R, V]
    logits[32:] = (logits[32:] * 2).round() / 2
    got = transform(logits, params).double().numpy()
    for row, want in zip(got, (processed(x, params) for x in logits.numpy())):
        assert np.array_equal(row > 0, want > 0), (row, want)
        np.testing.assert_allclose(row, want, rtol=1e-5, atol=1e-7)


def test_a_rejection_that_leaves_no_residual_keeps_the_target():
    """q = the verifiers' p rounded up to float32, and one float32 ulp above it at the drafted token:
    a coin close enough to 1 rejects it, and relu(p - q) has no mass. Every exact verifier then
    draws the final token from p (not from an empty row, where the draw would give token 0 whatever
    p says)."""
    params = SamplingParams(1.0)
    p = target_probabilities(TARGET_LOGITS, params)  # [V] float64
    drafted = 1
    q = p.float()
    q = torch.where(q.double() < p, torch.nextafter(q, torch.tensor(1.0)), q)  # [V] float32, >= p
    q[drafted] = torch.nextafter(q[drafted], torch.tensor(1.0))
    assert torch.all(q.double() >= p) and q[drafted] > p[drafted]
    tree = DraftTree(
        tokens=torch.tensor([[drafted]]),  # [1, 1]
        parents=torch.tensor([[-1]]),  # [1, 1]
        draft_probs=q[None, None],  # [1, 1, V]
        num_nodes=torch.tensor([1]),
        mode=IID,
    )
    logits = TARGET_LOGITS.expand(1, 2, VOCAB)  # [1, 2, V]
    final = 0.9  # far from every boundary of p's cumulative mass, so any inverse CDF agrees
    noise = GivenNoise(torch.tensor([[1 - 2.0**-53]], dtype=torch.float64), torch.tensor([final], dtype=torch.float64))
    mass = p.double().numpy()
    want = int(np.searchsorted(np.cumsum(mass), final * mass.sum(), side="right"))
    assert want != 0  # the token a draw from an empty row would give
    for verifier in (reference.verify, triton_tree.verify, block.verify, traversal.verify):
        result = verifier(tree, logits, params, noise)
        assert result.num_accepted.tolist() == [0], verifier.__module__
        assert result.next_token.tolist() == [want], f"{verifier.__module__}: {result.next_token.tolist()}"
