"""Published EAGLE / EAGLE-3 / SpecForge heads in, heads trained here out (drafters.formats.eagle).

Tiny synthetic heads of the published architectures are exported in each published layout, loaded
back through drafter=eagle3 / eagle2 checkpoint=DIR, and must draft the same trees as the head they
came from; exports round-trip bit for bit; layouts that do not fit the target are refused before
decoding. Where the reference projects' model classes import (SpecForge's LlamaForCausalLMEagle3,
EAGLE's cnets.Model), they load our export and compute the same logits.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import greedy_outputs, tiny_model

from drafters.base import build
from drafters.eagle import EagleConfig, EagleDrafter, EagleHead
from drafters.eagle_published import PublishedEagleHead, rope_frequencies
from drafters.formats import eagle as published
from drafters.heads import save_head
from specdec.decode import SpecDecoder
from specdec.sampling import SamplingParams
from specdec.target import HFTarget
from verifiers import reference

PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [3, 9], [9, 10, 11, 9, 10, 11, 9]]
LAYERS = (1, 2, 3)  # the fused target layers of the tiny EAGLE-3 heads (4-layer target)


@pytest.fixture(scope="module")
def target() -> HFTarget:
    return HFTarget(tiny_model("llama", layers=4, sharpness=4.0))


def random_head(target: HFTarget, arch: str, seed: int = 0, fc_bias: bool = True) -> PublishedEagleHead:
    """A published-architecture head with grouped keys/values, random norms and (eagle3) a reduced
    draft vocabulary: every weight matters, so a misplaced norm or a mismapped name shows."""
    torch.manual_seed(seed)
    if arch == "eagle3":
        draft_ids = torch.randperm(target.vocab_size)[:48].sort().values
        config = EagleConfig.for_target(target, LAYERS, 48, "eagle3")
    else:
        draft_ids, config = None, EagleConfig.for_target(target, arch="eagle1")
    head = PublishedEagleHead(replace(config, num_kv_heads=2, fc_bias=fc_bias and arch == "eagle1"), draft_ids)
    with torch.no_grad():
        for name, parameter in head.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                parameter.copy_(1 + 0.3 * torch.randn_like(parameter))
            if name in ("lm_head.weight", "fc.bias"):
                parameter.mul_(4.0)  # peaked draft distributions: ties in the top-k would hide nothing
    return head.eval()


def exported(head, tmp_path: Path, engine: str, name: str = "out") -> Path:
    save_head(head, tmp_path / f"{name}-ours")
    published.export(tmp_path / f"{name}-ours", tmp_path / name, engine)
    return tmp_path / name


def trees_and_outputs(drafter, target):
    trees = []
    propose = drafter.propose
    drafter.propose = lambda ctx: trees.append(propose(ctx)) or trees[-1]
    out = SpecDecoder(target, drafter, reference.verify).generate(PROMPTS, 12, SamplingParams(0.0))
    return trees, out.outputs


@pytest.mark.parametrize("arch,engine", [("eagle3", "vllm"), ("eagle3", "sglang"), ("eagle1", "sglang"), ("eagle1", "vllm")])
def test_published_layouts_load_and_draft_the_same_trees(target, tmp_path, arch, engine):
    head = random_head(target, arch, fc_bias=engine == "sglang")  # vLLM's EAGLE-1 has no fc bias
    directory = exported(head, tmp_path, engine)
    assert published.layout(directory) == ("eagle3" if arch == "eagle3" else "eagle")
    loaded = build("eagle3", target, checkpoint=str(directory), depth=3, top_k=2, total_tokens=6)
    assert isinstance(loaded.head, PublishedEagleHead) and loaded.head.config.arch == arch
    theirs, their_outputs = trees_and_outputs(loaded, target)
    ours, our_outputs = trees_and_outputs(EagleDrafter(target, head, 3, 2, 6), target)
    assert their_outputs == our_outputs == greedy_outputs(target, PROMPTS, 12)
    assert len(theirs) == len(ours) and max(int(t.depth.max()) for t in ours) > 1
    for a, b in zip(theirs, ours):
        assert torch.equal(a.num_nodes, b.num_nodes) and torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)


@pytest.mark.parametrize("arch,engine", [("eagle3", "vllm"), ("eagle3", "sglang"), ("eagle1", "sglang")])
def test_export_import_round_trips_bit_for_bit(target, tmp_path, arch, engine):
    head = random_head(target, arch)
    first = exported(head, tmp_path, engine, "first")
    loaded = published.load_published(first, target)
    assert loaded.config == head.config
    mine, theirs = head.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    second = exported(loaded, tmp_path, engine, "second")  # and out again: the same files
    assert json.loads((first / "config.json").read_text()) == json.loads((second / "config.json").read_text())
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()


def test_exported_configs_carry_what_each_engine_reads(target, tmp_path):
    vllm = json.loads((exported(random_head(target, "eagle3"), tmp_path, "vllm", "v") / "config.json").read_text())
    sglang = json.loads((exported(random_head(target, "eagle3"), tmp_path, "sglang", "s") / "config.json").read_text())
    for config in (vllm, sglang):
        assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 48
        assert (config["num_key_value_heads"], config["head_dim"], config["num_hidden_layers"]) == (2, 16, 1)
    # vLLM names a layer by its input (our index), SGLang by its output (one less)
    assert vllm["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and "eagle_config" not in vllm
    assert sglang["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    weights = load_file(str(tmp_path / "v" / "model.safetensors"))
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight", "norm.weight",
            "lm_head.weight", "d2t", "t2d"} <= set(weights) and "embed_tokens.weight" not in weights
    draft_ids = torch.arange(48) + weights["d2t"]  # as vLLM and SGLang read d2t
    assert torch.equal(weights["t2d"].nonzero()[:, 0], draft_ids)


def test_unsorted_draft_vocabularies_export_sorted_with_their_rows(target, tmp_path):
    head = random_head(target, "eagle3")
    order = torch.randperm(48)
    with torch.no_grad():
        head.draft_ids.copy_(head.draft_ids[order])
        head.lm_head.weight.copy_(head.lm_head.weight[order])
    loaded = published.load_published(exported(head, tmp_path, "vllm"), target)
    assert torch.equal(loaded.draft_ids, head.draft_ids.sort().values)
    x = torch.randn(5, 64)
    mine = torch.zeros(5, 128).index_copy_(1, head.draft_ids, head.draft_logits(x))
    theirs = torch.zeros(5, 128).index_copy_(1, loaded.draft_ids, loaded.draft_logits(x))
    assert torch.equal(mine, theirs)


def edit(directory: Path, config: dict | None = None, weights: dict | None = None) -> Path:
    if config:
        raw = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**raw, **config}))
    if weights:
        state = load_file(str(directory / "model.safetensors"))
        save_file({**state, **weights}, str(directory / "model.safetensors"))
    return directory


def test_a_layout_that_does_not_fit_the_target_is_refused_naming_the_mismatch(target, tmp_path):
    directory = exported(random_head(target, "eagle3"), tmp_path, "vllm")
    other = HFTarget(tiny_model("llama", vocab_size=96, layers=4))
    with pytest.raises(ValueError, match="vocabulary: checkpoint 128, target 96"):
        build("eagle3", other, checkpoint=str(directory))
    with pytest.raises(ValueError, match="hidden size: checkpoint 32, target 64"):
        published.load_published(edit(exported(random_head(target, "eagle3"), tmp_path, "vllm", "h"),
                                      {"hidden_size": 32}), target)
    with pytest.raises(ValueError, match=r"layer ids: the head reads target layers \[1, 2, 9\]"):
        published.load_published(edit(exported(random_head(target, "eagle3"), tmp_path, "vllm", "l"),
                                      {"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}), target)
    with pytest.raises(ValueError, match="variant this loader does not compute.*num_hidden_layers=2"):
        published.load_published(edit(exported(random_head(target, "eagle3"), tmp_path, "vllm", "n"),
                                      {"num_hidden_layers": 2}), target)
    with pytest.raises(ValueError, match="drafter.format=eagle3"):
        build("eagle3", target, checkpoint=str(directory), format="eagle")


def test_inconsistent_draft_maps_are_refused(target, tmp_path):
    directory = exported(random_head(target, "eagle3"), tmp_path, "vllm")
    d2t, t2d = load_file(str(directory / "model.safetensors"))["d2t"], load_file(str(directory / "model.safetensors"))["t2d"]
    duplicate = d2t.clone()
    duplicate[1] = d2t[0] - 1  # draft ids 0 and 1 onto one target id
    with pytest.raises(ValueError, match="d2t maps .* inconsistent"):
        published.load_published(edit(directory, weights={"d2t": duplicate}), target)
    shifted = t2d.clone()
    shifted[int(torch.nonzero(~t2d)[0])] = True
    with pytest.raises(ValueError, match="t2d does not mark exactly"):
        published.load_published(edit(directory, weights={"d2t": d2t, "t2d": shifted}), target)
    state = load_file(str(directory / "model.safetensors"))
    del state["d2t"]
    save_file(state, str(directory / "model.safetensors"))
    with pytest.raises(ValueError, match="no d2t map"):
        published.load_published(directory, target)


def test_config_dialects_and_pickled_weights(target, tmp_path):
    directory = exported(random_head(target, "eagle3"), tmp_path, "sglang")
    assert published.load_published(directory, target).config.feature_layers == LAYERS  # eagle_config: output ids + 1
    raw = json.loads((directory / "config.json").read_text())
    del raw["eagle_config"]
    (directory / "config.json").write_text(json.dumps({"architectures": ["EAGLEModel"], "model": raw}))  # vLLM's older nesting
    assert published.load_published(directory, target).config.feature_layers == (2, 2, 1)  # the default 2, L/2, L-3
    state = load_file(str(directory / "model.safetensors"))
    (directory / "model.safetensors").unlink()
    torch.save(state, directory / "pytorch_model.bin")
    assert published.load_published(directory, target).config.arch == "eagle3"
    torch.save({**state, "extra": Path(".")}, directory / "pytorch_model.bin")  # a pickle holding more than tensors
    with pytest.raises(ValueError, match="not a plain state dict"):
        published.load_published(directory, target)


def test_an_embedding_copy_is_shared_with_the_target_and_a_different_one_kept(target, tmp_path):
    embedding = target.model.get_input_embeddings().weight.detach().clone()
    directory = edit(exported(random_head(target, "eagle1"), tmp_path, "sglang"), weights={"embed_tokens.weight": embedding})
    drafter = build("eagle", target, checkpoint=str(directory))
    ids = torch.tensor([[1, 5, 9]])
    assert not drafter.head.config.own_embedding and torch.equal(drafter.embed(ids), embedding[ids])  # the target's table
    directory = edit(directory, weights={"embed_tokens.weight": embedding + 1})
    drafter = build("eagle", target, checkpoint=str(directory))
    assert drafter.head.config.own_embedding and drafter.embed is drafter.head.embed_tokens
    assert SpecDecoder(target, drafter, reference.verify).generate(PROMPTS, 8, SamplingParams(0.0)).outputs == \
        greedy_outputs(target, PROMPTS, 8)


def test_export_refuses_what_no_engine_would_compute(target, tmp_path):
    save_head(EagleHead(EagleConfig.for_target(target)), tmp_path / "native")
    with pytest.raises(ValueError, match="native EAGLE architecture.*train.arch=eagle3"):
        published.export(tmp_path / "native", tmp_path / "out", "vllm")
    with pytest.raises(ValueError, match="vLLM's EAGLE-1 model has no fc bias"):
        exported(random_head(target, "eagle1", fc_bias=True), tmp_path, "vllm")
    with pytest.raises(ValueError, match="sglang captures target layers 1..3"):
        exported(PublishedEagleHead(EagleConfig.for_target(target, (0, 1, 2), 48, "eagle3"), torch.arange(48)),
                 tmp_path, "sglang", "zero")


def refused(main, args: list[str], capsys) -> str:
    """specdec-export's one line for bad input (exit status 2)."""
    with pytest.raises(SystemExit) as exit:
        main(args)
    [line] = capsys.readouterr().err.strip().splitlines()
    assert exit.value.code == 2 and line.startswith("specdec-export: error: ")
    return line


def test_specdec_export_command(target, tmp_path, capsys):
    from experiments.export import main

    save_head(random_head(target, "eagle3"), tmp_path / "head")
    main([str(tmp_path / "head"), str(tmp_path / "out"), "--engine", "sglang"])
    assert published.layout(tmp_path / "out") == "eagle3"
    save_head(EagleHead(EagleConfig.for_target(target)), tmp_path / "native")
    assert "train.arch=eagle3" in refused(main, [str(tmp_path / "native"), str(tmp_path / "out2"), "--engine", "vllm"], capsys)
    assert not (tmp_path / "out2").exists()
    # an earlier export is replaced (vLLM's layout names the layers by input), anything more is refused
    main([str(tmp_path / "head"), str(tmp_path / "out"), "--engine", "vllm"])
    assert "eagle_aux_hidden_state_layer_ids" in json.loads((tmp_path / "out" / "config.json").read_text())
    (tmp_path / "out" / "notes.txt").write_text("mine")
    assert "holds more than an earlier export" in refused(main, [str(tmp_path / "head"), str(tmp_path / "out"), "--engine", "sglang"], capsys)
    with pytest.raises(FileExistsError, match="holds more than an earlier export"):
        published.export(tmp_path / "head", tmp_path / "out", "sglang")
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"
    assert "--target is for Medusa heads" in refused(
        main, [str(tmp_path / "head"), str(tmp_path / "out3"), "--engine", "vllm", "--target", str(tmp_path)], capsys)


def test_llama3_rope_scaling_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    config = LlamaConfig(hidden_size=512, num_attention_heads=4, rope_theta=500000.0, rope_scaling=scaling,
                         max_position_embeddings=1024)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = rope_frequencies(128, 500000.0, scaling)
    assert torch.allclose(ours, expected.float(), rtol=1e-5) and not torch.allclose(ours, rope_frequencies(128, 500000.0, None))


def teacher_forced(target, head, tokens):  # features [1, T, n*H], embeddings [1, T, H] of a sequence
    hidden = target.prefill([torch.tensor(tokens + [0])], head.config.feature_layers).hidden
    features = torch.cat([h[:, : len(tokens)] for h in hidden], -1)
    return features[:, :-1], target.model.get_input_embeddings()(torch.tensor([tokens[1:]]))


def with_export(reference_model, directory, target):
    """A reference implementation's model holding our export, and the target's embedding, which the
    engines share with the target rather than read from the draft checkpoint."""
    state = load_file(str(directory / "model.safetensors"))
    state["embed_tokens.weight"] = target.model.get_input_embeddings().weight.detach()
    reference_model.load_state_dict(state)
    return reference_model


@pytest.mark.slow  # importing the reference package takes seconds to tens of seconds
def test_specforge_reference_model_loads_our_export(target, tmp_path):
    """SpecForge's own EAGLE-3 model class (pip install --no-deps specforge) computes our logits."""
    module = pytest.importorskip("specforge.modeling.draft.llama3_eagle")
    from transformers import LlamaConfig

    head = random_head(target, "eagle3")
    directory = exported(head, tmp_path, "sglang")
    config = json.loads((directory / "config.json").read_text())
    reference_model = with_export(module.LlamaForCausalLMEagle3(LlamaConfig(**config)).eval(), directory, target)
    features, embeddings = teacher_forced(target, head, PROMPTS[0] + PROMPTS[2])
    with torch.no_grad():
        length = features.shape[1]
        h = reference_model.backbone(input_embeds=embeddings, hidden_states=reference_model.project_hidden_states(features),
                                     cache_hidden=None, attention_mask=None,
                                     position_ids=torch.arange(length)[None], use_cache=False)
        expected = reference_model.compute_logits(h)
        ours = head.draft_logits(head.forward_sequence(features, embeddings))
    assert torch.allclose(ours, expected, atol=1e-4)


@pytest.mark.slow  # importing the reference package takes seconds to tens of seconds
def test_eagle_reference_model_loads_our_export(target, tmp_path):
    """EAGLE's own EAGLE-1/2 model class (pip install --no-deps eagle-llm) computes our logits."""
    cnets = pytest.importorskip("eagle.model.cnets")
    from eagle.model.configs import EConfig

    head = random_head(target, "eagle1")
    directory = exported(head, tmp_path, "sglang")
    config = json.loads((directory / "config.json").read_text())
    config = EConfig(**config)
    config.rope_scaling = None  # transformers 5 fills in a default dict that this 2024 code cannot read
    reference_model = with_export(cnets.Model(config, bias=True).eval(), directory, target)
    tokens = PROMPTS[0] + PROMPTS[2]
    features, embeddings = teacher_forced(target, head, tokens)
    with torch.no_grad():
        expected = reference_model(features, torch.tensor([tokens[1:]]))
        ours = head.forward_sequence(features, embeddings)
    assert torch.allclose(ours, expected, atol=1e-4)


def test_a_head_trained_here_exports_and_drafts_in_the_published_layout(target, tmp_path):
    """train.arch=eagle3: the published EAGLE-3 head learns here and drafts the same after export."""
    from test_training import make_cache

    from drafters.training.eagle_training import eagle_method
    from drafters.training.features import FeatureCache
    from drafters.training.trainer import TrainConfig, train

    prompts = [[i, (7 * i) % 128, (13 * i) % 128] for i in range(6)]
    continuations = greedy_outputs(target, prompts, 21)
    directory, _ = make_cache(tmp_path, target, [p + c for p, c in zip(prompts, continuations)], layers=(*LAYERS, 5))
    method = eagle_method("eagle3", feature_layers=list(LAYERS), unroll=2, regression_weight=0.0, feature_noise=0.0,
                          draft_vocab=100, arch="eagle3")
    torch.manual_seed(0)
    prepared = method.prepare(target, FeatureCache(directory), 3, 0, [0, 1, 2])
    head = prepared.model
    assert isinstance(head, PublishedEagleHead) and bool((head.draft_ids[1:] > head.draft_ids[:-1]).all())
    logged = []
    train(head, prepared.batches, prepared.loss, TrainConfig(steps=40, lr=3e-3, warmup_steps=5, checkpoint_every=40,
                                                             log_every=20), tmp_path / "run", lambda s, m: logged.append(m))
    assert logged[-1]["accuracy_0"] > 0.8
    method.export(head, tmp_path / "head", {})
    published.export(tmp_path / "head", tmp_path / "vllm", "vllm")
    drafter = build("eagle3", target, checkpoint=str(tmp_path / "vllm"), depth=3, top_k=1, total_tokens=3)
    out = SpecDecoder(target, drafter, reference.verify).generate(prompts[:2], 12, SamplingParams(0.0))
    assert out.outputs == greedy_outputs(target, prompts[:2], 12) and out.stats.tau > 2
    with pytest.raises(ValueError, match="arch: checkpoint 'eagle3', settings 'native'"):
        eagle_method("eagle3", feature_layers=list(LAYERS), draft_vocab=100).prepare(
            target, FeatureCache(directory), 4, 0, [0], head=method.load(target, tmp_path / "head"))
    assert math.isfinite(logged[-1]["loss"])
