"""vLLM's speculators format in and out (drafters.formats.speculators).

Default tier: heads exported in the format load back bit for bit and draft the same trees; every
switch the head does not compute and every mismatch with the target is refused in one line.
Slow tier (the speculators package takes seconds to import): folders the package's own
Eagle3SpeculatorConfig / Eagle3DraftModel save load here and compute the package's logits and
drafts, greedy output equals plain decoding, and our exports load in the package's classes and
compute our logits.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_formats_eagle import LAYERS, PROMPTS, edit, random_head, teacher_forced, trees_and_outputs
from tiny_models import greedy_outputs, tiny_model

from drafters.base import build
from drafters.eagle import EagleConfig, EagleDrafter, EagleHead
from drafters.eagle_published import PublishedEagleHead
from drafters.formats import eagle as published
from drafters.formats import speculators
from drafters.heads import save_head
from specdec.target import HFTarget


@pytest.fixture(scope="module")
def target() -> HFTarget:
    return HFTarget(tiny_model("llama", layers=4, sharpness=4.0))


def exported(head, tmp_path: Path, name: str = "out") -> Path:
    save_head(head, tmp_path / f"{name}-ours")
    speculators.export(tmp_path / f"{name}-ours", tmp_path / name)
    return tmp_path / name


def edit_layer(directory: Path, **fields) -> Path:
    raw = json.loads((directory / "config.json").read_text())
    raw["transformer_layer_config"].update(fields)
    (directory / "config.json").write_text(json.dumps(raw))
    return directory


@pytest.mark.parametrize("residual", [False, True])
def test_export_loads_back_bit_for_bit_and_drafts_the_same_trees(target, tmp_path, residual):
    head = random_head(target, "eagle3")
    head.config = replace(head.config, norm_before_residual=residual)
    directory = exported(head, tmp_path)
    raw = json.loads((directory / "config.json").read_text())
    assert raw["speculators_model_type"] == "eagle3" and raw["norm_before_residual"] is residual
    assert raw["eagle_aux_hidden_state_layer_ids"] == list(LAYERS)
    assert {"layers.0.hidden_norm.weight", "layers.0.self_attn.q_proj.weight", "fc.weight", "norm.weight",
            "lm_head.weight", "d2t", "t2d"} <= set(load_file(str(directory / "model.safetensors")))
    assert published.layout(directory) == "eagle3"  # not EAGLE-1, for all its layers.0.* weights
    loaded = published.load_published(directory, target)
    assert loaded.config == head.config
    mine, theirs = head.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    drafter = build("eagle3", target, checkpoint=str(directory), depth=3, top_k=2, total_tokens=6)
    their_trees, their_outputs = trees_and_outputs(drafter, target)
    our_trees, our_outputs = trees_and_outputs(EagleDrafter(target, head, 3, 2, 6), target)
    assert their_outputs == our_outputs == greedy_outputs(target, PROMPTS, 12)
    for a, b in zip(their_trees, our_trees, strict=True):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)


def test_norm_before_residual_changes_what_the_head_computes(target, tmp_path):
    """Negative control for the switch: the same weights read with it flipped draft other logits."""
    head = random_head(target, "eagle3")
    directory = exported(head, tmp_path)
    features, embeddings = teacher_forced(target, head, PROMPTS[0] + PROMPTS[2])
    plain = published.load_published(directory, target)
    edit(directory, {"norm_before_residual": True})
    flipped = published.load_published(directory, target)
    with torch.no_grad():
        assert not torch.allclose(plain.forward_sequence(features, embeddings),
                                  flipped.forward_sequence(features, embeddings))


def refusal(directory: Path, target, pattern: str, **options) -> None:
    with pytest.raises(ValueError, match=pattern) as error:
        build("eagle3", target, checkpoint=str(directory), **options)
    assert "\n" not in str(error.value)


def test_what_the_head_does_not_compute_or_does_not_fit_is_refused_in_one_line(target, tmp_path):
    def fresh(name):
        return exported(random_head(target, "eagle3"), tmp_path, name)

    refusal(fresh("fc"), HFTarget(tiny_model("llama", vocab_size=96, layers=4)), "vocabulary: checkpoint 128, target 96")
    refusal(edit_layer(fresh("h"), hidden_size=32), target, "hidden size: checkpoint 32, target 64")
    refusal(edit(fresh("l"), {"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}), target, r"layer ids: .*\[1, 2, 9\]")
    for switch in ("norm_before_fc", "fc_norm", "norm_output"):
        refusal(edit(fresh(switch), {switch: True}), target, f"does not compute.*{switch}=true")
    refusal(edit_layer(fresh("q"), model_type="qwen3"), target, "model_type='qwen3' .per-head q/k norms")
    refusal(edit_layer(fresh("n"), num_hidden_layers=2), target, "num_hidden_layers=2")
    refusal(edit_layer(fresh("r"), rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}), target,
            "rope_scaling type 'yarn'")
    refusal(edit(fresh("m"), {"speculators_model_type": "mtp"}), target,
            "speculators mtp checkpoint .* not read by drafter=eagle")
    refusal(fresh("f"), target, r"holds an eagle3 head \(speculators format\), not eagle; set drafter.format=eagle3",
            format="eagle")
    assert published.layout(edit(fresh("d"), {"speculators_model_type": "dflash"})) == "speculators dflash"


def test_export_refuses_heads_no_speculators_algorithm_computes(target, tmp_path):
    save_head(EagleHead(EagleConfig.for_target(target)), tmp_path / "native")
    with pytest.raises(ValueError, match="architecture native.*train.arch=eagle3"):
        speculators.export(tmp_path / "native", tmp_path / "out")
    head = PublishedEagleHead(EagleConfig.for_target(target, (1, 2, 5), 48, "eagle3"), torch.arange(48))
    with pytest.raises(ValueError, match=r"reads target layers \[5\]"):
        exported(head, tmp_path, "final-norm")


# -- the speculators package itself (slow: its import takes seconds) -----------------------------


def reference_model(target, draft_vocab: int = 48, seed: int = 0, **switches):
    """speculators' own Eagle3DraftModel for ``target``, random weights, eager attention, a reduced
    draft vocabulary (d2t/t2d) and the target's embedding, as its trainer loads it."""
    pytest.importorskip("speculators")
    from transformers import LlamaConfig

    from speculators import SpeculatorsConfig, VerifierConfig
    from speculators.models import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    layer = LlamaConfig(vocab_size=target.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
    layer._attn_implementation = "eager"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=draft_vocab, eagle_aux_hidden_state_layer_ids=list(LAYERS),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])),
        **switches)
    torch.manual_seed(seed)
    model = Eagle3DraftModel(config).eval()
    draft_ids = torch.randperm(target.vocab_size)[:draft_vocab].sort().values
    model.load_vocab_mappings(torch.zeros(target.vocab_size, dtype=torch.bool).index_fill_(0, draft_ids, True),
                              draft_ids - torch.arange(draft_vocab))
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.model.get_input_embeddings().weight)
        model.lm_head.weight.copy_(4.0 * torch.randn_like(model.lm_head.weight))  # peaked: no near-ties in the top-k
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                parameter.copy_(1 + 0.3 * torch.randn_like(parameter))
    return model


def reference_logits(model, features, embeddings):  # [1, T, 3H], [1, T, H] -> [1, T, K]
    """The package's layers, run as its forward runs the first draft step (a causal float mask)."""
    length = features.shape[1]
    positions = torch.arange(length)[None]
    x = torch.cat([embeddings, model.fc(features)], -1)
    mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
    h = model.layers[0](x, attention_mask=mask, position_ids=positions, position_embeddings=model.rotary_emb(x, positions))
    return model.lm_head(model.norm(h))


@pytest.mark.slow
@pytest.mark.parametrize("residual", [False, True])
def test_a_folder_the_speculators_package_saves_loads_and_computes_its_logits(target, tmp_path, residual):
    model = reference_model(target, norm_before_residual=residual)
    model.save_pretrained(tmp_path / "spec")
    assert published.layout(tmp_path / "spec") == "eagle3"
    drafter = build("eagle3", target, checkpoint=str(tmp_path / "spec"), depth=3, top_k=2, total_tokens=6)
    head = drafter.head
    assert head.config.norm_before_residual is residual and head.config.feature_layers == LAYERS
    assert not head.config.own_embedding  # the copy of the target's embedding is shared, not kept
    tokens = PROMPTS[0] + PROMPTS[2]
    features, embeddings = teacher_forced(target, head, tokens)
    with torch.no_grad():
        expected = reference_logits(model, features, embeddings)
        ours = head.draft_logits(head.forward_sequence(features, embeddings))
        # the package's own forward: its first draft step's tokens, in draft-vocabulary ids
        drafted = model(features, torch.tensor([tokens[1:]]), torch.zeros(1, len(tokens) - 1, dtype=torch.long),
                        position_ids=torch.arange(len(tokens) - 1)[None], ttt_steps=1)[0]
    assert torch.allclose(ours, expected, atol=1e-5)
    assert torch.equal(ours.argmax(-1), drafted)
    assert torch.equal(head.draft_ids, torch.arange(48) + model.d2t)
    _, outputs = trees_and_outputs(drafter, target)
    assert outputs == greedy_outputs(target, PROMPTS, 12)


@pytest.mark.slow
def test_our_export_loads_in_the_speculators_classes_and_computes_our_logits(target, tmp_path):
    pytest.importorskip("speculators")
    from speculators.models import Eagle3DraftModel

    target.model.save_pretrained(tmp_path / "target")  # the verifier the package loads the embedding from
    head = random_head(target, "eagle3")
    head.config = replace(head.config, norm_before_residual=True, target=str(tmp_path / "target"))
    directory = exported(head, tmp_path)
    model = Eagle3DraftModel.from_pretrained(str(directory)).eval()
    model.config.transformer_layer_config._attn_implementation = "eager"
    assert model.config.norm_before_residual and model.config.eagle_aux_hidden_state_layer_ids == list(LAYERS)
    assert torch.equal(model.embed_tokens.weight, target.model.get_input_embeddings().weight)
    features, embeddings = teacher_forced(target, head, PROMPTS[0] + PROMPTS[2])
    with torch.no_grad():
        expected = head.draft_logits(head.forward_sequence(features, embeddings))
        theirs = reference_logits(model, features, embeddings)
    assert torch.allclose(theirs, expected, atol=1e-5)
    assert torch.equal(torch.arange(48) + model.d2t, head.draft_ids)
