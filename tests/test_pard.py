"""PARD: drafter=draft_model drafter.parallel=true drafts k tokens from one forward over k-1 mask tokens.

No PARD checkpoint shares a tokenizer with the targets we have, so these tests check the mechanism
on small models made for them: every draft equals a plain forward of the draft model over the
committed text plus the masks (so the masks' rows left the draft's cache), a model that reads only
positions has every draft accepted, greedy output equals plain decoding, and T = 1 reproduces the
target's sequence distribution (with a negative control that mislabels q).
"""

from __future__ import annotations

import pytest
import torch
from sequence_stats import ALPHA, NEGATIVE_P, required_samples, sequence_verdict
from test_hf_target import exact_hf_distribution
from tiny_models import full_logits, greedy_outputs, tiny_model

from drafters.base import build
from drafters.draft_model import DraftModelDrafter
from specdec.decode import SpecDecoder
from specdec.sampling import SamplingParams
from specdec.target import HFTarget
from verifiers import reference

PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [3, 9], [9, 10, 11, 9, 10, 11, 9, 10, 11]]
MASK = 127


def pard_model(seed: int = 1, vocab_size: int = 128, mask: int = MASK, **options):
    """A tiny Llama whose config names a mask token, as PARD checkpoints do."""
    model = tiny_model("llama", vocab_size=vocab_size, seed=seed, **options)
    model.config.pard_token = mask
    return model


def position_only_model(mask: int = MASK):
    """A GPT-2 whose token embeddings are zero: its next token depends on the position alone, so a
    copy of it drafting in parallel is right at every position, masks or not."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                             bos_token_id=0, eos_token_id=0, tie_word_embeddings=False))
    with torch.no_grad():
        model.transformer.wte.weight.zero_()
        model.lm_head.weight.mul_(8.0)  # no near-ties between positions' argmaxes
    model.config.pard_token = mask
    return model.eval()


def recorded(drafter):
    """(committed tokens, tree) of every proposal."""
    steps = []
    propose = drafter.propose

    def tracked(ctx):
        tree = propose(ctx)
        steps.append(([ctx.tokens[b, :n].tolist() for b, n in enumerate(ctx.lengths.tolist())], tree))
        return tree

    drafter.propose = tracked
    return steps


@pytest.mark.integration  # the fast tier keeps the parallel drafts' greedy equality (below)
@pytest.mark.parametrize("sampling", [SamplingParams(0.0), SamplingParams(1.0)])
def test_each_draft_is_one_forward_over_the_committed_text_and_the_masks(sampling):
    """The target drafts for itself, so several drafts are accepted per step: they must all reach
    the draft's cache through the next forward."""
    model = tiny_model("llama", sharpness=4.0)
    model.config.pard_token = MASK
    target = HFTarget(model)
    drafter = DraftModelDrafter(target, model=model, num_draft=4, parallel=True)
    steps = recorded(drafter)
    out = SpecDecoder(target, drafter, reference.verify).generate(PROMPTS, 20, sampling, seed=2)
    assert len(steps) > 4 and out.stats.tau > 2.0
    for committed, tree in steps:
        for b, sequence in enumerate(committed):
            expected = full_logits(model, sequence + [MASK] * 3)[-4:]  # [k, V]: after the text, after each mask
            if sampling.greedy:
                assert tree.tokens[b].tolist() == expected.argmax(-1).tolist()
            else:
                assert torch.allclose(tree.draft_probs[b], torch.softmax(expected, -1), atol=1e-5)


def test_a_model_that_reads_positions_only_has_every_draft_accepted():
    """Masks at the positions right after the text, and no mask left in the cache: a position-only
    draft equal to the target drafts the target's own continuation, so each step accepts all k."""
    model = position_only_model()
    target = HFTarget(model)
    drafter = DraftModelDrafter(target, model=position_only_model(), num_draft=3, parallel=True)
    out = SpecDecoder(target, drafter, reference.verify).generate(PROMPTS, 16, SamplingParams(0.0))
    assert out.outputs == greedy_outputs(target, PROMPTS, 16)
    assert out.stats.tau == 4.0


@pytest.mark.parametrize("draft", [pytest.param("other", marks=pytest.mark.integration), "self"])
def test_parallel_greedy_output_equals_plain_decoding(draft):
    """other: a different model (drafts mostly rejected); self: the target itself, whose first
    draft is always accepted and the masked ones sometimes."""
    model = tiny_model("llama", sharpness=4.0)
    target = HFTarget(model)
    if draft == "self":
        model.config.pard_token = MASK
    drafter = build("draft_model", target, model=model if draft == "self" else pard_model(sharpness=4.0),
                    num_draft=4, parallel=True)
    out = SpecDecoder(target, drafter, reference.verify).generate(PROMPTS, 20, SamplingParams(0.0))
    assert out.outputs == greedy_outputs(target, PROMPTS, 20)
    if draft == "self":
        assert out.stats.tau > 2.0


@pytest.mark.slow  # a whole specdec-run, twice
def test_specdec_run_drafts_in_parallel_with_a_pard_checkpoint(tmp_path):
    """drafter=draft_model drafter.parallel=true from the command line: a folder whose config names
    pard_token runs greedy-equal; one without is refused in one line."""
    from test_run_cli import run_in_process

    from experiments import cli

    model = tiny_model("llama", sharpness=4.0)
    model.save_pretrained(tmp_path / "plain")
    model.config.pard_token = MASK
    model.save_pretrained(tmp_path / "pard")
    overrides = ["target=hf", f"target.path={tmp_path / 'plain'}", "workload=synthetic", "workload.num_prompts=2",
                 "workload.prompt_length=7", "max_new_tokens=10", "logger=none", "drafter=draft_model",
                 "drafter.parallel=true", "drafter.num_draft=3",
                 # one short timed pass: what is checked here is the drafting, not a measurement
                 "repeats=1", "warmup_tokens=0", "baseline_check_tokens=0", "target.packed_gemm_from=null"]
    results = run_in_process(tmp_path / "run", [*overrides, f"drafter.model_path={tmp_path / 'pard'}"])
    assert results["greedy_equal"] is True and results["tau"] > 1.0
    with pytest.raises(cli.SpecdecUserError, match="needs a PARD draft model.*no pard_token"):
        run_in_process(tmp_path / "refused", [*overrides, f"drafter.model_path={tmp_path / 'plain'}"])


def test_a_draft_model_without_a_mask_token_is_refused(tmp_path):
    from drafters.base import TargetSizes, check_options

    tiny_model("llama", seed=1).save_pretrained(tmp_path)  # before any target loads: from its config.json
    sizes = TargetSizes("tiny", 128, 64, 2)
    with pytest.raises(ValueError, match="needs a PARD draft model, but .* has no pard_token"):
        check_options("draft_model", {"model_path": str(tmp_path), "parallel": True}, sizes)
    check_options("draft_model", {"model_path": str(tmp_path), "parallel": False}, sizes)
    target = HFTarget(tiny_model("llama"))
    with pytest.raises(ValueError, match="drafter.parallel=true needs a PARD draft model.*no pard_token"):
        DraftModelDrafter(target, model=tiny_model("llama", seed=1), parallel=True)
    with pytest.raises(ValueError, match="pard_token 128 is outside its vocabulary of 128"):
        DraftModelDrafter(target, model=pard_model(mask=128), parallel=True)


class MislabelledPard(DraftModelDrafter):
    """Negative control: each draft drawn from its own position's q, but every node labelled with
    the first position's q."""

    def _draft_in_parallel(self, ctx):
        drafted, q = super()._draft_in_parallel(ctx)
        return drafted, q[:, :1].expand_as(q)


@pytest.mark.slow  # ~50k requests through the loop
@pytest.mark.parametrize("draft", ["other", "self"])
def test_parallel_sampled_chains_are_exact_at_t1(draft):
    model = tiny_model("llama", vocab_size=8, sharpness=6.0)
    target = HFTarget(model)
    if draft == "self":
        model.config.pard_token = 7
    drafter = DraftModelDrafter(target, model=model if draft == "self" else pard_model(vocab_size=8, mask=7, sharpness=6.0),
                                num_draft=3, parallel=True)
    prompt, length, sampling = [1, 2, 3], 3, SamplingParams(1.0)
    exact = exact_hf_distribution(model, prompt, length, sampling)
    verdict = sequence_verdict(SpecDecoder(target, drafter, reference.verify), exact, prompt, length, 8, sampling,
                               required_samples(8**length, tv=0.03), seed=3)
    print(draft, verdict)
    assert verdict.impossible == 0 and verdict.p_value > ALPHA, verdict


@pytest.mark.slow  # ~18k requests through the loop
def test_control_mislabelled_q_is_rejected():
    model = tiny_model("llama", vocab_size=8, sharpness=6.0)
    model.config.pard_token = 7
    target = HFTarget(model)
    drafter = MislabelledPard(target, model=model, num_draft=3, parallel=True)
    prompt, length, sampling = [1, 2, 3], 3, SamplingParams(1.0)
    exact = exact_hf_distribution(model, prompt, length, sampling)
    verdict = sequence_verdict(SpecDecoder(target, drafter, reference.verify), exact, prompt, length, 8, sampling,
                               required_samples(8**length, tv=0.05), seed=3)
    print(verdict)
    assert verdict.p_value < NEGATIVE_P, verdict
