"""Medusa heads in the published layouts (Medusa's medusa_lm_head.*, vLLM's MedusaModel): loading
drafts what the native head they were converted from drafts, and what the published function
computes; export to vLLM round-trips bit for bit; mismatched or unsafe checkpoints are refused."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tiny_models import tiny_model

from drafters.base import build
from drafters.formats import medusa as published
from drafters.medusa import MedusaConfig, MedusaDrafter, MedusaHeads, load_heads, save_heads, with_tree
from specdec.decode import SpecDecoder
from specdec.protocols import DraftContext
from specdec.sampling import SamplingParams
from specdec.target import HFTarget
from specdec.tree import sorted_paths
from verifiers import reference

GREEDY = SamplingParams(0.0)
TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
PROMPT = [5, 9, 2, 7]


class Payload:
    """Not a tensor: torch.load(weights_only=True) must refuse to unpickle it."""


@pytest.fixture(scope="module")
def target() -> HFTarget:
    return HFTarget(tiny_model("llama", sharpness=4.0))


def lm_rows(target) -> torch.Tensor:  # [V, H]
    return target.model.get_output_embeddings().weight.detach()


def random_heads(target, num_layers=1, own_lm_heads=False, draft_ids=None, seed=0) -> MedusaHeads:
    size = target.vocab_size if draft_ids is None else len(draft_ids)
    config = replace(MedusaConfig.for_target(target, 3, size), num_layers=num_layers, own_lm_heads=own_lm_heads)
    heads = MedusaHeads(config, draft_ids)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        heads.weight.copy_(torch.randn(heads.weight.shape, generator=generator) * 0.5 / target.hidden_size**0.5)
        heads.bias.copy_(torch.randn(heads.bias.shape, generator=generator) * 0.1)
        if own_lm_heads:  # the target's rows, moved: heads whose LM heads are their own
            noise = torch.randn(heads.lm_heads.shape, generator=generator)
            heads.lm_heads.copy_(lm_rows(target)[heads.draft_ids] + noise)
    return heads.eval()


def blocks_of(heads: MedusaHeads) -> tuple[torch.Tensor, torch.Tensor]:  # [K, L, H, H], [K, L, H]
    k, h = heads.config.num_heads, heads.config.hidden_size
    return heads.weight.detach().view(k, -1, h, h), heads.bias.detach().view(k, -1, h)


def write_medusa_layout(heads: MedusaHeads, rows: torch.Tensor, directory, pickled: bool = False) -> None:
    """Medusa's own layout, written by hand: head k = '{k}.{j}.linear.*' blocks, then '{k}.{L}.weight'."""
    weight, bias = blocks_of(heads)
    k, layers = weight.shape[:2]
    state = {}
    for head in range(k):
        for layer in range(layers):
            state[f"{head}.{layer}.linear.weight"] = weight[head, layer].clone()
            state[f"{head}.{layer}.linear.bias"] = bias[head, layer].clone()
        state[f"{head}.{layers}.weight"] = rows[head].clone()  # [V, H]
    directory.mkdir(parents=True)
    if pickled:
        torch.save(state, directory / "medusa_lm_head.pt")
    else:
        save_file(state, str(directory / "medusa_lm_head.safetensors"))
    # a published config may understate the heads (Medusa's loader then trusts the weights)
    config = {"medusa_num_heads": 2, "medusa_num_layers": layers, "base_model_name_or_path": "tiny-llama"}
    (directory / "config.json").write_text(json.dumps(config))


def drafted(drafter, target) -> torch.Tensor:  # [N] the tree's tokens after PROMPT
    prompt = torch.tensor(PROMPT)
    features = target.prefill([prompt], (target.num_layers + 1,)).hidden[0]  # [1, 3, H]
    ctx = DraftContext(prompt[None], torch.tensor([len(PROMPT)]), (features,), torch.tensor([len(PROMPT) - 1]), GREEDY, None)
    return drafter.propose(ctx).tokens[0]


def published_function_tokens(target, weight, bias, rows, token_map, tree) -> torch.Tensor:  # [N]
    """The published heads' function written out: x <- x + SiLU(W x + b) per block, then the head's
    LM head; with a token_map every other token scores -inf (vLLM). The tree's tokens by rank."""
    prompt = torch.tensor(PROMPT)
    feature = target.prefill([prompt], (target.num_layers + 1,)).hidden[0][0, -1]  # [H] f_t
    vocab = target.vocab_size
    candidates = []
    for head in range(weight.shape[0]):
        x = feature
        for layer in range(weight.shape[1]):
            x = x + F.silu(weight[head, layer] @ x + bias[head, layer])
        logits = rows[min(head, len(rows) - 1)] @ x  # [D]
        if token_map is not None:
            logits = torch.full((vocab,), -torch.inf).index_copy(0, token_map, logits)
        candidates.append(logits.topk(3).indices)
    return torch.stack([candidates[len(path) - 1][path[-1]] for path in sorted_paths(TREE)])


def assert_greedy_exact(target, drafter) -> None:
    prompts = [PROMPT, [42, 1, 3]]
    plain = SpecDecoder(target, None, reference.verify).generate(prompts, 12, GREEDY)
    assert SpecDecoder(target, drafter, reference.verify).generate(prompts, 12, GREEDY).outputs == plain.outputs


@pytest.mark.parametrize("pickled", [False, True])
def test_medusa_layout_with_the_targets_lm_head_loads_as_the_native_shared_head(tmp_path, target, pickled):
    native = random_heads(target)
    rows = lm_rows(target)[None].expand(3, -1, -1)  # every head's LM head = the target's (Medusa's init)
    write_medusa_layout(native, rows, tmp_path / "medusa", pickled=pickled)
    assert published.detect(tmp_path / "medusa")
    loaded = published.load_published(tmp_path / "medusa", target)
    assert not loaded.config.own_lm_heads and loaded.config.num_heads == 3  # the weights decide K, not the config
    assert all(torch.equal(a, b) for a, b in zip(native.state_dict().values(), loaded.state_dict().values()))
    assert torch.equal(drafted(MedusaDrafter(target, loaded, TREE), target), drafted(MedusaDrafter(target, native, TREE), target))


def test_medusa_layout_with_own_lm_heads_and_two_blocks_drafts_the_published_function(tmp_path, target):
    native = random_heads(target, num_layers=2, own_lm_heads=True, seed=1)
    write_medusa_layout(native, native.lm_heads.detach(), tmp_path / "medusa", pickled=True)
    loaded = published.load_published(tmp_path / "medusa", target)
    assert loaded.config.own_lm_heads and loaded.config.num_layers == 2
    assert all(torch.equal(a, b) for a, b in zip(native.state_dict().values(), loaded.state_dict().values()))
    tokens = drafted(MedusaDrafter(target, loaded, TREE), target)
    assert torch.equal(tokens, drafted(MedusaDrafter(target, native, TREE), target))
    weight, bias = blocks_of(native)
    expected = published_function_tokens(target, weight, bias, native.lm_heads.detach(), None, TREE)
    assert torch.equal(tokens, expected)
    # the head's own LM heads matter: the target's would draft other tokens
    assert not torch.equal(tokens, drafted(MedusaDrafter(target, random_heads(target, num_layers=2, seed=1), TREE), target))


def test_vllm_layout_with_token_map_and_no_bias_drafts_the_published_function(tmp_path, target):
    generator = torch.Generator().manual_seed(2)
    k, h, d = 3, target.hidden_size, 40
    weight = torch.randn(k, 1, h, h, generator=generator) * 0.5 / h**0.5
    rows = torch.randn(k, d, h, generator=generator)  # [K, D, H] per-head LM heads over the token map
    token_map = torch.randperm(target.vocab_size, generator=generator)[:d]
    state = {f"medusa_heads.blocks.{i}.layers.0.weight": weight[i, 0] for i in range(k)}
    state |= {f"medusa_heads.lm_heads.{i}.weight": rows[i] for i in range(k)} | {"token_map": token_map}
    (tmp_path / "vllm").mkdir()
    save_file(state, str(tmp_path / "vllm" / "model.safetensors"))
    config = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": h, "vocab_size": target.vocab_size,
              "num_heads": k, "num_hidden_layers": 1, "truncated_vocab_size": d, "original_lm_head": False,
              "medusa_fc_bias": False}
    (tmp_path / "vllm" / "config.json").write_text(json.dumps(config))
    assert published.detect(tmp_path / "vllm")
    drafter = build("medusa", target, checkpoint=str(tmp_path / "vllm"), tree=[list(p) for p in TREE])
    assert torch.equal(drafter.heads.draft_ids, token_map)
    expected = published_function_tokens(target, weight, torch.zeros(k, 1, h), rows, token_map, TREE)
    assert torch.equal(drafted(drafter, target), expected)
    assert_greedy_exact(target, drafter)  # lossless whatever the heads draft


def test_published_heads_draft_the_top1_chain_unless_given_a_tree(tmp_path, target):
    write_medusa_layout(random_heads(target), lm_rows(target)[None].expand(3, -1, -1), tmp_path / "medusa")
    checkpoint = str(tmp_path / "medusa")
    assert build("medusa", target, checkpoint=checkpoint).parents.tolist() == [-1, 0, 1]  # a chain, one node per head
    assert build("medusa", target, checkpoint=checkpoint, depth=2).parents.tolist() == [-1, 0]
    assert len(build("medusa", target, checkpoint=checkpoint, tree=[[0], [1], [0, 0]]).parents) == 3
    with pytest.raises(ValueError, match="no measured accuracies.*tree="):
        build("medusa", target, checkpoint=checkpoint, total_tokens=8)
    with pytest.raises(ValueError, match="either tree .* or total_tokens"):
        build("medusa", target, checkpoint=checkpoint, tree=[[0]], depth=1)
    with pytest.raises(ValueError, match="at most num_heads=3 deep"):
        build("medusa", target, checkpoint=checkpoint, tree=[[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]])


@pytest.fixture(scope="module")
def target_folder(tmp_path_factory, target):
    folder = tmp_path_factory.mktemp("target") / "tiny-llama"
    target.model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("own_lm_heads", [False, True])
def test_export_to_vllm_round_trips_bit_for_bit_and_drafts_our_top1(tmp_path, target, target_folder, own_lm_heads):
    draft_ids = torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(3))[:50]
    heads = random_heads(target, own_lm_heads=own_lm_heads, draft_ids=draft_ids, seed=3)
    accuracies = [[0.5, 0.2, 0.1], [0.3, 0.1, 0.05], [0.2, 0.1, 0.0]]
    with_tree(heads, accuracies, TREE)
    save_heads(heads.half(), tmp_path / "ours")  # checkpoints are stored in half precision, as training exports them
    assert not published.detect(tmp_path / "ours")
    published.export(tmp_path / "ours", tmp_path / "vllm", "vllm", target_dir=target_folder)

    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert {k: config[k] for k in ("model_type", "num_heads", "num_hidden_layers", "truncated_vocab_size",
                                   "vocab_size", "hidden_size", "original_lm_head", "medusa_fc_bias")} == {
        "model_type": "medusa", "num_heads": 3, "num_hidden_layers": 1, "truncated_vocab_size": 50,
        "vocab_size": target.vocab_size, "hidden_size": target.hidden_size, "original_lm_head": not own_lm_heads,
        "medusa_fc_bias": True}
    assert config["base_model_name_or_path"] == str(target_folder)
    assert '"method": "medusa"' in published.serve_command(tmp_path / "vllm", "vllm")
    tensors = load_file(str(tmp_path / "vllm" / "model.safetensors"))
    assert torch.equal(tensors["token_map"], draft_ids)
    assert sorted(k for k in tensors if k.startswith("lm_heads")) == (
        ["lm_heads.0.weight", "lm_heads.1.weight", "lm_heads.2.weight"] if own_lm_heads else ["lm_heads.0.weight"])

    native = load_heads(tmp_path / "ours", target)
    loaded = published.load_published(tmp_path / "vllm", target)
    assert loaded.config == native.config  # measured accuracies, tree and variant come back too
    assert native.state_dict().keys() == loaded.state_dict().keys()
    assert all(torch.equal(native.state_dict()[k], loaded.state_dict()[k]) for k in native.state_dict())
    ours = drafted(MedusaDrafter(target, native, TREE), target)
    assert torch.equal(drafted(build("medusa", target, checkpoint=str(tmp_path / "vllm")), target), ours)

    # what vLLM computes from the exported tensors (top-1 per head, -inf outside the token map) is our rank-0 draft
    k, h = 3, target.hidden_size
    weight = torch.stack([tensors[f"blocks.{i}.layers.0.weight"] for i in range(k)])[:, None].float()
    bias = torch.stack([tensors[f"blocks.{i}.layers.0.bias"] for i in range(k)])[:, None].float()
    rows = torch.stack([tensors[f"lm_heads.{i}.weight"] for i in range(k if own_lm_heads else 1)]).float()
    engine = published_function_tokens(target, weight, bias, rows, tensors["token_map"], TREE)
    rank0 = [i for i, path in enumerate(sorted_paths(TREE)) if set(path) == {0}]
    assert torch.equal(engine[rank0], ours[rank0])

    # import -> our layout -> export again: the same files
    save_heads(loaded.half(), tmp_path / "again")
    published.export(tmp_path / "again", tmp_path / "vllm-again", "vllm", target_dir=target_folder)
    again = load_file(str(tmp_path / "vllm-again" / "model.safetensors"))
    assert tensors.keys() == again.keys() and all(torch.equal(tensors[k], again[k]) for k in tensors)
    assert json.loads((tmp_path / "vllm-again" / "config.json").read_text()) == config


def test_specdec_export_finds_the_target_the_heads_were_trained_for(tmp_path, target_folder, capsys):
    from transformers import AutoModelForCausalLM

    from experiments.export import main

    target = HFTarget(AutoModelForCausalLM.from_pretrained(target_folder).eval(), folder=target_folder)  # named after it
    heads = with_tree(random_heads(target, draft_ids=torch.arange(60, 100)), [[0.5], [0.2], [0.1]], [(0,), (0, 0)])
    save_heads(heads, tmp_path / "ours")
    main([str(tmp_path / "ours"), str(tmp_path / "vllm"), "--engine", "vllm"])
    assert f"vllm serve {target_folder} --speculative-config" in capsys.readouterr().out
    loaded = published.load_published(tmp_path / "vllm", target)
    assert loaded.config == heads.config and torch.equal(loaded.weight, heads.weight)
    with pytest.raises(SystemExit) as exit:
        main([str(tmp_path / "ours"), str(tmp_path / "sglang"), "--engine", "sglang"])
    assert exit.value.code == 2 and "SGLang has no Medusa drafter" in capsys.readouterr().err


def test_heads_for_another_target_are_refused_naming_the_mismatch(tmp_path, target):
    other = HFTarget(tiny_model("llama", vocab_size=100))  # same hidden size, smaller vocabulary
    write_medusa_layout(random_heads(other), lm_rows(other)[None].expand(3, -1, -1), tmp_path / "small-vocab")
    with pytest.raises(ValueError, match=r"tiny-llama.*do not fit.*vocabulary: heads 100, target 128"):
        build("medusa", target, checkpoint=str(tmp_path / "small-vocab"))
    narrow = {"0.0.linear.weight": torch.zeros(32, 32), "0.0.linear.bias": torch.zeros(32), "0.1.weight": torch.zeros(128, 32)}
    (tmp_path / "narrow").mkdir()
    save_file(narrow, str(tmp_path / "narrow" / "medusa_lm_head.safetensors"))
    (tmp_path / "narrow" / "config.json").write_text(json.dumps({"medusa_num_heads": 1, "medusa_num_layers": 1}))
    with pytest.raises(ValueError, match="hidden size: heads 32, target 64; .*LM head width: heads 32, target 64"):
        published.load_published(tmp_path / "narrow", target)


def test_unsafe_incomplete_and_inconsistent_checkpoints_are_clear_errors(tmp_path, target):
    write_medusa_layout(random_heads(target), lm_rows(target)[None].expand(3, -1, -1), tmp_path / "unsafe", pickled=True)
    state = torch.load(tmp_path / "unsafe" / "medusa_lm_head.pt", weights_only=True)
    torch.save({**state, "payload": Payload()}, tmp_path / "unsafe" / "medusa_lm_head.pt")
    with pytest.raises(ValueError, match="not a plain state dict of tensors.*weights_only"):
        published.load_published(tmp_path / "unsafe", target)

    write_medusa_layout(random_heads(target), lm_rows(target)[None].expand(3, -1, -1), tmp_path / "missing")
    state = load_file(str(tmp_path / "missing" / "medusa_lm_head.safetensors"))
    del state["1.0.linear.bias"]
    save_file(state, str(tmp_path / "missing" / "medusa_lm_head.safetensors"))
    with pytest.raises(ValueError, match="every block needs a bias"):
        published.load_published(tmp_path / "missing", target)

    (tmp_path / "unsafe" / "medusa_lm_head.pt").unlink()
    assert published.detect(tmp_path / "unsafe")  # Medusa's config alone names the layout
    with pytest.raises(FileNotFoundError, match="holds no Medusa head weights"):
        build("medusa", target, checkpoint=str(tmp_path / "unsafe"))

    (tmp_path / "vllm").mkdir()
    h = target.hidden_size
    save_file({"blocks.0.layers.0.weight": torch.zeros(h, h), "blocks.0.layers.0.bias": torch.zeros(h),
               "lm_heads.0.weight": torch.zeros(target.vocab_size, h)}, str(tmp_path / "vllm" / "model.safetensors"))
    config = {"model_type": "medusa", "hidden_size": h, "vocab_size": target.vocab_size, "num_heads": 1, "num_hidden_layers": 1}
    (tmp_path / "vllm" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="medusa_fc_bias is not true, so vLLM would drop them"):
        published.load_published(tmp_path / "vllm", target)
    (tmp_path / "vllm" / "config.json").write_text(json.dumps({**config, "medusa_fc_bias": True, "num_heads": 2}))
    with pytest.raises(ValueError, match="declares 2 heads, the weights hold 1"):
        published.load_published(tmp_path / "vllm", target)
    (tmp_path / "vllm" / "config.json").write_text(json.dumps({**config, "medusa_fc_bias": True, "truncated_vocab_size": 10}))
    with pytest.raises(ValueError, match="needs a token_map of 10 token ids"):
        published.load_published(tmp_path / "vllm", target)


def test_export_refuses_sglang_foreign_folders_and_unknown_targets(tmp_path, target, target_folder):
    heads = with_tree(random_heads(target), [[0.5], [0.2], [0.1]], [(0,), (0, 0)])
    save_heads(heads, tmp_path / "ours")
    with pytest.raises(ValueError, match="SGLang has no Medusa drafter.*engine=vllm"):
        published.export(tmp_path / "ours", tmp_path / "out", "sglang")
    with pytest.raises(ValueError, match="engine must be one of vllm, sglang"):
        published.export(tmp_path / "ours", tmp_path / "out", "tgi")
    with pytest.raises(ValueError, match="not a folder here; pass the target's Hugging Face folder"):
        published.export(tmp_path / "ours", tmp_path / "out", "vllm")
    write_medusa_layout(random_heads(target), lm_rows(target)[None].expand(3, -1, -1), tmp_path / "medusa")
    with pytest.raises(ValueError, match="already holds Medusa heads in a published layout"):
        published.export(tmp_path / "medusa", tmp_path / "out", "vllm", target_dir=target_folder)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="holds more than an earlier export"):
        published.export(tmp_path / "ours", tmp_path / "busy", "vllm", target_dir=target_folder)
    other = HFTarget(tiny_model("llama", vocab_size=100))
    save_heads(with_tree(random_heads(other), [[0.5], [0.2], [0.1]], [(0,)]), tmp_path / "foreign")
    with pytest.raises(ValueError, match=r"LM head is \[128, 64\] but .* vocabulary 100"):
        published.export(tmp_path / "foreign", tmp_path / "out", "vllm", target_dir=target_folder)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_bundled_smollm2_heads_export_for_vllm_and_load_back(tmp_path):
    from drafters.heads import bundled_checkpoint
    from experiments.common.prompt_sets import encode_prompt, load_mtbench
    from specdec.packaged_models import load_smollm2

    model, tokenizer = load_smollm2()
    target = HFTarget(model, key="smollm2")
    bundled = bundled_checkpoint("medusa", "medusa", "smollm2")
    published.export(bundled, tmp_path / "vllm", "vllm")  # the target's folder found from the checkpoint's config
    native, loaded = load_heads(bundled, target), published.load_published(tmp_path / "vllm", target)
    assert loaded.config == native.config and not loaded.config.own_lm_heads
    assert all(torch.equal(native.state_dict()[k], loaded.state_dict()[k]) for k in native.state_dict())
    prompts = [encode_prompt(tokenizer, p) for p in load_mtbench(2)]
    ours = SpecDecoder(target, build("medusa", target), reference.verify).generate(prompts, 16, GREEDY)
    exported = SpecDecoder(target, build("medusa", target, checkpoint=str(tmp_path / "vllm")), reference.verify)
    result = exported.generate(prompts, 16, GREEDY)
    assert result.outputs == ours.outputs and result.stats.tau == ours.stats.tau  # the same drafts, step by step


def test_training_does_not_continue_heads_of_the_published_shape(tmp_path, target):
    """Medusa's loss applies the target's LM head after one block per head, so continuing heads
    with their own LM heads or several blocks would train another function: refused."""
    from drafters.medusa import save_heads
    from drafters.training.medusa_training import MedusaMethod

    def measured(heads: MedusaHeads) -> MedusaHeads:  # a tree, as an export after training leaves
        k = heads.config.num_heads
        heads.config = dataclasses.replace(heads.config, accuracies=((0.5, 0.25),) * k, tree=((0,), (1,)))
        return heads

    method = MedusaMethod(num_heads=2, head_decay=0.8, draft_vocab=16, tree_top_k=2, total_tokens=4)
    save_heads(measured(random_heads(target, num_layers=2, own_lm_heads=True)), tmp_path / "published")
    with pytest.raises(ValueError, match="published shape .2 blocks per head, own LM heads: True"):
        method.load(target, tmp_path / "published")
    save_heads(measured(random_heads(target)), tmp_path / "native")
    assert method.load(target, tmp_path / "native").config.num_layers == 1
