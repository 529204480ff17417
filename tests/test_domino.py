"""Domino block drafting: training on self-distilled data, exact decoding, checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

from drafters.domino import DominoConfig, DominoDrafter, DominoHead, domino, load_domino, save_domino
from drafters.eagle import EagleConfig, EagleHead
from drafters.heads import save_head
from drafters.training.data import EagleData, select_draft_vocab
from drafters.training.domino_training import Curriculum, DominoLoss, domino_batches
from drafters.training.features import CacheMeta, FeatureCache, extract_features
from drafters.training.methods import build_method
from drafters.training.trainer import TrainConfig, train
from sequence_stats import ALPHA, required_samples, sequence_verdict
from specdec.decode import SpecDecoder
from specdec.sampling import SamplingParams
from specdec.target import HFTarget
from tiny_models import tiny_model
from verifiers import reference

GREEDY = SamplingParams(0.0)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A head trained on the tiny target's own greedy continuations (so that generation visits the
    states it was trained on, and tau checks the train/draft alignment end to end), saved in fp16."""
    tmp_path = tmp_path_factory.mktemp("domino")
    model = tiny_model("llama", sharpness=4.0)
    target = HFTarget(model)
    prompts = [[i, (7 * i) % 128, (13 * i) % 128] for i in range(8)]
    continuations = SpecDecoder(target, None, reference.verify).generate(prompts, 37, GREEDY).outputs
    meta = CacheMeta("tiny", target.hidden_size, target.num_layers, target.vocab_size, (1, 3), 64, 2)
    directory = extract_features(target, [p + c for p, c in zip(prompts, continuations)], tmp_path / "features", meta, 2)
    layers = (1, 3)
    lm_head = model.get_output_embeddings().weight.detach()
    data = EagleData(FeatureCache(directory), layers, lm_head, 3, batch_size=4)
    torch.manual_seed(0)
    draft_ids = select_draft_vocab(data.label_counts(128), 100)  # fewer than the 128 tokens
    config = DominoConfig.for_target(target, layers, len(draft_ids), block_size=3, context=8, gru_size=32, rank=8)
    head = DominoHead(config, draft_ids)
    loss = DominoLoss(head, model.get_input_embeddings().weight.detach(), lm_head, Curriculum(1.0, 0.1, 60))
    first, _ = loss(next(domino_batches(data, 0)))
    logged = []
    train(head, lambda index: domino_batches(data, index), loss,
          TrainConfig(steps=80, lr=3e-3, warmup_steps=5, checkpoint_every=80, log_every=20),
          tmp_path / "run", lambda step, metrics: logged.append(metrics))
    save_domino(head.half(), tmp_path / "head")
    return target, prompts, first.item(), logged, tmp_path / "head"


def test_domino_head_learns_every_block_position(trained):
    _, _, first, logged, _ = trained
    assert logged[-1]["loss"] < 0.3 * first
    assert min(logged[-1][f"accuracy_{j}"] for j in range(3)) > 0.8  # 8 memorised sequences
    assert logged[-1]["base_weight"] == pytest.approx(0.1)  # the curriculum reached its end


@pytest.mark.parametrize("which", [[0], [1, 2, 3]])
def test_greedy_block_drafting_equals_plain_decoding(trained, which):
    target, prompts, *_, path = trained
    head = load_domino(path, target)
    chosen = [prompts[i] for i in which]
    if len(chosen) > 1:  # ragged: a longer prompt and a one-token prompt (no features at all yet)
        chosen = [chosen[0] + [5, 9, 11, 2], chosen[1], chosen[2][:1]]
    plain = SpecDecoder(target, None, reference.verify).generate(chosen, 20, GREEDY)
    out = SpecDecoder(target, DominoDrafter(target, head), reference.verify).generate(chosen, 20, GREEDY)
    assert out.outputs == plain.outputs
    if which == [0]:
        assert out.stats.tau > 2.5  # the trained head drafts what the target will say
    shallow = SpecDecoder(target, DominoDrafter(target, head, depth=2), reference.verify).generate(chosen, 20, GREEDY)
    assert shallow.outputs == plain.outputs and shallow.stats.tau <= 3.0


def test_continuous_batching_admits_requests_into_a_running_batch(trained):
    target, prompts, *_, path = trained
    drafter = DominoDrafter(target, load_domino(path, target))
    chosen = prompts[:5]
    plain = SpecDecoder(target, None, reference.verify).generate(chosen, 16, GREEDY)
    out = SpecDecoder(target, drafter, reference.verify).generate(chosen, 16, GREEDY, max_batch=2)
    assert out.outputs == plain.outputs and out.stats.tau > 2.0  # admitted requests draft as well


def test_greedy_blocks_carry_their_path_probability(trained):
    """Confidence (for budgeted unions): the refined head's probability of each drafted prefix, so
    it lies in (0, 1] and never rises along the block; the memorising head is sure of its drafts."""
    target, prompts, *_, path = trained
    drafter = DominoDrafter(target, load_domino(path, target))
    trees = []
    propose = drafter.propose
    drafter.propose = lambda ctx: trees.append(propose(ctx)) or trees[-1]
    SpecDecoder(target, drafter, reference.verify).generate(prompts[:2], 12, GREEDY)
    confidence = torch.cat([tree.confidence for tree in trees])  # [steps x B, block]
    assert confidence.shape[1] == 3 and bool(((confidence > 0) & (confidence <= 1)).all())
    assert bool((confidence[:, 1:] <= confidence[:, :-1]).all())
    assert float(confidence[:, 0].mean()) > 0.5


def test_sampled_block_drafting_is_exact():
    """T = 1 with sampled=True: tokens drawn from the refined q and carried for the p/q test; the
    sequence distribution must be the target's. An untrained head with a non-zero refiner keeps q
    far from p, so the test sees many rejections."""
    from test_hf_target import exact_hf_distribution

    model = tiny_model("llama", vocab_size=8, sharpness=6.0)
    target = HFTarget(model)
    torch.manual_seed(1)
    head = DominoHead(DominoConfig.for_target(target, (1, 3), block_size=2, context=4, gru_size=8, rank=4))
    torch.nn.init.normal_(head.refine_up.weight, std=1.0)
    prompt, length, sampling = [1, 2, 3], 2, SamplingParams(1.0)
    exact = exact_hf_distribution(model, prompt, length, sampling)
    decoder = SpecDecoder(target, DominoDrafter(target, head.eval(), sampled=True), reference.verify)
    verdict = sequence_verdict(decoder, exact, prompt, length, 8, sampling, required_samples(8**length, tv=0.05), seed=4)
    assert verdict.impossible == 0 and verdict.p_value > ALPHA, verdict


def test_foreign_corrupt_and_missing_checkpoints_are_clear_errors(tmp_path):
    small = HFTarget(tiny_model("llama"))
    save_domino(DominoHead(DominoConfig.for_target(small, block_size=2)), tmp_path / "head")
    other = HFTarget(tiny_model("llama", vocab_size=64, layers=3))
    with pytest.raises(ValueError, match="trained for another target \\(LlamaForCausalLM\\), not for this one.*vocabulary: checkpoint 128, target 64"):
        load_domino(tmp_path / "head", other)
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    config["domino"]["target"] = "org/model-a"
    (tmp_path / "head" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="trained for another target \\(org/model-a\\), not for this one \\(LlamaForCausalLM\\)"):
        load_domino(tmp_path / "head", other)
    (tmp_path / "head" / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="corrupt or incomplete"):
        load_domino(tmp_path / "head", small)
    save_head(EagleHead(EagleConfig.for_target(small)), tmp_path / "eagle")
    with pytest.raises(ValueError, match="corrupt or incomplete.*no 'domino' section"):
        load_domino(tmp_path / "eagle", small)
    with pytest.raises(FileNotFoundError, match="holds no Domino checkpoint"):
        load_domino(tmp_path / "nothing", small)
    with pytest.raises(ValueError, match="depth must lie in \\[1, block_size=2\\]"):
        DominoDrafter(small, DominoHead(DominoConfig.for_target(small, block_size=2)), depth=3)


def test_bundled_head_or_training_command(monkeypatch, tmp_path):
    import drafters.heads

    monkeypatch.setattr(drafters.heads, "BUNDLED", tmp_path)
    with pytest.raises(ValueError, match="specdec-train train=domino output=drafters/checkpoints/domino-smollm2"):
        domino(HFTarget(tiny_model("llama")))


def test_training_method_settings_and_curriculum():
    method = build_method({"name": "domino", "feature_layers": [1, 2], "block_size": 4, "base_weight_steps": 10})
    assert method.feature_layers(HFTarget(tiny_model("llama"))) == (1, 2)
    assert dict(method.sizes)["block_size"] == 4
    schedule = [method.curriculum.base_weight(step) for step in (0, 5, 10, 50)]
    assert schedule == pytest.approx([1.0, 0.55, 0.1, 0.1])
    with pytest.raises(ValueError, match="unknown setting.*blocksize"):
        build_method({"name": "domino", "blocksize": 3})
