"""Typical acceptance (verifiers/lossy.py): greedy at temperature 0, and MEASURABLY lossy above it.

The lossy verifier must FAIL the same sequence-level test the exact verifiers pass (tests/
test_exactness.py): if it passed, the test would be blind to this kind of error.
"""

from __future__ import annotations

import pytest
import torch
from sequence_stats import NEGATIVE_P, required_samples, sequence_verdict

from drafters.synthetic import SyntheticDrafter
from specdec.decode import SpecDecoder
from specdec.noise import GivenNoise
from specdec.sampling import SamplingParams
from specdec.synthetic import SyntheticTarget
from specdec.tree import SiblingMode, tree_from_parents
from verifiers import reference
from verifiers.lossy import TypicalAcceptanceLossy
from verifiers.select import select_verifier

PROMPT = [1, 2]
DET = SiblingMode.DETERMINISTIC


def test_selected_only_by_its_lossy_name():
    verifier = select_verifier("typical_lossy")
    assert isinstance(verifier, TypicalAcceptanceLossy) and verifier.lossy
    assert not isinstance(select_verifier("auto"), TypicalAcceptanceLossy)


def test_settings_come_from_the_config_and_bad_ones_are_refused():
    from hydra import compose, initialize_config_dir

    from experiments import cli
    from experiments.run import build, schema
    from specdec import target_loader

    def verifier(*overrides):
        with initialize_config_dir(config_dir=str(schema.CONFIG_DIR), version_base="1.3"):
            cfg = compose(config_name="config", overrides=["verifier=typical_lossy", *overrides])
        settings = schema.checked_settings(cfg)
        return build.make_verifier(settings.verifier, target_loader.target_device(settings.target))

    assert verifier() == TypicalAcceptanceLossy(epsilon=0.09, delta=0.3, sample_first=False)
    assert verifier("verifier.epsilon=0.2", "verifier.sample_first=true") == TypicalAcceptanceLossy(0.2, 0.3, True)
    with pytest.raises(cli.SpecdecUserError, match="0 < epsilon <= 1"):
        verifier("verifier.epsilon=0")
    with pytest.raises(ValueError, match="takes no options; got delta"):
        select_verifier("reference", delta=0.5)


def test_longest_typical_path_wins_and_the_next_token_is_the_argmax():
    # root row: p = (0.5, 0.3, 0.2, 0); H = 1.03 nats, so the threshold is min(0.09, 0.3 * 0.36) = 0.09
    root = torch.tensor([0.5, 0.3, 0.2, 0.0])
    after_first = torch.tensor([0.05, 0.05, 0.05, 0.85])  # threshold min(0.09, 0.3 * exp(-0.59)) = 0.09
    after_second = torch.tensor([0.1, 0.6, 0.3, 0.0])
    rows = [root, after_first, after_second, torch.tensor([0.0, 0.0, 0.0, 1.0])]
    logits = torch.stack(rows).clamp(min=1e-12).log()[None]  # [1, 4, 4]: rows root, node 0, 1, 2
    # node 0 (token 0, p 0.5) has a child node 2 (token 0, p 0.05: fails); node 1 (token 1, p 0.3) has
    # none; the deepest typical node is at depth 1 and both candidates tie: the likelier one wins
    tree = tree_from_parents(torch.tensor([[0, 1, 0]]), [-1, -1, 0], DET)
    noise = GivenNoise(torch.full((1, 3), 0.5, dtype=torch.float64), torch.full((1,), 0.5, dtype=torch.float64))
    result = TypicalAcceptanceLossy()(tree, logits, SamplingParams(1.0), noise)
    assert result.num_accepted.tolist() == [1] and result.accepted_nodes[0, 0] == 0
    assert result.next_token.tolist() == [3]  # argmax after node 0
    # node 2 (token 3 after node 1, p 0.85) passes: the depth-2 path wins over any depth-1 one
    tree = tree_from_parents(torch.tensor([[1, 0, 3]]), [-1, -1, 1], DET)
    logits = torch.stack([root, after_second, after_first, rows[3]]).clamp(min=1e-12).log()[None]
    result = TypicalAcceptanceLossy()(tree, logits, SamplingParams(1.0), noise)
    assert result.num_accepted.tolist() == [2] and result.accepted_nodes[0, :2].tolist() == [1, 2]
    assert result.next_token.tolist() == [3]


def test_typical_acceptance_is_greedy_decoding_at_temperature_zero():
    target = SyntheticTarget(vocab_size=16, sharpness=1.0, seed=3)
    prompts = [[1, 2], [3], [4, 5, 6]]
    plain = SpecDecoder(target, None, reference.verify).generate(prompts, 24, SamplingParams(0.0))
    drafter = SyntheticDrafter(target, (2, 2), DET, divergence=0.3)
    lossy = SpecDecoder(target, drafter, TypicalAcceptanceLossy()).generate(prompts, 24, SamplingParams(0.0))
    assert lossy.outputs == plain.outputs and lossy.stats.tau > 1.3


def verdict(verifier, sampling, vocab=6, length=3, tv=0.05, divergence=0.5):
    target = SyntheticTarget(vocab_size=vocab, sharpness=1.5, seed=0)
    decoder = SpecDecoder(target, SyntheticDrafter(target, (2, 2), DET, divergence), verifier)
    exact = target.sequence_distribution(PROMPT, length, sampling)
    samples = required_samples(vocab**length, tv)
    return sequence_verdict(decoder, exact, PROMPT, length, vocab, sampling, samples)


def test_typical_acceptance_diverges_from_the_target_distribution():
    """At T = 1 the sequence distribution under typical acceptance is far from the target's: the
    same chi-square test must reject it that the exact point-mass rule passes on this very setting
    (tests/test_exactness.py, case "top2-det-T1": same target, drafter, prompt and length)."""
    sampling = SamplingParams(1.0)
    sampled_first = verdict(TypicalAcceptanceLossy(sample_first=True), sampling, tv=0.1)
    print("typical, sampled next token:", sampled_first)
    assert sampled_first.p_value < NEGATIVE_P and sampled_first.tv > 0.3, sampled_first
    # Medusa's greedy next token makes the output deterministic: a point mass, TV = 1 - its probability
    greedy_first = verdict(TypicalAcceptanceLossy(), sampling, tv=0.2)
    print("typical, greedy next token:", greedy_first)
    assert greedy_first.p_value < NEGATIVE_P and greedy_first.tv > 0.5, greedy_first
