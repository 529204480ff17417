"""Gemma 3 as a target: sliding-window and global layers (a tree's rows must see only the last
``sliding_window`` keys of their own path in the sliding layers), every drafter that needs no
training greedy-equal to plain decoding and to transformers' own generate(), on a tiny random
Gemma 3 (window 8, so that trees cross it cheaply) and on the packaged Gemma 3 270M (slow)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from sequence_stats import ALPHA, required_samples, sequence_verdict
from test_hf_target import exact_hf_distribution
from tiny_models import full_logits, greedy_outputs, tiny_model

from drafters import base as drafter_registry
from drafters.retrieval import Datastore
from specdec.decode import SpecDecoder
from specdec.protocols import VerifyResult
from specdec.sampling import SamplingParams
from specdec.target import HFTarget
from specdec.tree import SiblingMode, tree_from_parents
from verifiers import reference

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "drafter"
GREEDY = SamplingParams(0.0)
# every drafter config that needs no trained weights (the unions of such members included)
UNTRAINED = ["ngram", "ngram_self", "recycling", "lookahead", "layerskip", "retrieval"]


def shipped_options(name: str, **changes) -> tuple[str, dict]:
    """configs/drafter/NAME.yaml as (registered name, the factory's options), with ``changes``."""
    options = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text()) | changes
    return options.pop("name"), options


def member(union: str, name: str) -> dict:
    """The options of member ``name`` in the shipped configs/drafter/UNION.yaml."""
    return next(m for m in shipped_options(union)[1]["members"] if m["name"] == name)


def untrained_unions(datastore) -> dict[str, tuple[str, dict]]:
    """The shipped unions' training-free members (their EAGLE-3 member left out), merged as
    drafter=union merges, and adaptively as drafter=union_adaptive weighs them (retrieval over ``datastore``)."""
    ngram, recycling = member("union", "ngram"), member("union_recycling", "recycling")
    retrieval = member("union_retrieval", "retrieval") | {"datastore": datastore}
    adaptive = {k: v for k, v in shipped_options("union_adaptive")[1].items() if k not in ("members", "cost_batch")}
    return {
        "union-ngram-recycling": ("union", {"members": [ngram, recycling]}),
        "union-ngram-retrieval": ("union", {"members": [ngram, retrieval]}),
        "union-adaptive-untrained": ("union", adaptive | {"members": [ngram, recycling, retrieval]}),
    }


def every_untrained_drafter(target, datastore, tmp_path, layerskip: dict) -> dict[str, object]:
    """Each drafter that needs no training, as its shipped YAML configures it (retrieval over
    ``datastore``, layer skip with ``layerskip``'s changes), built for ``target``."""
    configs = {name: shipped_options(name) for name in UNTRAINED}
    configs["retrieval"][1]["datastore"] = datastore
    configs["layerskip"][1].update(layerskip)
    configs.update(untrained_unions(datastore))
    return {label: drafter_registry.build(kind, target, **options) for label, (kind, options) in configs.items()}


def test_the_tiny_gemma3_alternates_sliding_and_global_layers():
    model = tiny_model("gemma3")
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.config.sliding_window == 8
    assert model.config.layer_types == ["sliding_attention", "full_attention"]
    target = HFTarget(model)
    assert (target._window, target._layer_kinds) == (8, ("sliding_attention", "full_attention"))


def tree_rows_match_paths_alone(target: HFTarget, model, steps: int = 4) -> float:
    """The largest gap between a tree row's logits and the same path's logits run alone, over
    ragged trees and commits from prompts that already span the sliding window."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (n,), generator=generator).tolist() for n in (13, 6, 21)]
    sequences = [list(p) for p in prompts]
    target.prefill([torch.tensor(p) for p in prompts], ())
    parents = [-1, 0, 1, 2, 0, -1, 5]  # a chain 4 deep beside two short branches
    worst = 0.0
    for step in range(steps):
        tokens = torch.randint(0, 128, (3, len(parents)), generator=generator)
        tree = tree_from_parents(tokens, parents, SiblingMode.DETERMINISTIC, num_nodes=torch.tensor([7, 4, 7]))
        out = target.forward_tree(tree, ())
        for b, seq in enumerate(sequences):
            worst = max(worst, float((out.logits[b, 0] - full_logits(model, seq)[-1]).abs().max()))
            for path in tree.paths()[b]:
                expected = full_logits(model, seq + tokens[b, path].tolist())[-len(path):]
                worst = max(worst, float((out.logits[b, [i + 1 for i in path]] - expected).abs().max()))
        choices = [[0, 1, 2, 3], [4], []] if step % 2 == 0 else [[5, 6], [0, 1], [0]]
        choices = [[i for i in path if i < int(tree.num_nodes[b])] for b, path in enumerate(choices)]
        accepted = torch.full((3, len(parents)), -1)
        for b, path in enumerate(choices):
            accepted[b, : len(path)] = torch.tensor(path, dtype=torch.int64)
        bonus = torch.randint(0, 128, (3,), generator=generator)
        target.commit(tree, VerifyResult(accepted, torch.tensor([len(c) for c in choices]), bonus))
        for b, path in enumerate(choices):
            sequences[b] += tokens[b, path].tolist() + [int(bonus[b])]
    return worst


def test_head_drafters_embed_with_the_bare_table_they_were_trained_on():
    """Gemma's embedding layer multiplies its table by sqrt(hidden size); heads train on the bare
    table (drafters/training/data.py), so every head drafter looks tokens up in it without that
    forward. Calling the layer had the bundled heads draft from inputs 25 times too large."""
    from test_dflash import random_head

    from drafters.dflash import DFlashDrafter
    from drafters.heads import token_embedding

    target = HFTarget(tiny_model("gemma3"))
    layer = target.model.get_input_embeddings()
    ids = torch.tensor([[3, 17, 40]])
    with torch.no_grad():
        assert not torch.equal(layer(ids), layer.weight[ids])  # the scale this is about
    assert torch.equal(token_embedding(target)(ids), layer.weight[ids])
    drafter = DFlashDrafter(target, random_head(target), depth=2)
    assert torch.equal(drafter.embed(ids), layer.weight[ids])


def test_tree_rows_past_the_sliding_window_equal_each_path_alone():
    """Contexts of 6-40 tokens against a window of 8: a deep node's sliding layers must drop the
    keys its own path pushes out of the window, in the cache and in the tree alike."""
    model = tiny_model("gemma3", sharpness=4.0)
    assert tree_rows_match_paths_alone(HFTarget(model), model) < 1e-5


def test_a_mask_without_the_window_is_caught():
    """Negative control: the same comparison with every layer's mask global fails."""
    model = tiny_model("gemma3", sharpness=4.0)
    target = HFTarget(model)
    target._window = None  # the masks then ignore the sliding window
    assert tree_rows_match_paths_alone(target, model, steps=1) > 1e-2


def test_plain_decoding_equals_transformers_generate_past_the_window():
    """Greedy plain decoding through HFTarget (its cache, masks and positions) against
    transformers' own generate() on an untouched copy of the model (its sliding-window cache)."""
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [3, 4], [20, 21, 22, 20, 21, 22, 20]]
    stock = tiny_model("gemma3", sharpness=4.0)
    expected = []
    for prompt in prompts:
        with torch.no_grad():
            out = stock.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, min_new_tokens=24)
        expected.append(out[0, len(prompt):].tolist())
    target = HFTarget(tiny_model("gemma3", sharpness=4.0))
    assert greedy_outputs(target, prompts, 24) == expected


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    target = HFTarget(tiny_model("gemma3", sharpness=4.0, layers=4))
    prompts = [[5, 6, 7, 8, 5, 6, 7, 9, 10, 11, 5, 6], [3], [9, 10, 11, 9, 10]]
    plain = greedy_outputs(target, prompts, 24)
    # a datastore of the target's own greedy text, so that retrieval's drafts are accepted now and then
    datastore = tmp_path_factory.mktemp("datastore") / "own-text"
    Datastore.build([p + o for p, o in zip(prompts, plain)], target.vocab_size).save(datastore)
    return target, prompts, plain, str(datastore)


def test_every_untrained_drafter_is_greedy_equal_on_gemma3(tiny_gemma3, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))  # layer skip caches its search
    target, prompts, plain, datastore = tiny_gemma3
    drafters = every_untrained_drafter(target, datastore, tmp_path, {"num_skip": 1, "calibration_tokens": 8})
    accepted = {}
    for label, drafter in drafters.items():
        out = SpecDecoder(target, drafter, reference.verify).generate(prompts, 24, GREEDY)
        assert out.outputs == plain, label
        accepted[label] = out.stats.tau
    assert accepted["ngram"] > 1 and accepted["retrieval"] > 1, accepted  # drafts were accepted: the trees were exercised


@pytest.mark.slow
@pytest.mark.parametrize("name", ["union-ngram-recycling", "lookahead"])
def test_sampled_decoding_through_the_sliding_window_is_exact(name, tmp_path):
    """T = 1 through Gemma 3's cache with the prompt already at the window's edge: the sequence
    distribution of the next 3 tokens equals the target's (chi-square)."""
    model = tiny_model("gemma3", vocab_size=8, sharpness=6.0)
    target = HFTarget(model)
    prompt, length, sampling = [1, 2, 3, 4, 5, 6, 7], 3, SamplingParams(1.0)
    kind, options = untrained_unions(None)[name] if name.startswith("union") else shipped_options(name)
    decoder = SpecDecoder(target, drafter_registry.build(kind, target, **options), reference.verify)
    exact = exact_hf_distribution(model, prompt, length, sampling)
    verdict = sequence_verdict(decoder, exact, prompt, length, 8, sampling, required_samples(8**length, tv=0.03), seed=3)
    assert verdict.impossible == 0 and verdict.p_value > ALPHA, verdict


# -- the packaged Gemma 3 270M (slow: a 1 GB float32 model, converted once into the cache) --

REAL_PROMPTS = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]


def generate_alone(model, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' own greedy generate() (its sliding-window cache), exactly new_tokens tokens."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def gemma3():
    from specdec.packaged_models import load_packaged

    stock, tokenizer = load_packaged("gemma3_270m")  # transformers' own modules, for generate()
    target = HFTarget(load_packaged("gemma3_270m")[0], packed_gemm_from="auto", key="gemma3_270m")  # as configs/target/gemma3_270m.yaml
    assert not getattr(tokenizer, "chat_template", None)  # a base model: prompts are raw text
    return stock, target, tokenizer


@pytest.fixture(scope="module")
def gemma3_plain(gemma3, tmp_path_factory):
    """Plain greedy decoding of two short prompts, checked against transformers' generate(), and a
    retrieval datastore over the target's tokens of other text (Gemma has no packaged one)."""
    stock, target, tokenizer = gemma3
    prompts = [tokenizer(text)["input_ids"] for text in REAL_PROMPTS]
    plain = greedy_outputs(target, prompts, 12)
    assert plain == [generate_alone(stock, prompt, 12) for prompt in prompts]
    corpus = ["The capital of Italy is Rome. The capital of Spain is Madrid.",
              "def factorial(n):\n    return 1 if n < 2 else n * factorial(n - 1)\n"]
    datastore = tmp_path_factory.mktemp("gemma3-datastore") / "corpus"
    Datastore.build([tokenizer(text)["input_ids"] for text in corpus], target.vocab_size).save(datastore)
    return prompts, plain, str(datastore)


@pytest.mark.slow
def test_gemma3_270m_is_the_model_it_says(gemma3):
    stock, target, tokenizer = gemma3
    config = target.model.config
    assert (target.vocab_size, target.num_layers, target.hidden_size, config.sliding_window) == (262_144, 18, 640, 512)
    assert (target._window, target._layer_kinds.count("full_attention")) == (512, 3)
    assert sum(p.numel() for p in stock.parameters()) == pytest.approx(268e6, rel=0.01)


@pytest.mark.slow
@pytest.mark.parametrize("label", [*UNTRAINED, *untrained_unions(None)])
def test_every_untrained_drafter_is_greedy_equal_on_gemma3_270m(label, gemma3, gemma3_plain, tmp_path, monkeypatch):
    """Plain decoding equals transformers' generate() (the fixture), and each training-free drafter,
    as its shipped YAML configures it, equals plain decoding."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))  # layer skip caches its search
    _, target, _ = gemma3
    prompts, plain, datastore = gemma3_plain
    kind, options = untrained_unions(datastore)[label] if label in untrained_unions(None) else shipped_options(label)
    if label == "retrieval":
        options["datastore"] = datastore
    if label == "layerskip":  # a shorter search on the target's own text than the shipped one
        options.update(calibration_prompts=2, calibration_tokens=16)
    out = SpecDecoder(target, drafter_registry.build(kind, target, **options), reference.verify).generate(prompts, 12, GREEDY)
    assert out.outputs == plain, label
    print(label, "tau", round(out.stats.tau, 3))


@pytest.mark.slow
def test_the_heads_bundled_for_gemma3_270m_load_by_the_target_and_are_greedy_equal(gemma3, gemma3_plain):
    """Every drafters/checkpoints/<kind>-gemma3_270m folder is what its drafter loads with no
    checkpoint on this target, and drafts greedy-equal to plain decoding; so do the shipped unions,
    whose EAGLE-3 member finds the bundled head the same way, and which read the union calibration
    tables bundled for Gemma 3 (tests/test_union_adaptive.py checks what those hold)."""
    from drafters.heads import BUNDLED
    from drafters.union import bundled_calibrations

    _, target, _ = gemma3
    prompts, plain, _ = gemma3_plain
    kinds = sorted(path.name.rsplit("-", 1)[0] for path in BUNDLED.glob("*-gemma3_270m"))
    assert {"mtp", "eagle3"} <= set(kinds)
    assert [path.name for path in bundled_calibrations(target)] == ["union-calibration-gemma3_270m.json",
                                                                    "union-calibration-gemma3_270m-t1.json"]
    for kind in [*kinds, "union", "union_adaptive"]:
        name, options = shipped_options(kind)
        options.pop("cost_batch", None)  # ${batch_size} in the YAML: the decoder's batch of one
        drafter = drafter_registry.build(name, target, **options)
        out = SpecDecoder(target, drafter, reference.verify).generate(prompts, 12, GREEDY)
        assert out.outputs == plain, kind
        assert out.stats.tau > 1.0, kind  # a head that never lands a draft is not the trained one


@pytest.mark.slow
def test_past_the_sliding_window_on_gemma3_270m(gemma3):
    """A prompt of about 700 tokens, so that every sliding layer drops keys while decoding: plain
    decoding equals generate(), and n-gram and Token Recycling trees equal plain decoding."""
    from experiments.common.long_context import load_long_context

    stock, target, tokenizer = gemma3
    text = load_long_context(1)[0].text
    prompt = tokenizer(text)["input_ids"][:700]
    assert len(prompt) == 700
    plain = greedy_outputs(target, [prompt], 16)
    assert plain == [generate_alone(stock, prompt, 16)]
    for name in ("ngram_self", "recycling"):
        kind, options = shipped_options(name)
        out = SpecDecoder(target, drafter_registry.build(kind, target, **options), reference.verify).generate([prompt], 16, GREEDY)
        assert out.outputs == plain, name


@pytest.mark.slow
def test_bfloat16_gemma3_270m_is_bitwise_invariant():
    """configs/target/gemma3_270m_bf16.yaml: rows computed as if alone, so greedy speculative output
    equals plain decoding in bfloat16 too (the bitwise contract), a batch of two included."""
    from specdec.packaged_models import load_packaged

    model, tokenizer = load_packaged("gemma3_270m", torch.bfloat16)
    target = HFTarget(model, invariant=True, key="gemma3_270m")
    assert target.invariant
    prompts = [tokenizer(text)["input_ids"] for text in REAL_PROMPTS]
    plain = greedy_outputs(target, prompts, 16)
    for name in ("ngram_self", "recycling"):
        kind, options = shipped_options(name)
        out = SpecDecoder(target, drafter_registry.build(kind, target, **options), reference.verify).generate(prompts, 16, GREEDY)
        assert out.outputs == plain, name


def test_the_run_defaults_of_gemma3_and_a_smollm2_head_refused_before_the_model_loads(tmp_path, monkeypatch):
    """target=gemma3_270m composes to raw-text prompts and the adaptive union; a SmolLM2 head (the bundled
    EAGLE-3, passed as a checkpoint) is refused from the converted folder's config.json, before any weight loads."""
    import json

    from hydra import compose, initialize_config_dir

    from experiments.cli import SpecdecUserError
    from experiments.run import schema
    from drafters.heads import BUNDLED
    from specdec.packaged_models import PACKAGED_MODELS

    folder = tmp_path / PACKAGED_MODELS["gemma3_270m"].cache_name  # as converted: only config.json is read
    folder.mkdir()
    config = {"model_type": "gemma3_text", "vocab_size": 262_144, "hidden_size": 640, "num_hidden_layers": 18}
    (folder / "config.json").write_text(json.dumps(config))
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    with initialize_config_dir(config_dir=str(schema.CONFIG_DIR), version_base="1.3"):
        default = schema.checked_settings(compose(config_name="config", overrides=["target=gemma3_270m"]))
        smollm2_head = compose(config_name="config", overrides=["target=gemma3_270m", "drafter=eagle3",
                                                                 f"drafter.checkpoint={BUNDLED / 'eagle3-smollm2'}"])
    assert (default.drafter["name"], default.drafter["adaptive"], default.workload.chat, default.target.chat) == (
        "union", True, False, False)
    with pytest.raises(SpecdecUserError, match="trained for another target .*hidden size: checkpoint 576, target 640; "
                                               "vocabulary: checkpoint 49152, target 262144"):
        schema.checked_settings(smollm2_head)
