"""MTP modules: training on self-distilled data, incremental drafting state, exactness, checkpoints."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_model

from drafters.base import DrafterBase
from drafters.heads import save_head
from drafters.mtp import MTPConfig, MTPDrafter, MTPHead, load_mtp
from drafters.training.data import EagleData, select_draft_vocab
from drafters.training.features import CacheMeta, FeatureCache, extract_features
from drafters.training.methods import build_method
from drafters.training.mtp_training import MTPLoss
from drafters.training.trainer import TrainConfig, train
from specdec.decode import SpecDecoder
from specdec.sampling import SamplingParams
from specdec.target import HFTarget
from verifiers import reference

GREEDY = SamplingParams(0.0)


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    """A tiny target and a feature cache of its own greedy continuations: generation later visits
    exactly the states the modules were trained on, so acceptance measures the whole pipeline."""
    model = tiny_model("llama", sharpness=4.0)
    target = HFTarget(model)
    prompts = [[i, (7 * i) % 128, (13 * i) % 128] for i in range(8)]
    continuations = SpecDecoder(target, None, reference.verify).generate(prompts, 37, GREEDY).outputs
    sequences = [p + c for p, c in zip(prompts, continuations)]
    final = target.num_layers + 1
    meta = CacheMeta("tiny", target.hidden_size, target.num_layers, target.vocab_size, (final,), 64, 2)
    directory = extract_features(target, sequences, tmp_path_factory.mktemp("mtp") / "features", meta, batch_size=2)
    return target, sequences, FeatureCache(directory)


def train_head(target, cache, run_dir, modules: int, depth: int = 2) -> tuple[MTPHead, list[dict]]:
    model = target.model
    lm_head = model.get_output_embeddings().weight.detach()
    final = target.num_layers + 1
    data = EagleData(cache, (final,), lm_head, final, batch_size=4)
    torch.manual_seed(0)
    draft_ids = select_draft_vocab(data.label_counts(target.vocab_size), 100)  # fewer than the 128 tokens
    head = MTPHead(MTPConfig.for_target(target, modules, depth, len(draft_ids)), draft_ids)
    loss = MTPLoss(head, model.get_input_embeddings().weight.detach(), lm_head, (1.0,) * depth)
    logged = []
    train(head, data.batches, loss, TrainConfig(steps=80, lr=3e-3, warmup_steps=5, checkpoint_every=80, log_every=20),
          run_dir, lambda step, metrics: logged.append(metrics))
    return head, logged


class Recording(DrafterBase):
    """Forwards to a drafter and records every proposal with the committed text it was made for."""

    def __init__(self, drafter: MTPDrafter) -> None:
        self.drafter, self.target_layers, self.seen = drafter, drafter.target_layers, []

    def reset(self, batch_size, max_length):
        self.drafter.reset(batch_size, max_length)

    def admit(self, count, max_length):
        self.drafter.admit(count, max_length)

    def propose(self, ctx):
        tree = self.drafter.propose(ctx)
        for b in range(len(ctx.lengths)):
            self.seen.append((ctx.tokens[b, : ctx.lengths[b]].tolist(), tree.tokens[b].tolist(), tree.confidence[b].tolist()))
        return tree

    def commit(self, tree, result):
        self.drafter.commit(tree, result)

    def retain(self, rows):
        self.drafter.retain(rows)


def drafts_from_scratch(target, head: MTPHead, committed: list[int], depth: int) -> tuple[list[int], list[float]]:
    """The chain the modules draft after ``committed``, computed over the whole text the way
    training runs them (no caches): the reference for the drafter's incremental state; and the
    modules' probability of each drafted prefix."""
    n = len(committed) - 1  # the root's index
    features = target.prefill([torch.tensor(committed)], (target.num_layers + 1,)).hidden[0]  # [1, n, H]
    embedding = target.model.get_input_embeddings().weight
    text, hidden, drafts, path_probs = list(committed), features, [], [1.0]
    for d in range(1, depth + 1):
        tokens = torch.tensor([text[d : d + n]])  # x_{i+d} for rows i = 0..n-1
        hidden = head.forward_sequence(d, hidden, F.embedding(tokens, embedding))
        h = head.module(d).output_norm(hidden[0, n - 1])
        logits = h @ target.model.get_output_embeddings().weight[head.draft_ids].T
        token = int(head.draft_ids[logits.argmax()])
        drafts.append(token)
        path_probs.append(path_probs[-1] * float(torch.softmax(logits, -1).max()))
        text.append(token)
    return drafts, path_probs[1:]


@pytest.mark.integration  # training; the fast tier checks MTP drafting in test_device_clean
@pytest.mark.parametrize("modules", [1, 2])
def test_mtp_modules_learn_draft_exactly_and_round_trip(distilled, tmp_path, modules):
    target, sequences, cache = distilled
    head, logged = train_head(target, cache, tmp_path / "run", modules)
    assert logged[-1]["loss"] < 0.5 * logged[0]["loss"]
    assert logged[-1]["accuracy_1"] > 0.7 and logged[-1]["accuracy_2"] > 0.6  # 8 memorised sequences
    assert len(head.mtp_modules) == modules

    # the incremental drafter (committed rows once, draft rows per proposal, ragged rows, requests
    # admitted mid-batch) drafts exactly what the modules compute over the whole text
    prompts = [sequences[0][:3], sequences[1][:9], sequences[2][:14]]  # ragged
    for depth in [2, 3] if modules == 1 else [1, 2]:  # a shared module also drafts past its trained depth
        recording = Recording(MTPDrafter(target, head.eval(), depth))
        SpecDecoder(target, recording, reference.verify).generate(prompts, 12, GREEDY, max_batch=2)
        with torch.no_grad():
            for committed, drafts, confidence in recording.seen:
                expected, path_probs = drafts_from_scratch(target, head, committed, depth)
                assert drafts == expected, committed
                assert confidence == pytest.approx(path_probs, rel=1e-4, abs=1e-6)  # for budgeted unions

    save_head(head.half(), tmp_path / "mtp", kind="mtp")
    loaded = load_mtp(tmp_path / "mtp", target)
    assert loaded.config.num_modules == modules and loaded.config.depth == 2
    plain = SpecDecoder(target, None, reference.verify).generate(prompts, 20, GREEDY)
    drafter = MTPDrafter(target, loaded)  # the depth it was trained for
    assert drafter.depth == 2
    assert drafter.max_depth == (None if modules == 1 else modules)  # a reused module drafts any depth
    for prompt, expected in zip(prompts, plain.outputs):  # batch 1
        assert SpecDecoder(target, drafter, reference.verify).generate([prompt], 20, GREEDY).outputs == [expected]
    out = SpecDecoder(target, drafter, reference.verify).generate(prompts, 20, GREEDY)  # ragged batch 3
    assert out.outputs == plain.outputs
    assert out.stats.tau > 2.2 and out.stats.per_depth_alpha[1] > 0.6  # the modules draft what the target says
    # sampling: the same deterministic chain, verified by the point-mass rule
    sampled = SpecDecoder(target, drafter, reference.verify).generate(prompts, 20, SamplingParams(temperature=1.0), seed=3)
    assert [len(o) for o in sampled.outputs] == [20, 20, 20]


def test_checkpoints_refuse_foreign_targets_corrupt_files_and_impossible_depths(tmp_path):
    small = HFTarget(tiny_model("llama"))
    save_head(MTPHead(MTPConfig.for_target(small, num_modules=2, depth=2)), tmp_path / "mtp", kind="mtp")
    other = HFTarget(tiny_model("llama", vocab_size=64, layers=3))
    with pytest.raises(ValueError, match="MTP checkpoint.*another target.*vocabulary: checkpoint 128, target 64.*layers: checkpoint 2, target 3"):
        load_mtp(tmp_path / "mtp", other)
    with pytest.raises(ValueError, match="depths 1..2; depth=3 needs a checkpoint trained that deep"):
        MTPDrafter(small, load_mtp(tmp_path / "mtp", small), depth=3)
    with pytest.raises(ValueError, match="holds no MTP checkpoint|corrupt"):  # an EAGLE checkpoint is not an MTP one
        from drafters.eagle import EagleConfig, EagleHead

        save_head(EagleHead(EagleConfig.for_target(small)), tmp_path / "eagle")
        load_mtp(tmp_path / "eagle", small)
    (tmp_path / "mtp" / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="MTP checkpoint .* is corrupt or incomplete"):
        load_mtp(tmp_path / "mtp", small)
    with pytest.raises(FileNotFoundError, match="holds no MTP checkpoint"):
        load_mtp(tmp_path / "nothing", small)
    with pytest.raises(ValueError, match="one module or one per depth"):
        MTPHead(MTPConfig.for_target(small, num_modules=3, depth=2))


def test_the_training_method_checks_its_settings_and_the_config_composes():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from experiments.train.command import CONFIG_DIR

    method = build_method({"name": "mtp", "depth": 3, "modules": 3, "depth_weights": [1, 0.5, 0.25]})
    assert (method.depth, method.num_modules, method.depth_weights) == (3, 3, (1.0, 0.5, 0.25))
    with pytest.raises(ValueError, match="modules 1 .shared. or 2"):
        build_method({"name": "mtp", "depth": 2, "modules": 3})
    with pytest.raises(ValueError, match="depth_weights needs 2"):
        build_method({"name": "mtp", "depth": 2, "depth_weights": [1.0]})
    with pytest.raises(ValueError, match="unknown setting.*module"):
        build_method({"name": "mtp", "module": 2})
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="train", overrides=["train=mtp", "train.modules=2"]))
        deeper = OmegaConf.to_object(compose(config_name="train", overrides=["train=mtp", "train.depth=3", "train.modules=3"]))
    assert cfg.train["modules"] == 2 and cfg.eval.depth == 2  # the evaluation drafts as deep as trained
    assert build_method(cfg.train).num_modules == 2
    assert deeper.eval.depth == 3


@pytest.mark.slow
def test_the_bundled_smollm2_modules_are_greedy_exact():
    from drafters.base import build
    from experiments.common.prompt_sets import encode_prompt, load_mtbench
    from specdec.packaged_models import load_smollm2

    model, tokenizer = load_smollm2()
    target = HFTarget(model, key="smollm2")
    prompts = [encode_prompt(tokenizer, p) for p in load_mtbench(2)]
    plain = SpecDecoder(target, None, reference.verify).generate(prompts, 16, GREEDY, eos_token_id=tokenizer.eos_token_id)
    out = SpecDecoder(target, build("mtp", target), reference.verify).generate(prompts, 16, GREEDY, eos_token_id=tokenizer.eos_token_id)
    assert out.outputs == plain.outputs and out.stats.tau > 1.0
