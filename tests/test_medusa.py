"""Medusa-1: heads, training method, measured static tree, exactness and checkpoints."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from drafters.base import build
from drafters.medusa import (
    MedusaConfig, MedusaDrafter, MedusaHeads, build_tree, expected_accepted, load_heads, save_heads, with_tree,
)
from drafters.training.features import CacheMeta, FeatureCache, extract_features
from drafters.training.methods import build_method
from drafters.training.trainer import TrainConfig, train
from specdec.decode import SpecDecoder
from specdec.protocols import DraftContext
from specdec.sampling import SamplingParams
from specdec.target import HFTarget
from specdec.tree import parents_from_paths
from tiny_models import tiny_model
from verifiers import reference

GREEDY = SamplingParams(0.0)


def random_heads(target, num_heads=3, seed=0, scale=0.5) -> MedusaHeads:
    heads = MedusaHeads(MedusaConfig.for_target(target, num_heads))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        heads.weight.copy_(torch.randn(heads.weight.shape, generator=generator) * scale / target.hidden_size**0.5)
    return heads.eval()


def assert_greedy_equal(target, drafter, prompts, new_tokens=20, max_batch=None):
    plain = SpecDecoder(target, None, reference.verify).generate(prompts, new_tokens, GREEDY)
    spec = SpecDecoder(target, drafter, reference.verify).generate(prompts, new_tokens, GREEDY, max_batch=max_batch)
    assert spec.outputs == plain.outputs
    return spec


def test_tree_from_accuracies_is_the_best_prefix_closed_set():
    accuracies = [[0.6, 0.2, 0.05, 0.0], [0.4, 0.15, 0.1, 0.0], [0.3, 0.1, 0.0, 0.0]]
    for total in (1, 4, 9, 30):
        tree = build_tree(accuracies, total)
        assert 1 <= len(tree) <= total and len(set(tree)) == len(tree)
        parents_from_paths(tree)  # valid: every prefix present
        assert all(len(p) <= 3 for p in tree)

        def score(path):
            return expected_accepted(accuracies, [path])

        assert all(score(p) > 0 for p in tree)  # a zero-accuracy candidate is never drafted
        # brute force over every prefix-closed set of that size: none has a larger expected acceptance
        everything = [p for d in (1, 2, 3) for p in itertools.product(range(4), repeat=d) if score(p) > 0]
        if total <= 4:
            best = max(
                sum(score(p) for p in subset)
                for subset in itertools.combinations(everything, len(tree))
                if all(p[:-1] in subset or len(p) == 1 for p in subset)
            )
            assert expected_accepted(accuracies, tree) == pytest.approx(best)
    assert build_tree(accuracies, 3) == [(0,), (0, 0), (1,)]  # 0.6, 0.24, 0.2
    assert all(len(p) <= 1 for p in build_tree(accuracies, 10, max_depth=1))
    assert len(build_tree(accuracies, 100)) == sum(1 for _ in everything)  # stops when only zeros remain


@pytest.mark.parametrize("tree", [[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)],
                                  pytest.param([(0,), (0, 0), (0, 0, 0)], marks=pytest.mark.integration)])
def test_medusa_greedy_output_equals_plain_decoding(tree):
    target = HFTarget(tiny_model("llama", sharpness=4.0))
    drafter = MedusaDrafter(target, random_heads(target), tree)
    assert drafter.max_depth == drafter.heads.config.num_heads  # budget.mode=auto's bound
    assert_greedy_equal(target, drafter, [[5, 9, 2, 7]])
    # ragged batch, including a one-token prompt (no feature before its root: it drafts nothing at first)
    assert_greedy_equal(target, drafter, [[5, 9, 2, 7, 11, 3], [42], [1, 2, 3]])
    # continuous batching: queued prompts are admitted as earlier ones finish
    assert_greedy_equal(target, drafter, [[5, 9, 2, 7, 11, 3], [42], [1, 2, 3], [8, 8]], max_batch=2)


def test_each_node_carries_its_path_probability_under_the_heads():
    target = HFTarget(tiny_model("llama", sharpness=4.0))
    heads = random_heads(target, scale=4.0)
    tree = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    drafter = MedusaDrafter(target, heads, tree)
    prompt = torch.tensor([5, 9, 2, 7])
    features = target.prefill([prompt], (target.num_layers + 1,)).hidden[0]  # [1, 3, H]: the root's comes later
    ctx = DraftContext(prompt[None], torch.tensor([4]), (features,), torch.tensor([3]), GREEDY, None)
    drafted = drafter.propose(ctx)
    with torch.no_grad():
        logits = heads(features[:, -1]) @ target.model.get_output_embeddings().weight[heads.draft_ids].T  # [1, K, D]
    probs, _ = torch.softmax(logits[0], -1).sort(-1, descending=True)  # [K, D] by rank
    for i, path in enumerate(sorted(tree, key=lambda p: (len(p), p))):
        expected = float(torch.tensor([probs[depth, rank] for depth, rank in enumerate(path)]).prod())
        assert float(drafted.confidence[0, i]) == pytest.approx(expected, rel=1e-4)


def make_cache(tmp_path, target, sequences):
    layer = target.num_layers + 1  # the final-norm output
    meta = CacheMeta("tiny", target.hidden_size, target.num_layers, target.vocab_size, (layer,), 64, 2)
    return FeatureCache(extract_features(target, sequences, tmp_path / "features", meta, batch_size=2))


@pytest.mark.integration  # training
def test_medusa_heads_learn_measure_their_tree_and_round_trip(tmp_path):
    model = tiny_model("llama", sharpness=4.0)
    target = HFTarget(model)
    # self-distillation: the target's own greedy continuations, so that decoding later visits the
    # states the heads were trained on; the held-out (last) shard repeats two training sequences so
    # that its measured accuracies reflect what was learnt
    prompts = [[i, (7 * i) % 128, (13 * i) % 128] for i in range(6)]
    continuations = SpecDecoder(target, None, reference.verify).generate(prompts, 37, GREEDY).outputs
    sequences = [p + c for p, c in zip(prompts, continuations)]
    cache = make_cache(tmp_path, target, sequences + sequences[:2])
    method = build_method({"name": "medusa", "num_heads": 3, "draft_vocab": 100, "tree_top_k": 4, "total_tokens": 8})
    torch.manual_seed(0)
    prepared = method.prepare(target, cache, batch_size=3, seed=0, shards=[0, 1, 2, 3])
    assert prepared.num_sequences == 6 and len(prepared.model.draft_ids) <= 100
    first, _ = prepared.loss(next(prepared.batches(0)))
    logged = []
    train(prepared.model, prepared.batches, prepared.loss,
          TrainConfig(steps=50, lr=1e-2, warmup_steps=5, checkpoint_every=100, log_every=10),
          tmp_path / "run", lambda step, metrics: logged.append(metrics))
    assert logged[-1]["loss"] < 0.5 * float(first.detach())
    assert logged[-1]["accuracy_0"] > 0.7 and logged[-1]["accuracy_1"] > 0.5

    method.export(prepared.model.half(), tmp_path / "heads", {"training": {"steps": 50}})
    saved = json.loads((tmp_path / "heads" / "config.json").read_text())
    accuracies, tree = saved["medusa"]["accuracies"], [tuple(p) for p in saved["medusa"]["tree"]]
    assert len(accuracies) == 3 and all(len(row) == 4 for row in accuracies)
    assert accuracies[0][0] > 0.7 and all(0 <= a <= 1 for row in accuracies for a in row)
    assert 1 <= len(tree) <= 8 and tree == build_tree(accuracies, 8)
    parents_from_paths(tree)
    assert saved["training"] == {"steps": 50} and saved["tree_measurement"]["expected_accepted"] > 1

    loaded = load_heads(tmp_path / "heads", target)
    assert list(loaded.config.tree) == tree
    prompts = prompts[:3]
    drafter = build("medusa", target, checkpoint=str(tmp_path / "heads"))  # the stored tree, no extra argument
    spec = assert_greedy_equal(target, drafter, prompts)
    assert spec.stats.tau > 2.0  # the trained heads draft what the target will say
    smaller = build("medusa", target, checkpoint=str(tmp_path / "heads"), total_tokens=3)
    assert int(smaller.parents.numel()) == 3
    assert_greedy_equal(target, smaller, prompts)
    evaluation = method.drafter(target, loaded, depth=1)
    assert int(evaluation.node_head.max()) == 0


def test_foreign_corrupt_and_unmeasured_checkpoints_are_clear_errors(tmp_path):
    small = HFTarget(tiny_model("llama"))
    heads = with_tree(random_heads(small), [[0.5, 0.2], [0.3, 0.1], [0.2, 0.1]], [(0,), (1,), (0, 0)])
    save_heads(heads, tmp_path / "heads")
    assert load_heads(tmp_path / "heads", small).config.tree == ((0,), (1,), (0, 0))
    other = HFTarget(tiny_model("llama", vocab_size=64, layers=3))
    foreign = "another target.*not for this one.*vocabulary: checkpoint 128, target 64.*layers: checkpoint 2, target 3"
    with pytest.raises(ValueError, match=foreign):
        load_heads(tmp_path / "heads", other)
    with pytest.raises(ValueError, match="another target"):
        build("medusa", other, checkpoint=str(tmp_path / "heads"))

    save_heads(random_heads(small), tmp_path / "unmeasured")
    with pytest.raises(ValueError, match="no measured tree"):
        load_heads(tmp_path / "unmeasured", small)
    config = json.loads((tmp_path / "heads" / "config.json").read_text())
    config["medusa"]["tree"] = [[0, 0]]  # a path without its parent
    (tmp_path / "heads" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no parent path"):
        load_heads(tmp_path / "heads", small)
    (tmp_path / "heads" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="corrupt or incomplete"):
        load_heads(tmp_path / "heads", small)
    save_heads(heads, tmp_path / "heads")
    (tmp_path / "heads" / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="corrupt or incomplete"):
        load_heads(tmp_path / "heads", small)
    with pytest.raises(FileNotFoundError, match="holds no Medusa checkpoint"):
        load_heads(tmp_path / "nothing", small)


def test_medusa_training_method_checks_its_settings_and_data(tmp_path):
    with pytest.raises(ValueError, match="unknown setting.*num_head"):
        build_method({"name": "medusa", "num_head": 3})
    target = HFTarget(tiny_model("llama"))
    cache = make_cache(tmp_path, target, [list(range(20)), list(range(5, 25))])
    with pytest.raises(ValueError, match="needs >= 2 shards"):
        build_method({"name": "medusa"}).prepare(target, cache, 2, 0, [0])


@pytest.mark.slow
def test_bundled_medusa_heads_on_smollm2_are_greedy_exact():
    from experiments.common.prompt_sets import encode_prompt, load_mtbench
    from specdec.packaged_models import load_smollm2

    model, tokenizer = load_smollm2()
    target = HFTarget(model, key="smollm2")
    prompts = [encode_prompt(tokenizer, p) for p in load_mtbench(2)]
    drafter = build("medusa", target)
    spec = assert_greedy_equal(target, drafter, prompts, new_tokens=24)
    assert spec.stats.tau > 1.2
