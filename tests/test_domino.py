"""Domino: the DFlash backbone plus the GRU refinement. Exact greedy and sampled decoding (labels
shifted both ways), the refinement drafted step by step equal to the teacher-forced one training
uses, the lambda schedule, and the bundled head's bridge to the miniature architecture."""

from __future__ import annotations

import pytest
import torch

from drafters.dflash import DFlashDrafter
from drafters.domino import DominoConfig, DominoHead
from drafters.formats.load import domino
from drafters.training.dflash_training import Objective
from drafters.training.methods import build_method
from sequence_stats import ALPHA, NEGATIVE_P, required_samples, sequence_verdict
from specdec.decode import SpecDecoder
from specdec.sampling import SamplingParams
from specdec.target import HFTarget
from specdec.tree import chain_tree
from test_dflash import random_head
from tiny_models import tiny_model
from verifiers import reference
from verifiers.select import select_verifier

GREEDY = SamplingParams(0.0)


def domino_head(target, shift_label=False, pure=1, seed=0):
    return random_head(target, DominoHead, DominoConfig, seed=seed, gru_size=12, emb_dim=20, shift_label=shift_label,
                       pure_draft_prefix_len=pure)


@pytest.mark.parametrize("shift_label,pure,verifier", [(False, 1, "reference"), (True, 1, "reference"), (True, 0, "reference"),
                                                       (True, 1, "triton"), (False, 1, "traversal")])
def test_greedy_blocks_equal_plain_decoding(shift_label, pure, verifier):
    target = HFTarget(tiny_model("llama", sharpness=4.0))
    head = domino_head(target, shift_label, pure)
    drafter = DFlashDrafter(target, head)
    assert drafter.max_depth == (4 if shift_label else 3)  # shifted labels draft from the root's row too
    prompts = [[5, 6, 7, 8, 5, 6, 7, 9, 11], [3], [40, 41, 42]]
    plain = SpecDecoder(target, None, reference.verify).generate(prompts, 14, GREEDY)
    out = SpecDecoder(target, drafter, select_verifier(verifier, target.device)).generate(prompts, 14, GREEDY, max_batch=2)
    assert out.outputs == plain.outputs


@pytest.mark.parametrize("shift_label", [False, True])
def test_drafting_refines_as_training_does(shift_label):
    """The step-by-step refinement of a drafted block equals the teacher-forced one (training's),
    given the drafted tokens as the prefix; the refinement changes the base logits (not a no-op)."""
    target = HFTarget(tiny_model("llama", sharpness=4.0))
    head = domino_head(target, shift_label, pure=1, seed=3)
    k, h = head.config.block_size, head.config.hidden_size
    rows = torch.randn(2, k, h)
    base = rows @ target.model.lm_head.weight.T
    tokens = torch.randint(128, (2, k))  # x_r, then the drafted tokens
    embed = target.model.get_input_embeddings()
    with torch.no_grad():
        inputs, corrected = head.correction_inputs(rows, embed(tokens))
        teacher = base + head.embed_proj(inputs) * corrected[:, None]
        state = head.start(2, rows)
        for j in range(1, head.max_depth + 1):
            row = j - head.label_shift
            stepped, state = head.refine(j, rows[:, row], base[:, row], embed(tokens[:, j - 1]), state)
            torch.testing.assert_close(stepped, teacher[:, row])
            assert torch.equal(stepped, base[:, row]) == (j <= 1)  # pure_draft_prefix_len = 1


def sampled_decoder(verifier: str, carried=None):
    """SpecDecoder over a Domino head whose refinement is far from "no correction", drafting
    sampled blocks; ``carried`` (q -> q') replaces the q each node carries (a negative control)."""
    model = tiny_model("llama", vocab_size=8, sharpness=6.0)
    target = HFTarget(model)
    torch.manual_seed(1)
    head = DominoHead(DominoConfig.for_target(target, (1, 3), block_size=3, gru_size=8, emb_dim=8, mask_token_id=7,
                                              pure_draft_prefix_len=0, shift_label=True))
    torch.nn.init.normal_(head.embed_proj[2].weight, std=1.0)
    drafter = DFlashDrafter(target, head.eval(), sampled=True)
    if carried is not None:
        propose = drafter.propose

        def wrong(ctx):
            tree = propose(ctx)
            return chain_tree(tree.tokens, tree.mode, carried(tree.draft_probs))

        drafter.propose = wrong
    return model, SpecDecoder(target, drafter, select_verifier(verifier))


@pytest.mark.parametrize("verifier", ["reference", "block"])
def test_sampled_blocks_are_exact(verifier):
    """T = 1, sampled=True: each depth drawn from the refined q and carried for the p/q test (token
    by token, and the chain judged jointly); the distribution of the first two generated tokens
    must be the target's."""
    from test_hf_target import exact_hf_distribution

    model, decoder = sampled_decoder(verifier)
    prompt, length, sampling = [1, 2, 3], 2, SamplingParams(1.0)
    exact = exact_hf_distribution(model, prompt, length, sampling)
    verdict = sequence_verdict(decoder, exact, prompt, length, 8, sampling, required_samples(8**length, tv=0.05), seed=4)
    assert verdict.impossible == 0 and verdict.p_value > ALPHA, verdict


def test_sampled_blocks_carrying_another_q_are_caught():
    """Negative control: the same draws carrying a flattened q (as if the refinement were left out
    of it) must fail the same test."""
    from test_hf_target import exact_hf_distribution

    flat = lambda q: q.sqrt() / q.sqrt().sum(-1, keepdim=True)
    model, decoder = sampled_decoder("reference", carried=flat)
    prompt, length, sampling = [1, 2, 3], 2, SamplingParams(1.0)
    exact = exact_hf_distribution(model, prompt, length, sampling)
    verdict = sequence_verdict(decoder, exact, prompt, length, 8, sampling, required_samples(8**length, tv=0.05), seed=4)
    assert verdict.p_value < NEGATIVE_P, verdict


def test_lambda_falls_linearly_to_zero_and_settings_are_checked():
    objective = Objective(lambda_start=1.0, lambda_decay_ratio=0.5, lambda_steps=20)
    assert [objective.lambda_base(step) for step in (0, 5, 10, 15)] == pytest.approx([1.0, 0.5, 0.0, 0.0])
    method = build_method({"name": "domino", "feature_layers": [1, 2], "block_size": 4, "gru_size": 8})
    assert dict(method.sizes)["gru_size"] == 8 and method.feature_layers(HFTarget(tiny_model("llama"))) == (1, 2)
    with pytest.raises(ValueError, match="unknown setting.*gru_size"):
        build_method({"name": "dflash", "gru_size": 8})  # DFlash has no refinement to size
    with pytest.raises(ValueError, match="pure_draft_prefix_len must lie in"):
        DominoConfig.for_target(HFTarget(tiny_model("llama")), block_size=4, pure_draft_prefix_len=4)


def test_without_a_checkpoint_the_head_bundled_for_the_target_runs(monkeypatch):
    """drafter=domino with no checkpoint loads drafters/checkpoints/domino-<packaged target>; a
    target with no bundled head is refused naming the command that trains one."""
    import drafters.formats.load

    target = HFTarget(tiny_model("llama"))
    with pytest.raises(ValueError, match="no domino head is bundled for .*specdec-train train=domino"):
        domino(target)
    loaded = []
    monkeypatch.setattr(drafters.formats.load, "target_name", lambda target: "smollm2")  # as if SmolLM2, by its key
    monkeypatch.setattr(drafters.formats.load, "load_domino", lambda directory, target: loaded.append(directory) or random_head(target))
    assert isinstance(domino(target, depth=2), DFlashDrafter)
    assert loaded[0].name == "domino-smollm2" and (loaded[0] / "config.json").is_file()


def test_a_miniature_head_given_to_drafter_domino_is_refused_naming_its_retraining(tmp_path):
    """Heads of the earlier miniature architecture (config.json with a ``domino`` section) are told
    apart from a foreign folder."""
    (tmp_path / "mini").mkdir()
    (tmp_path / "mini" / "config.json").write_text('{"domino": {"block_size": 3}}')
    (tmp_path / "mini" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="miniature Domino.*no longer run.*specdec-train train=domino"):
        domino(HFTarget(tiny_model("llama")), checkpoint=str(tmp_path / "mini"))


def test_dflash_trained_from_a_domino_head_starts_from_its_backbone():
    """train=dflash init=<Domino folder>: the DFlash head prepared is the Domino head's backbone. With
    the Domino's draft vocabulary (train.draft_vocab set) it drafts as the Domino head with the
    refinement switched off; by default (train.draft_vocab=null) over the whole vocabulary. Neither
    needs a counted vocabulary. A Domino head with shifted labels is refused, as is a DFlash head
    given to train=domino."""
    from drafters.training.online import OnlineData, TokenSequences, online_head_data

    target = HFTarget(tiny_model("llama", sharpness=4.0))
    kept = torch.randperm(128, generator=torch.Generator().manual_seed(5))[:100].sort().values
    donor = random_head(target, DominoHead, DominoConfig, seed=5, draft_ids=kept, gru_size=12, emb_dim=20,
                        pure_draft_prefix_len=0, draft_vocab_size=100)
    with torch.no_grad():
        donor.embed_proj[2].weight.zero_()  # no correction: the Domino head drafts what its backbone does
    tokens = torch.randint(128, (60,), generator=torch.Generator().manual_seed(0))
    sequences = TokenSequences(tokens, torch.tensor([0, 25, 60]), torch.ones(60, dtype=torch.bool))

    def prepare(name, head, **settings):
        method = build_method({"name": name, "feature_layers": [1, 3], "block_size": 4, **settings})
        assert not method.counts_choices(head)
        data = OnlineData(target, sequences, method.feature_layers(target), batch_tokens=100)
        return method.prepare_on(target, online_head_data(data, torch.arange(128)), head).model

    own = prepare("dflash", donor, draft_vocab=100)
    assert type(own).__name__ == "DFlashHead" and not hasattr(own, "prefix_gru")
    assert torch.equal(own.fc.weight, donor.fc.weight) and torch.equal(own.draft_ids, kept)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 9, 11], [40, 41, 42]]
    drafted = [SpecDecoder(target, DFlashDrafter(target, head), reference.verify).generate(prompts, 12, GREEDY)
               for head in (donor, own.eval())]
    assert drafted[0].outputs == drafted[1].outputs and drafted[0].stats.tau == drafted[1].stats.tau
    whole = prepare("dflash", donor)
    assert whole.config.draft_vocab_size == 128 and torch.equal(whole.draft_ids, torch.arange(128))
    assert torch.equal(whole.layers[1].mlp.down_proj.weight, donor.layers[1].mlp.down_proj.weight)
    assert build_method({"name": "dflash"}).counts_choices(None) is False  # the whole vocabulary: nothing to count
    assert build_method({"name": "domino", "draft_vocab": 64}).counts_choices(None) is True
    with pytest.raises(ValueError, match="shift_label=true.*train it with train=domino"):
        prepare("dflash", domino_head(target, shift_label=True))
    with pytest.raises(ValueError, match="the checkpoint is a DFlashHead, not a head train=domino trains"):
        prepare("domino", whole)
