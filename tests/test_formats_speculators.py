"""vLLM's speculators format in and out (drafters.formats.speculators), eagle3 and dflash.

Default tier: heads exported in the format load back bit for bit and draft the same trees; every
switch the head does not compute and every mismatch with the target is refused in one line.
Slow tier (the speculators package takes seconds to import): folders the package's own config and
model classes (Eagle3DraftModel, DFlashDraftModel) save load here and compute the package's logits
and drafts, greedy output equals plain decoding, and our exports load in the package's classes
(from_pretrained, with the target as their verifier) and compute our logits.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_dflash import random_head as random_dflash_head
from test_formats_eagle import LAYERS, PROMPTS, edit, random_head, teacher_forced, trees_and_outputs
from tiny_models import greedy_outputs, tiny_model

from drafters.base import build, check_options
from drafters.dflash import DFlashDrafter, DFlashHead
from drafters.eagle import EagleConfig, EagleDrafter, EagleHead
from drafters.eagle_published import PublishedEagleHead
from drafters.formats import eagle as published
from drafters.formats import speculators
from drafters.formats.load import load_dflash, load_published_eagle, save_dflash
from drafters.heads import save_head, sizes_of
from specdec.noise import RequestRNG
from specdec.protocols import DraftContext
from specdec.sampling import SamplingParams
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
    loaded = load_published_eagle(directory, target)
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
    plain = load_published_eagle(directory, target)
    edit(directory, {"norm_before_residual": True})
    flipped = load_published_eagle(directory, target)
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
    refusal(edit_layer(fresh("q"), model_type="qwen3"), target, r"missing \['midlayer.self_attn.k_norm.weight'")
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


def test_specdec_export_command_writes_the_speculators_format(target, tmp_path, capsys):
    from experiments.export import main

    save_head(random_head(target, "eagle3"), tmp_path / "head")
    main([str(tmp_path / "head"), str(tmp_path / "out"), "--engine", "speculators"])
    assert published.layout(tmp_path / "out") == "eagle3"
    assert '"method": "eagle3"' in capsys.readouterr().out
    save_dflash(random_dflash_head(target), tmp_path / "dflash")
    main([str(tmp_path / "dflash"), str(tmp_path / "dflash-out"), "--engine", "speculators"])
    assert '"method": "dflash", "model": "' in capsys.readouterr().out
    assert load_dflash(tmp_path / "dflash-out", target).config.block_size == 4
    save_head(EagleHead(EagleConfig.for_target(target)), tmp_path / "native")
    with pytest.raises(SystemExit) as exit_status:
        main([str(tmp_path / "native"), str(tmp_path / "out2"), "--engine", "speculators"])
    assert exit_status.value.code == 2 and "train.arch=eagle3" in capsys.readouterr().err
    assert not (tmp_path / "out2").exists()


def dflash_exported(head: DFlashHead, tmp_path: Path, name: str = "dflash") -> Path:
    save_dflash(head, tmp_path / f"{name}-ours")
    speculators.export(tmp_path / f"{name}-ours", tmp_path / name)
    return tmp_path / name


def test_a_dflash_export_loads_back_bit_for_bit_and_drafts_plain_decoding(target, tmp_path):
    head = random_dflash_head(target)
    directory = dflash_exported(head, tmp_path)
    raw = json.loads((directory / "config.json").read_text())
    assert raw["speculators_model_type"] == "dflash" and raw["aux_hidden_state_layer_ids"] == list(head.config.feature_layers)
    assert (raw["block_size"], raw["mask_token_id"], raw["sample_from_anchor"]) == (4, head.config.mask_token_id, False)
    assert "lm_head.weight" not in load_file(str(directory / "model.safetensors"))  # the target's
    loaded = load_dflash(directory, target)
    assert loaded.config == head.config
    mine, theirs = head.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    drafter = build("dflash", target, checkpoint=str(directory))
    _, outputs = trees_and_outputs(drafter, target)
    assert outputs == greedy_outputs(target, PROMPTS, 12)


def test_dflash_variants_and_mismatches_are_refused_in_one_line(target, tmp_path):
    def fresh(name):
        return dflash_exported(random_dflash_head(target), tmp_path, name)

    def refused(directory, pattern, drafter="dflash", on=target):  # when built, and before the target loads
        with pytest.raises(ValueError, match=pattern) as error:
            build(drafter, on, checkpoint=str(directory))
        assert "\n" not in str(error.value)
        with pytest.raises(ValueError, match=pattern):
            check_options(drafter, {"checkpoint": str(directory)}, sizes_of(on))

    refused(edit(fresh("a"), {"sample_from_anchor": True}), "does not compute: sample_from_anchor=true")
    refused(edit(fresh("m"), {"mask_token_id": None}), "no mask_token_id")
    refused(edit_layer(fresh("s"), layer_types=["sliding_attention", "full_attention"], sliding_window=8),
            "sliding-window layers")
    refused(edit_layer(fresh("r"), rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}),
            "RoPE type 'yarn'")
    refused(edit(fresh("l"), {"aux_hidden_state_layer_ids": [1, 9]}), r"feature layers \[9\] do not exist")
    refused(fresh("v"), "vocabulary: head 128, target 96", on=HFTarget(tiny_model("llama", vocab_size=96, layers=4)))
    refused(fresh("e"), "is not read by drafter=eagle / eagle2 / eagle3.*loads with drafter=dflash", drafter="eagle3")
    refused(exported(random_head(target, "eagle3"), tmp_path), "not read by drafter=dflash.*loads with drafter=eagle3")


def test_dflash_export_refuses_what_speculators_would_compute_otherwise(target, tmp_path):
    from drafters.dflash import DFlashConfig
    from drafters.domino import DominoConfig, DominoHead

    save_dflash(random_dflash_head(target, DominoHead, DominoConfig, gru_size=8, emb_dim=8), tmp_path / "domino")
    with pytest.raises(ValueError, match="Domino head: speculators has no algorithm"):
        speculators.export(tmp_path / "domino", tmp_path / "out")
    head = DFlashHead(DFlashConfig.for_target(target, (1, 3), block_size=4, draft_vocab_size=48), torch.arange(48))
    save_dflash(head, tmp_path / "reduced")
    with pytest.raises(ValueError, match="reduced vocabulary"):
        speculators.export(tmp_path / "reduced", tmp_path / "out")
    assert not (tmp_path / "out").exists()


# -- the speculators package itself (slow: its import takes seconds) -----------------------------


def reference_model(target, draft_vocab: int = 48, seed: int = 0, layer_type: str = "llama", **switches):
    """speculators' own Eagle3DraftModel for ``target``, random weights, eager attention, a reduced
    draft vocabulary (d2t/t2d) and the target's embedding, as its trainer loads it; ``layer_type``
    its decoder layer (qwen3: per-head q/k norms)."""
    pytest.importorskip("speculators")
    from transformers import LlamaConfig, Qwen3Config

    from speculators import SpeculatorsConfig, VerifierConfig
    from speculators.models import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    layer = {"llama": LlamaConfig, "qwen3": Qwen3Config}[layer_type](
        vocab_size=target.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5)
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
@pytest.mark.parametrize("residual, layer_type", [(False, "llama"), (True, "llama"), (False, "qwen3")])
def test_a_folder_the_speculators_package_saves_loads_and_computes_its_logits(target, tmp_path, residual, layer_type):
    model = reference_model(target, norm_before_residual=residual, layer_type=layer_type)
    if layer_type == "qwen3":
        with torch.no_grad():  # norms away from 1, so that a head without them computes another function
            model.layers[0].self_attn.q_norm.weight.copy_(1 + 0.5 * torch.randn(16))
            model.layers[0].self_attn.k_norm.weight.copy_(1 + 0.5 * torch.randn(16))
    model.save_pretrained(tmp_path / "spec")
    assert published.layout(tmp_path / "spec") == "eagle3"
    check_options("eagle3", {"checkpoint": str(tmp_path / "spec")}, sizes_of(target))  # before a target loads
    drafter = build("eagle3", target, checkpoint=str(tmp_path / "spec"), depth=3, top_k=2, total_tokens=6)
    head = drafter.head
    assert head.config.norm_before_residual is residual and head.config.feature_layers == LAYERS
    assert head.config.qk_norm is (layer_type == "qwen3")
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

    target.model.save_pretrained(tmp_path / "target")  # the verifier the package's loader reads
    head = random_head(target, "eagle3")
    head.config = replace(head.config, norm_before_residual=True, target=str(tmp_path / "target"))
    directory = exported(head, tmp_path)
    model = Eagle3DraftModel.from_pretrained(str(directory)).eval()
    model.config.transformer_layer_config._attn_implementation = "eager"
    assert model.config.norm_before_residual and model.config.eagle_aux_hidden_state_layer_ids == list(LAYERS)
    with torch.no_grad():  # the engines share the target's embedding; under transformers 5.25 the package's loader
        # leaves the missing table uninitialised instead of NaN, so its test for taking the verifier's can miss it
        model.embed_tokens.weight.copy_(target.model.get_input_embeddings().weight)
    features, embeddings = teacher_forced(target, head, PROMPTS[0] + PROMPTS[2])
    with torch.no_grad():
        expected = head.draft_logits(head.forward_sequence(features, embeddings))
        theirs = reference_logits(model, features, embeddings)
    assert torch.allclose(theirs, expected, atol=1e-5)
    assert torch.equal(torch.arange(48) + model.d2t, head.draft_ids)


MASK, BLOCK = 100, 4


def reference_dflash(target, draft_vocab: int | None = None, seed: int = 0):
    """speculators' own DFlashDraftModel for ``target``: two Qwen3-style layers with random weights,
    eager attention, the target's embedding and LM head rows (over a reduced vocabulary: its t2d)."""
    pytest.importorskip("speculators")
    from transformers import Qwen3Config

    from speculators import SpeculatorsConfig, VerifierConfig
    from speculators.models import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    vocab = target.vocab_size
    layer = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6)
    layer._attn_implementation = "eager"
    config = DFlashSpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=draft_vocab or vocab, block_size=BLOCK,
        aux_hidden_state_layer_ids=[1, 3], mask_token_id=MASK,
        speculators_config=SpeculatorsConfig(
            algorithm="dflash", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=BLOCK - 1)],
            default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])))
    torch.manual_seed(seed)
    model = DFlashDraftModel(config).eval()
    draft_ids = torch.randperm(vocab)[:draft_vocab].sort().values if draft_vocab else torch.arange(vocab)
    if draft_vocab:
        model.load_vocab_mappings(torch.zeros(vocab, dtype=torch.bool).index_fill_(0, draft_ids, True),
                                  draft_ids - torch.arange(draft_vocab))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.startswith(("layers.", "fc.", "norm.", "hidden_norm.")):
                parameter.copy_(1 + 0.3 * torch.randn_like(parameter) if "norm" in name else 0.3 * torch.randn_like(parameter))
        model.embed_tokens.weight.copy_(target.model.get_input_embeddings().weight)
        model.lm_head.weight.copy_(target.model.get_output_embeddings().weight[draft_ids])
    return model


def package_block_probs(model, target, prompt: list[int], layers: tuple[int, ...]):  # -> [B-1, V]
    """q of the tokens the package's layers draft for the block rooted at the prompt's last token,
    run as its forward runs one anchored block: the context before the root, the block bidirectional."""
    context = model.hidden_norm(model.fc(torch.cat(target.prefill([torch.tensor(prompt)], layers).hidden, -1)))
    positions = torch.arange(context.shape[1] + BLOCK)[None]
    x = model.embed_tokens(torch.tensor([[prompt[-1]] + [MASK] * (BLOCK - 1)]))
    embeddings = model.rotary_emb(x, positions)
    mask = torch.zeros(1, 1, BLOCK, positions.shape[1])
    for layer in model.layers:
        x = layer(target_hidden=context, hidden_states=x, attention_mask=mask, position_ids=positions,
                  position_embeddings=embeddings)
    logits = torch.full((BLOCK - 1, target.vocab_size), -torch.inf)
    ids = torch.arange(model.d2t.shape[0]) + model.d2t if model.d2t is not None else torch.arange(target.vocab_size)
    logits[:, ids] = model.lm_head(model.norm(x))[0, 1:]
    return torch.softmax(logits, -1)


def our_block_probs(target, head: DFlashHead, prompt: list[int]):  # -> [B-1, V]
    """q of the block our drafter samples at T = 1 (a sampled chain carries it)."""
    drafter = DFlashDrafter(target, head, sampled=True)
    out = target.prefill([torch.tensor(prompt)], drafter.target_layers)
    drafter.reset(1, 64)
    ctx = DraftContext(torch.tensor([prompt]), torch.tensor([len(prompt)]), out.hidden, torch.tensor([len(prompt) - 1]),
                       SamplingParams(1.0), RequestRNG(torch.tensor([0]), 1))
    return drafter.propose(ctx).draft_probs[0]


@pytest.mark.slow
@pytest.mark.parametrize("draft_vocab", [None, 48])
def test_a_dflash_folder_the_speculators_package_saves_loads_and_computes_its_logits(target, tmp_path, draft_vocab):
    model = reference_dflash(target, draft_vocab)
    model.save_pretrained(tmp_path / "spec")
    drafter = build("dflash", target, checkpoint=str(tmp_path / "spec"))
    head = drafter.head
    assert head.config.feature_layers == (1, 3) and head.config.block_size == BLOCK and head.config.mask_token_id == MASK
    prompt = PROMPTS[0] + PROMPTS[2]
    with torch.no_grad():
        expected = package_block_probs(model, target, prompt, head.config.feature_layers)
    assert torch.allclose(our_block_probs(target, head, prompt), expected, atol=1e-5)
    assert torch.equal(head.draft_ids, torch.arange(draft_vocab) + model.d2t if draft_vocab else torch.arange(128))
    _, outputs = trees_and_outputs(drafter, target)
    assert outputs == greedy_outputs(target, PROMPTS, 12)
    if draft_vocab:  # an LM head that is not the target's rows: refused, not drafted with other logits
        with torch.no_grad():
            model.lm_head.weight.add_(0.1)
        model.save_pretrained(tmp_path / "own")
        with pytest.raises(ValueError, match="lm_head of its own"):
            build("dflash", target, checkpoint=str(tmp_path / "own"))


@pytest.mark.slow
def test_our_dflash_export_loads_in_the_speculators_classes_and_computes_our_logits(target, tmp_path):
    pytest.importorskip("speculators")
    from speculators.models import DFlashDraftModel

    target.model.save_pretrained(tmp_path / "target")  # the verifier: the package takes the embedding and LM head from it
    head = random_dflash_head(target)
    head.config = replace(head.config, target=str(tmp_path / "target"), mask_token_id=MASK)
    model = DFlashDraftModel.from_pretrained(str(dflash_exported(head, tmp_path))).eval()
    model.config.transformer_layer_config._attn_implementation = "eager"
    assert torch.equal(model.lm_head.weight, target.model.get_output_embeddings().weight)
    prompt = PROMPTS[0] + PROMPTS[2]
    with torch.no_grad():
        theirs = package_block_probs(model, target, prompt, head.config.feature_layers)
    assert torch.allclose(theirs, our_block_probs(target, head, prompt), atol=1e-5)
