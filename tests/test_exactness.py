"""Losslessness, proved statistically through the whole decode loop on the synthetic target.

Every exact rule must pass the sequence-level chi-square test; every known-wrong rule (negative
control) must fail the same test. A test that cannot fail proves nothing.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from sequence_stats import ALPHA, NEGATIVE_P, required_samples, sequence_verdict

from drafters.base import StatelessDrafter
from drafters.synthetic import SyntheticDrafter
from specdec.decode import SpecDecoder
from specdec.protocols import VerifyResult
from specdec.sampling import SamplingParams, probabilities
from specdec.synthetic import SyntheticTarget, tree_context
from specdec.tree import SiblingMode
from verifiers import reference
from verifiers.reference import draw_from

PROMPT = [1, 2]
IID, WOR, DET = SiblingMode.SAMPLED_IID, SiblingMode.SAMPLED_WOR, SiblingMode.DETERMINISTIC
T07, T1, T15 = SamplingParams(0.7), SamplingParams(1.0), SamplingParams(1.5)
TOPK, TOPP = SamplingParams(1.0, top_k=3), SamplingParams(1.2, top_p=0.8)


def run(drafter_factory, sampling, verifier=reference.verify, vocab=6, length=3, tv=0.02, seed=0):
    target = SyntheticTarget(vocab_size=vocab, sharpness=1.5, seed=seed)
    drafter = drafter_factory(target)
    samples = required_samples(vocab**length, tv)
    exact = target.sequence_distribution(PROMPT, length, sampling)
    decoder = SpecDecoder(target, drafter, verifier)
    return sequence_verdict(decoder, exact, PROMPT, length, vocab, sampling, samples, seed=seed)


def synthetic(branching, mode, divergence=0.5):
    return lambda target: SyntheticDrafter(target, branching, mode, divergence)


EXACT_CASES = {
    # chains (Leviathan / Chen), k = 1..4; depth 3-4 needs L = 4 tokens to be exercised
    "chain1-iid-T1": (synthetic((1,), IID), T1, 6, 3),
    "chain2-iid-T1": (synthetic((1, 1), IID), T1, 6, 3),
    "chain3-iid-T1": (synthetic((1, 1, 1), IID), T1, 5, 4),
    "chain4-iid-T1": (synthetic((1, 1, 1, 1), IID), T1, 5, 4),
    # SpecInfer multi-round trees, duplicates possible
    "tree22-iid-T0.7": (synthetic((2, 2), IID), T07, 6, 3),
    "tree22-iid-T1": (synthetic((2, 2), IID), T1, 6, 3),
    "tree22-iid-T1.5": (synthetic((2, 2), IID), T15, 6, 3),
    "tree22-iid-topk": (synthetic((2, 2), IID), TOPK, 6, 3),
    "tree22-iid-topp": (synthetic((2, 2), IID), TOPP, 6, 3),
    # Sequoia / RSD without replacement
    "tree33-wor-T1": (synthetic((3, 3), WOR), T1, 6, 3),
    "tree333-wor-T0.7": (synthetic((3, 3, 3), WOR), T07, 5, 4),
    "tree33-wor-topk": (synthetic((3, 3), WOR), TOPK, 6, 3),  # width 3 = top_k: q' exhausts
    "tree33-wor-topp": (synthetic((3, 3), WOR), TOPP, 6, 3),
    # top-k candidates, point-mass rule
    "top2-det-T1": (synthetic((2, 2), DET), T1, 6, 3),
    "top3-det-T1.5": (synthetic((3, 3), DET), T15, 6, 3),
    "top2-det-topp": (synthetic((2, 2), DET), TOPP, 6, 3),
}


# the fast tier keeps one case per rule (a chain, an i.i.d. tree, without replacement, point masses);
# the heaviest case is slow, the others statistical
FAST_CASES = {"chain2-iid-T1", "tree22-iid-T1", "tree33-wor-T1", "top2-det-T1"}


def tier(case: str):
    if case in FAST_CASES:
        return case
    return pytest.param(case, marks=pytest.mark.slow if case == "tree333-wor-T0.7" else pytest.mark.statistical)


@pytest.mark.parametrize("case", [tier(c) for c in EXACT_CASES])
def test_exact_rule_reproduces_target_distribution(case):
    factory, sampling, vocab, length = EXACT_CASES[case]
    verdict = run(factory, sampling, vocab=vocab, length=length)
    print(case, verdict)
    assert verdict.impossible == 0
    assert verdict.p_value > ALPHA, f"{case}: {verdict}"


class Relabelled(StatelessDrafter):
    """A drafter whose trees are passed on under another SiblingMode (candidates unchanged)."""

    def __init__(self, inner: SyntheticDrafter, mode: SiblingMode, keep_probs: bool = True) -> None:
        self.inner, self.mode, self.keep_probs = inner, mode, keep_probs

    def propose(self, ctx):
        tree = self.inner.propose(ctx)
        if self.keep_probs and tree.draft_probs is None:
            # a DETERMINISTIC tree carries no q: for a depth-1 tree every node's q is q(.|root),
            # which an IID draft of the same shape carries on every node
            assert len(self.inner.branching) == 1, "q rows are only shape-independent at depth 1"
            self.inner.mode = IID
            try:
                probs = self.inner.propose(ctx).draft_probs
            finally:
                self.inner.mode = DET
            tree = dataclasses.replace(tree, draft_probs=probs)
        return dataclasses.replace(tree, mode=self.mode, draft_probs=tree.draft_probs if self.keep_probs else None)


@pytest.mark.statistical
def test_sampled_candidates_under_the_point_mass_rule_are_exact():
    """Candidates drawn i.i.d. (duplicates included) but verified by the DETERMINISTIC rule: exact,
    because the candidate set never depends on the verification coins. The duplicate of a rejected
    token has p' = 0 afterwards, which is the correct de-duplication."""
    verdict = run(lambda t: Relabelled(SyntheticDrafter(t, (3, 2), IID), DET, keep_probs=False), T1)
    print(verdict)
    assert verdict.impossible == 0 and verdict.p_value > ALPHA, verdict


# ----- negative controls: each must be rejected by the same test (the fast tier keeps the first) -----


def test_control_residual_without_relu_is_rejected(monkeypatch):
    """p' <- norm(p' - q) without relu: the second sibling is then tested against a residual
    normalised by sum|p - q| (twice the right mass)."""
    original = reference.normalise

    def no_relu_normalise(x, empty=None):
        return x / x.abs().sum(-1, keepdim=True).clamp(min=1e-300)

    real_clamp = torch.Tensor.clamp

    def verify_without_relu(tree, logits, sampling, noise):
        # the reference applies relu as .clamp(min=0.0) on (p' - q); undo it for this call only
        def clamp(self, *args, **kwargs):
            if kwargs.get("min") == 0.0 and not args and self.dtype == torch.float64:
                return self
            return real_clamp(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "clamp", clamp)
        monkeypatch.setattr(reference, "normalise", no_relu_normalise)
        try:
            return reference.verify(tree, logits, sampling, noise)
        finally:
            monkeypatch.setattr(torch.Tensor, "clamp", real_clamp)
            monkeypatch.setattr(reference, "normalise", original)

    verdict = run(synthetic((3, 2), IID), T1, verifier=verify_without_relu)
    print(verdict)
    assert verdict.p_value < NEGATIVE_P or verdict.impossible > 0, verdict


@pytest.mark.statistical
def test_control_deterministic_drafts_with_pq_test_are_rejected():
    """Top-k candidates verified as if they were samples from q (the forbidden combination)."""
    verdict = run(lambda t: Relabelled(SyntheticDrafter(t, (2,), DET), IID), T1)
    print(verdict)
    assert verdict.p_value < NEGATIVE_P or verdict.impossible > 0, verdict


@pytest.mark.statistical
def test_control_bonus_token_from_draft_distribution_is_rejected():
    """After full acceptance the bonus token must come from p, not from the drafter's q."""
    holder = {}

    def factory(target):
        holder["drafter"] = SyntheticDrafter(target, (1,), IID)
        holder["target"] = target
        return holder["drafter"]

    def verify_with_q_bonus(tree, logits, sampling, noise):
        result = reference.verify(tree, logits, sampling, noise)
        drafter, target = holder["drafter"], holder["target"]
        # q at the leaf: the drafter's distribution after the (only) node, at its position
        context = tree_context(tree, target._history, target._lengths, target.order)[:, 1]
        q = probabilities(drafter.draft_logits(context, target._lengths + 1), sampling).double()
        from_q = draw_from(q, noise.final)
        all_accepted = result.num_accepted == tree.num_nodes
        return VerifyResult(
            result.accepted_nodes,
            result.num_accepted,
            torch.where(all_accepted & (tree.num_nodes > 0), from_q, result.next_token),
        )

    verdict = run(factory, T1, verifier=verify_with_q_bonus)
    print(verdict)
    assert verdict.p_value < NEGATIVE_P or verdict.impossible > 0, verdict


def cumulative_single_coin_verify(tree, target_logits, sampling, noise):
    """SGLang-style rule for point-mass candidates: one coin per node, accept the first sibling
    whose cumulative target mass exceeds it. Exact without duplicates; a duplicate sibling has its
    mass counted twice, which biases the result."""
    batch, n = tree.tokens.shape
    probs = probabilities(target_logits, sampling).double()
    valid = tree.node_valid()
    current = torch.full((batch,), -1)
    num_accepted = torch.zeros(batch, dtype=torch.int64)
    accepted = torch.full((batch, n), -1)
    coin = noise.uniforms[:, 0].clone()  # one coin for the current sibling group
    cumulative = torch.zeros(batch, dtype=torch.float64)
    tried = torch.zeros_like(probs[:, 0])  # [B, V] mass of candidates already tried
    rows = torch.arange(batch)
    for i in range(n):
        candidate = valid[:, i] & (tree.parents[:, i] == current)
        p = probs[rows, current + 1]
        cumulative = cumulative + torch.where(candidate, p.gather(1, tree.tokens[:, i : i + 1])[:, 0], 0.0)
        accept = candidate & (coin < cumulative)
        tried = torch.where((candidate & ~accept)[:, None], tried.scatter(1, tree.tokens[:, i : i + 1], 1.0), tried)
        accepted[rows[accept], num_accepted[accept]] = i
        num_accepted += accept
        current = torch.where(accept, i, current)
        coin = torch.where(accept, noise.uniforms[:, i], coin)
        cumulative = torch.where(accept, 0.0, cumulative)
        tried = torch.where(accept[:, None], 0.0, tried)
    residual = probs[rows, current + 1] * (1 - tried)
    return VerifyResult(accepted, num_accepted, draw_from(residual, noise.final))


@pytest.mark.statistical
def test_control_cumulative_coin_counting_duplicates_twice_is_rejected():
    verdict = run(
        lambda t: Relabelled(SyntheticDrafter(t, (3, 2), IID), DET, keep_probs=False),
        T1,
        verifier=cumulative_single_coin_verify,
    )
    print(verdict)
    assert verdict.p_value < NEGATIVE_P or verdict.impossible > 0, verdict


# ----- Token Recycling (drafters/recycling.py): trees from the target's logits over earlier trees -----

# every token of the vocabulary of 5, so that prompt-seeded rows draft from the first step and the
# target's own candidates (observed after it) from the second
RECYCLING_PROMPT = [1, 2, 3, 4, 0, 2]


@pytest.mark.parametrize(
    "options,sampling",
    [pytest.param({}, T1, marks=pytest.mark.statistical), pytest.param({"shared": True}, T1, marks=pytest.mark.statistical),
     pytest.param({"shared": True, "top_k": 2, "total_tokens": 6}, TOPP, marks=pytest.mark.statistical)],
    ids=["per-request-T1", "shared-T1", "shared-topp"],
)
def test_token_recycling_is_exact(options, sampling):
    """The matrix is a function of committed text and drafted tokens, never of the coins of the step
    that verifies the tree it fills; shared, it also carries every other request's past."""
    from drafters.base import build

    vocab, length = 5, 4  # 4 tokens: a first step may accept 3 drafts
    target = SyntheticTarget(vocab_size=vocab, sharpness=1.5, seed=0)
    decoder = SpecDecoder(target, build("recycling", target, **options), reference.verify)
    exact = target.sequence_distribution(RECYCLING_PROMPT, length, sampling)
    samples = required_samples(vocab**length, 0.02)
    verdict = sequence_verdict(decoder, exact, RECYCLING_PROMPT, length, vocab, sampling, samples)
    print(options, verdict)
    assert verdict.impossible == 0 and verdict.p_value > ALPHA, verdict
    # the test means something only if the drafts are accepted often
    drafted = SpecDecoder(target, build("recycling", target, **options), reference.verify)
    assert drafted.generate([RECYCLING_PROMPT] * 200, length, sampling).stats.tau > 1.2


# ----- lookahead decoding (drafters/lookahead.py) -----

LOOKAHEAD_EXACTNESS = {"window": 3, "ngram": 3, "guesses": 2}  # vocab 3, 5 tokens: guesses in ~1/4 of steps


@pytest.mark.statistical
@pytest.mark.parametrize("sampling", [T1, TOPP], ids=["T1", "topp"])
def test_lookahead_is_exact(sampling):
    """The Jacobi window's trajectories and the pool's guesses, one DETERMINISTIC trie verified by
    the point-mass rule; the window moves with the target's logits over each step's tree (observe)."""
    from drafters.lookahead import LookaheadDrafter

    verdict = run(lambda target: LookaheadDrafter(target, **LOOKAHEAD_EXACTNESS), sampling, vocab=3, length=5)
    print(verdict)
    assert verdict.impossible == 0 and verdict.p_value > ALPHA, verdict


@pytest.mark.slow  # heavy: CI runs it after the default suite
def test_adaptive_union_is_exact():
    """The adaptive union (drafters/union.py, adaptive=true): each request's tree at a step follows
    its members' outcomes at earlier steps, settled in commit after those steps' coins, never the
    coins of the step that verifies it. Deterministic members without confidence (P0 = the prior)
    and at most 2 nodes a step, so a sequence takes several steps and the second depends on the
    first's outcomes (checked: requests enter it with different records)."""
    from drafters.union import UnionDrafter

    top2 = {"name": "synthetic", "branching": (2, 1), "mode": "deterministic"}
    chain = {"name": "synthetic", "branching": (1, 1, 1), "mode": "deterministic", "divergence": 0.8, "seed": 2}
    records = []  # per propose: the distinct (H + w) / (E + w) of member 0's depth-1 nodes over requests

    def factory(target):
        # the 2nd row costs more than the 1st: whether a second node pays depends on the P's
        union = UnionDrafter(target, [top2, chain], costs=[1.0, 1.0, 1.3], max_rows=3, adaptive=True, calibration=[])
        propose = union.propose

        def tracked(ctx):
            records.append({round(union._factor(state, 0, 1), 6) for state in union._states})
            return propose(ctx)

        union.propose = tracked
        return union

    verdict = run(factory, T1)
    print(verdict)
    assert len(records) >= 2 and len(records[0]) == 1 and len(records[1]) > 1, records[:2]
    assert verdict.impossible == 0 and verdict.p_value > ALPHA, verdict
