"""Traversal verification (verifiers/traversal.py): exact at sequence level on chains, static
sampled trees (IID and without replacement) and deterministic trees, greedy at temperature 0,
block verification on chains coin for coin, more tokens than token-level verification on sampled
trees, refusal of sampled trees whose shape is not static, and two plausible mistakes rejected by
the same statistical test."""

from __future__ import annotations

import dataclasses

import pytest
from sequence_stats import ALPHA, NEGATIVE_P
from test_exactness import DET, IID, T07, T1, TOPK, TOPP, WOR, run, synthetic

from drafters.synthetic import SyntheticDrafter
from specdec.decode import SpecDecoder
from specdec.sampling import SamplingParams
from specdec.synthetic import SyntheticTarget
from verifiers import block, reference, traversal

EXACT_CASES = {
    "chain3-iid-T1": (synthetic((1, 1, 1), IID), T1, 5, 4),
    "tree2-iid-T1": (synthetic((2,), IID), T1, 6, 3),  # depth 1: RRS
    "tree21-iid-T1": (synthetic((2, 1), IID), T1, 6, 3),
    "tree22-iid-T0.7": (synthetic((2, 2), IID), T07, 6, 3),
    "tree22-iid-topk": (synthetic((2, 2), IID), TOPK, 6, 3),
    "tree22-iid-topp": (synthetic((2, 2), IID), TOPP, 6, 3),
    "tree33-wor-T1": (synthetic((3, 3), WOR), T1, 6, 3),
    "tree221-wor-T0.7": (synthetic((2, 2, 1), WOR), T07, 5, 4),
    "tree33-wor-topk": (synthetic((3, 3), WOR), TOPK, 6, 3),  # width 3 = top_k: q' exhausts
    "tree22-det-T1": (synthetic((2, 2), DET), T1, 6, 3),
    "tree22-det-topp": (synthetic((2, 2), DET), TOPP, 6, 3),
}


# the fast tier keeps a without-replacement tree (the i.i.d. rule's representative is token-level
# verification's, tests/test_exactness.py); the heaviest case is slow, the others statistical
# (tests/test_verifier_power.py holds traversal to TV 0.002 there too)
FAST_CASES = {"tree33-wor-T1"}


def tier(case: str):
    if case in FAST_CASES:
        return case
    return pytest.param(case, marks=pytest.mark.slow if case == "tree221-wor-T0.7" else pytest.mark.statistical)


@pytest.mark.parametrize("case", [tier(c) for c in EXACT_CASES])
def test_traversal_verification_reproduces_the_target_distribution(case):
    factory, sampling, vocab, length = EXACT_CASES[case]
    verdict = run(factory, sampling, verifier=traversal.verify, vocab=vocab, length=length)
    print(case, verdict)
    assert verdict.impossible == 0 and verdict.p_value > ALPHA, f"{case}: {verdict}"


def generate(verifier, branching, mode, sampling, requests=3000, seed=4):
    target = SyntheticTarget(vocab_size=8, sharpness=1.5, seed=0)  # the drafter's seed (1) differs: q != p
    decoder = SpecDecoder(target, SyntheticDrafter(target, branching, mode, 0.5), verifier)
    return decoder.generate([[1, 2]] * requests, 12, sampling, seed=seed)


def test_on_chains_it_is_block_verification_coin_for_coin():
    for mode in (IID, DET):
        ours, theirs = generate(traversal.verify, (1, 1, 1), mode, T1, 400), generate(block.verify, (1, 1, 1), mode, T1, 400)
        assert ours.outputs == theirs.outputs


def test_it_keeps_more_than_token_level_verification_on_sampled_trees():
    token_level = generate(reference.verify, (2, 2, 1), IID, T1).stats.tau
    joint = generate(traversal.verify, (2, 2, 1), IID, T1).stats.tau
    print("tau token-level", token_level, "traversal", joint)
    assert joint > token_level * 1.02  # the paper reports a few percent; 3000 x 12 tokens resolve it


def test_greedy_and_ragged_trees_are_plain_decoding():
    target = SyntheticTarget(vocab_size=16, sharpness=2.0, seed=3)
    prompts = [[1, 2, 3], [4], [5, 6]]
    greedy = SamplingParams(0.0)
    plain = SpecDecoder(target, None, reference.verify).generate(prompts, 20, greedy, seed=0)
    assert SpecDecoder(target, None, traversal.verify).generate(prompts, 20, greedy, seed=0).outputs == plain.outputs
    for mode in (IID, WOR, DET):
        drafter = SyntheticDrafter(target, (2, 2, 1), mode, 0.5)
        out = SpecDecoder(target, drafter, traversal.verify).generate(prompts, 20, greedy, seed=0)
        assert out.outputs == plain.outputs


class Dynamic:
    """The synthetic drafter's trees without the static-shape promise."""

    def __init__(self, inner: SyntheticDrafter) -> None:
        self.inner, self.target_layers = inner, ()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, ctx):
        return dataclasses.replace(self.inner.propose(ctx), static_shape=False)


def test_sampled_trees_without_a_static_shape_are_refused_and_chains_are_not():
    target = SyntheticTarget(vocab_size=8, seed=0)
    decoder = SpecDecoder(target, Dynamic(SyntheticDrafter(target, (2, 1), IID, 0.5)), traversal.verify)
    with pytest.raises(ValueError, match="static_shape.*drafter.shape=static"):
        decoder.generate([[1, 2]], 4, T1, seed=0)
    for branching, mode, sampling in [((1, 1), IID, T1), ((2, 1), DET, T1), ((2, 1), IID, SamplingParams(0.0))]:
        drafter = Dynamic(SyntheticDrafter(target, branching, mode, 0.5))
        assert SpecDecoder(target, drafter, traversal.verify).generate([[1, 2]], 6, sampling, seed=0).stats.tau >= 1


# ----- negative controls: each must be rejected by the same test -----


def test_control_weight_not_renewed_after_a_failed_child_is_rejected(monkeypatch):
    """Keeping a node's weight w after a child's subtree failed, instead of r / (1 - w + r)."""
    monkeypatch.setattr(traversal, "_renewed_weight", lambda parent_weight, mass: parent_weight)
    verdict = run(synthetic((1, 1), IID), T1, verifier=traversal.verify, vocab=5, length=3)
    print(verdict)
    assert verdict.p_value < NEGATIVE_P or verdict.impossible > 0, verdict


def test_control_child_weight_without_its_parents_is_rejected(monkeypatch):
    """w_c = min(1, P(c) / Q_c(c)) token by token instead of the running product."""
    monkeypatch.setattr(traversal, "_child_weight", lambda parent_weight, p, q: (p / q).clamp(max=1.0))
    verdict = run(synthetic((2, 1), IID), T1, verifier=traversal.verify, vocab=5, length=3)
    print(verdict)
    assert verdict.p_value < NEGATIVE_P or verdict.impossible > 0, verdict


@pytest.mark.parametrize("name", [pytest.param("block", marks=pytest.mark.integration), "traversal"])
def test_specdec_run_takes_the_joint_verifiers(tmp_path, name):
    from test_run_cli import run_in_process

    results = run_in_process(tmp_path, ["experiment=synthetic", f"verifier={name}", "sampling.temperature=1",
                                        "workload.num_prompts=3", "max_new_tokens=12", "logger=none"])
    assert results["config"]["verifier"]["name"] == name and results["tau"] > 1
