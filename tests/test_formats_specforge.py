"""SpecForge's DFlash and Domino folders, against SpecForge's own modeling classes as the oracle:
folders made by DFlashDraftModel / DominoDraftModel with random weights on the tiny target load
here, give the reference's logits and draft the reference's blocks; heads saved here load back
into SpecForge's classes and compute our logits; mismatches with the target are refused."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from drafters.dflash import DFlashDrafter, DFlashHead
from drafters.domino import DominoHead
from drafters.formats import specforge
from drafters.heads import sizes_of
from specdec.decode import SpecDecoder
from specdec.protocols import DraftContext
from specdec.sampling import SamplingParams
from specdec.target import HFTarget
from tiny_models import tiny_model
from verifiers import reference

MASK, BLOCK = 127, 5
PROMPT = [5, 9, 17, 3, 44, 21, 8]


def reference_classes():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SpecForge's EAGLE module warns that flash_attn is missing
        from specforge.modeling.draft.dflash import DFlashDraftModel, extract_context_feature
        from specforge.modeling.draft.domino import DominoDraftModel
    return DFlashDraftModel, DominoDraftModel, extract_context_feature


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 4}  # a context of 4 so that the scaling moves these short prompts


def reference_model(kind: str, layer_ids=(0, 1), shift_label=False, pure=1, seed=0, bias=False, rope=None):
    """SpecForge's model for the tiny llama target (hidden 64, 2 layers, vocab 128), weights random
    and large enough that every part moves the logits."""
    from transformers import Qwen3Config

    dflash_class, domino_class, _ = reference_classes()
    options = {"mask_token_id": MASK, "target_layer_ids": list(layer_ids)}
    if kind == "domino":
        options.update(projector_type="domino", gru_hidden_dim=24, emb_dim=40, pure_draft_prefix_len=pure,
                       shift_label=shift_label)
    config = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         intermediate_size=96, num_hidden_layers=2, vocab_size=128, max_position_embeddings=256,
                         rms_norm_eps=1e-6, attention_bias=bias, block_size=BLOCK, num_target_layers=2,
                         **({"rope_parameters": {"rope_theta": 10000.0, **rope}} if rope else {}),
                         dflash_config=options)
    torch.manual_seed(seed)
    model = (domino_class if kind == "domino" else dflash_class)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    return model.eval()


def reference_block(model, target_model, prompt: list[int]):
    """What SpecForge's decode loop computes for a block rooted at the prompt's last token:
    (backbone rows [B, H] after the final norm, the drafted tokens [B-1], their logits [B-1, V])."""
    _, _, extract = reference_classes()
    with torch.no_grad():
        out = target_model(torch.tensor([prompt[:-1]]), output_hidden_states=True)
        context = extract(out.hidden_states, model.target_layer_ids)
        block = torch.tensor([[prompt[-1]] + [MASK] * (BLOCK - 1)])
        rows = model(target_hidden=context, noise_embedding=target_model.model.embed_tokens(block),
                     position_ids=torch.arange(len(prompt) - 1 + BLOCK)[None], is_causal=False)
        drafted = model._sample_draft_tokens(target_model, rows, block)[0]
        completed = torch.cat([block[:, :1], drafted[None]], 1)
        base = target_model.lm_head(rows)[:, None]
        if isinstance(model, reference_classes()[1]):
            logits = model.apply_logits_head(base, prev_token_embeddings=target_model.model.embed_tokens(
                torch.cat([completed, torch.tensor([[MASK]])], 1)[:, :BLOCK])[:, None], hidden_states=rows[:, None])[0, 0]
        else:
            logits = base[0, 0]
        shift = int(getattr(model, "shift_label", False)) if isinstance(model, reference_classes()[1]) else 0
    return rows[0], drafted, logits[1 - shift: BLOCK - shift]


def our_block(target: HFTarget, drafter: DFlashDrafter, prompt: list[int], sampling=SamplingParams(0.0)):
    out = target.prefill([torch.tensor(prompt)], drafter.target_layers)
    drafter.reset(1, 64)
    ctx = DraftContext(torch.tensor([prompt]), torch.tensor([len(prompt)]), out.hidden, torch.tensor([len(prompt) - 1]),
                       sampling, None)
    return drafter.propose(ctx)


def save_reference(model, folder):
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.mark.parametrize("kind,shift_label,pure,bias,rope", [
    ("dflash", False, 0, False, None), ("dflash", False, 0, True, None), ("dflash", False, 0, False, LLAMA3_ROPE),
    ("domino", False, 1, False, None), ("domino", True, 1, True, None), ("domino", False, 0, False, None),
    ("domino", True, 0, False, LLAMA3_ROPE)])
def test_a_specforge_folder_drafts_the_reference_block(tmp_path, kind, shift_label, pure, bias, rope):
    target_model = tiny_model("llama", sharpness=4.0)
    target = HFTarget(target_model)
    model = reference_model(kind, shift_label=shift_label, pure=pure, bias=bias, rope=rope)
    head = specforge.load(save_reference(model, tmp_path / "head"), target)
    assert isinstance(head, DominoHead) == (kind == "domino")
    assert head.config.feature_layers == (1, 3)  # layer id 1 of 2 reads transformers' last entry, the final norm
    depth = BLOCK - 1
    drafter = DFlashDrafter(target, head, depth=depth)
    rows, drafted, logits = reference_block(model, target_model, PROMPT)
    tree = our_block(target, drafter, PROMPT)
    assert tree.tokens[0, :depth].tolist() == drafted.tolist()
    # logits: our head's rows and refinement on the same inputs
    features = torch.cat([target.prefill([torch.tensor(PROMPT)], head.config.feature_layers).hidden[i] for i in range(2)], -1)
    positions = torch.arange(len(PROMPT) - 1)[None]
    block = target_model.model.embed_tokens(torch.tensor([[PROMPT[-1]] + [MASK] * (BLOCK - 1)]))
    with torch.no_grad():
        at = torch.arange(len(PROMPT) - 1, len(PROMPT) - 1 + BLOCK)[None, None]
        sees = torch.ones(1, 1, len(PROMPT) - 1, dtype=torch.bool)
        ours = head(block[:, None], at, head.context(features, positions), sees)[0, 0]
        torch.testing.assert_close(ours, rows, atol=2e-5, rtol=1e-4)
        # negative control: the last block read before the final norm (our layer 2) is another function
        before_norm = torch.cat([target.prefill([torch.tensor(PROMPT)], (1, 2)).hidden[i] for i in range(2)], -1)
        wrong = head(block[:, None], at, head.context(before_norm, positions), sees)[0, 0]
        assert (wrong - rows).abs().max() > 1e-2
        shift = head.label_shift
        base = target_model.lm_head(ours)
        if kind == "domino":
            prefix = target_model.model.embed_tokens(torch.cat([torch.tensor([PROMPT[-1]]), drafted, torch.tensor([MASK])])[:BLOCK])
            inputs, corrected = head.correction_inputs(ours[None], prefix[None])
            mine = base + head.embed_proj(inputs[0]) * corrected[:, None]
        else:
            mine = base
        torch.testing.assert_close(mine[1 - shift: BLOCK - shift], logits, atol=2e-5, rtol=1e-4)


def test_a_head_saved_here_loads_into_specforge_and_computes_our_logits(tmp_path):
    target_model = tiny_model("llama", sharpness=4.0)
    target = HFTarget(target_model)
    head = specforge.load(save_reference(reference_model("domino", shift_label=True, seed=3), tmp_path / "a"), target)
    specforge.save(head, tmp_path / "ours")
    _, domino_class, _ = reference_classes()
    reloaded = domino_class.from_pretrained(tmp_path / "ours").eval()
    assert reloaded.shift_label and reloaded.pure_draft_prefix_len == 1 and list(reloaded.target_layer_ids) == [0, 1]
    _, drafted, _ = reference_block(reloaded, target_model, PROMPT)
    tree = our_block(target, DFlashDrafter(target, head, depth=BLOCK - 1), PROMPT)
    assert tree.tokens[0].tolist() == drafted.tolist()
    prompts = [PROMPT, [3], [9, 8, 7]]
    plain = SpecDecoder(target, None, reference.verify).generate(prompts, 12, SamplingParams(0.0))
    out = SpecDecoder(target, DFlashDrafter(target, head), reference.verify).generate(prompts, 12, SamplingParams(0.0))
    assert out.outputs == plain.outputs  # a SpecForge head through the decode loop


def test_mismatches_with_the_target_and_unsupported_configs_are_refused(tmp_path):
    target = HFTarget(tiny_model("llama"))
    folder = save_reference(reference_model("dflash"), tmp_path / "head")
    raw = json.loads((folder / "config.json").read_text())

    def edited(**changes):
        (folder / "config.json").write_text(json.dumps({**raw, **changes}))
        return folder

    def refused(directory, pattern, error=ValueError):  # when loaded, and before the target loads
        with pytest.raises(error, match=pattern):
            specforge.load(directory, target)
        with pytest.raises(error, match=pattern):
            specforge.check(directory, sizes_of(target))

    refused(edited(hidden_size=32), "made for another target.*hidden size: head 32, target 64")
    refused(edited(vocab_size=256), "vocabulary: head 256, target 128")
    refused(edited(num_target_layers=4), "layers: head 4, target 2")
    refused(edited(dflash_config={**raw["dflash_config"], "target_layer_ids": [5]}), "target_layer_ids holds 5")
    refused(edited(layer_types=["sliding_attention", "full_attention"]), "cannot be loaded: layer_types.*only full_attention")
    refused(edited(dflash_config={"target_layer_ids": [0, 1]}), "cannot be loaded: no dflash_config.mask_token_id")
    refused(edited(num_hidden_layers=1, layer_types=["full_attention"]), "weights do not match its config")
    refused(edited(intermediate_size=raw["intermediate_size"] * 2), "weights do not match its config")
    refused(tmp_path / "nothing", "holds no SpecForge", FileNotFoundError)
    assert specforge.check(edited(), sizes_of(target)) is DFlashHead  # the control: nothing to refuse
    assert specforge.detect(edited()) and not specforge.detect(tmp_path)


def test_export_writes_dflash_for_sglang_and_refuses_what_no_engine_runs(tmp_path):
    target = HFTarget(tiny_model("llama"))
    specforge.save(specforge.load(save_reference(reference_model("dflash"), tmp_path / "a"), target), tmp_path / "ours")
    specforge.export(tmp_path / "ours", tmp_path / "sglang", "sglang")
    dflash_class, domino_class, _ = reference_classes()
    exported = dflash_class.from_pretrained(tmp_path / "sglang")
    assert exported.mask_token_id == MASK and "specdec" not in json.loads((tmp_path / "sglang" / "config.json").read_text())
    with pytest.raises(ValueError, match="speculators format"):
        specforge.export(tmp_path / "ours", tmp_path / "vllm", "vllm")
    specforge.save(specforge.load(save_reference(reference_model("domino"), tmp_path / "b"), target), tmp_path / "domino")
    with pytest.raises(ValueError, match="Domino head: no serving engine runs its GRU refinement"):
        specforge.export(tmp_path / "domino", tmp_path / "out", "sglang")


def test_specdec_export_writes_a_dflash_head_for_sglang_and_refuses_domino_in_one_line(tmp_path, capsys):
    from experiments.export import main

    target = HFTarget(tiny_model("llama"))
    specforge.save(specforge.load(save_reference(reference_model("dflash"), tmp_path / "a"), target), tmp_path / "dflash")
    main([str(tmp_path / "dflash"), str(tmp_path / "out"), "--engine", "sglang"])
    assert "--speculative-algorithm DFLASH" in capsys.readouterr().out
    assert reference_classes()[0].from_pretrained(tmp_path / "out").block_size == BLOCK
    specforge.save(specforge.load(save_reference(reference_model("domino"), tmp_path / "b"), target), tmp_path / "domino")
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path / "domino"), str(tmp_path / "out2"), "--engine", "sglang"])
    assert exit_.value.code != 0 and not (tmp_path / "out2").exists()
    assert "no serving engine runs its GRU refinement" in str(exit_.value.code) + capsys.readouterr().err
