"""Medusa-2: heads trained jointly with the target's last layers and self-distillation; the exported
fine-tuned target with its heads decodes exactly (with respect to the FINE-TUNED target)."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from drafters.base import build
from drafters.medusa import TARGET_FOLDER
from drafters.training.features import CacheMeta, FeatureCache, extract_features
from drafters.training.medusa2_training import REPORT_FILE, measure_divergence
from drafters.training.methods import build_method
from drafters.training.trainer import TrainConfig, train
from specdec.decode import SpecDecoder
from specdec.sampling import SamplingParams
from specdec.target import HFTarget
from tiny_models import tiny_model
from verifiers import reference

GREEDY = SamplingParams(0.0)
SETTINGS = {"name": "medusa2", "num_heads": 2, "draft_vocab": 100, "tree_top_k": 3, "total_tokens": 6,
            "trainable_layers": 1, "distill_weight": 1.0}


def make_cache(tmp_path, target, sequences) -> FeatureCache:
    layer = target.num_layers + 1  # the final-norm output
    meta = CacheMeta("tiny", target.hidden_size, target.num_layers, target.vocab_size, (layer,), 64, 2)
    return FeatureCache(extract_features(target, sequences, tmp_path / "features", meta, batch_size=2))


@dataclass(frozen=True)
class Trained:
    original: dict  # the target's state before training (cloned tensors)
    target: HFTarget  # fine-tuned in place
    method: object
    model: torch.nn.Module
    first_loss: float
    logged: list
    output: Path
    prompts: list


def train_medusa2(tmp_path: Path, steps: int, settings: dict) -> tuple:
    """A tiny 3-layer target trained with Medusa-2 as specdec-train does: (target, method, prepared,
    the loss before training, the logged metrics)."""
    target = HFTarget(tiny_model("llama", sharpness=4.0, layers=3))
    # the target's own greedy continuations (self-distillation data); the held-out last shard
    # repeats two training sequences so that its measurements reflect what was learnt
    prompts = [[i, (7 * i) % 128, (13 * i) % 128] for i in range(6)]
    continuations = SpecDecoder(target, None, reference.verify).generate(prompts, 29, GREEDY).outputs
    sequences = [p + c for p, c in zip(prompts, continuations)]
    cache = make_cache(tmp_path, target, sequences + sequences[:2])
    method = build_method(settings)
    torch.manual_seed(0)
    prepared = method.prepare(target, cache, batch_size=3, seed=0, shards=[0, 1, 2, 3])
    first, _ = prepared.loss(next(prepared.batches(0)))
    logged = []
    train(prepared.model, prepared.batches, prepared.loss,
          TrainConfig(steps=steps, lr=1e-2, warmup_steps=3, checkpoint_every=100, log_every=10),
          tmp_path / "run", lambda step, metrics: logged.append(metrics))
    return target, method, prepared, float(first.detach()), logged


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Trained:
    tmp_path = tmp_path_factory.mktemp("medusa2")
    original = {k: v.clone() for k, v in tiny_model("llama", sharpness=4.0, layers=3).state_dict().items()}
    target, method, prepared, first, logged = train_medusa2(tmp_path, 30, SETTINGS)
    output = tmp_path / "medusa2"
    method.export(prepared.model.to(torch.float16), output, {"training": {"steps": 30}})  # as specdec-train does
    prompts = [[i, (7 * i) % 128, (13 * i) % 128] for i in range(3)]
    return Trained(original, target, method, prepared.model.float().eval(), first, logged, output, prompts)


@pytest.mark.integration
def test_joint_training_lowers_the_loss_and_changes_only_the_chosen_layers_and_heads(trained):
    assert trained.logged[-1]["loss"] < 0.5 * trained.first_loss
    assert trained.logged[-1]["accuracy_0"] > 0.5 and trained.logged[-1]["kl"] >= 0
    trainable = {f"model.layers.2.{k}" for k in trained.model.layers[0].state_dict()} | {"model.norm.weight"}
    after = trained.target.model.state_dict()
    changed = {k for k, v in trained.original.items() if not torch.equal(v, after[k])}
    assert changed and changed <= trainable  # the last layer (+ norm) moved; nothing else, bitwise
    assert "model.layers.2.mlp.down_proj.weight" in changed
    assert bool(trained.model.heads.weight.abs().sum() > 0)  # the heads trained too (they start at zero)
    # checkpoints hold only what changes: the heads and the trained layer and norm
    assert all(k.startswith(("heads.", "layers.0.", "norm.")) for k in trained.model.state_dict())


@pytest.mark.integration
def test_export_records_the_divergence_and_the_fine_tuned_target_decodes_exactly(trained):
    from transformers import AutoModelForCausalLM

    config = json.loads((trained.output / "config.json").read_text())
    report = config["medusa2"]
    assert report == json.loads((trained.output / TARGET_FOLDER / REPORT_FILE).read_text())
    for key in ("divergence_from_original", "divergence_floor_untouched_target"):
        divergence = report[key]
        assert divergence["kl"] >= 0 and 0 <= divergence["top1_agreement"] <= 1 and divergence["tokens"] > 0
    assert report["divergence_floor_untouched_target"]["kl"] < 1e-3  # only the float16 cache separates them
    assert config["training"] == {"steps": 30} and config["medusa"]["tree"]

    loaded = AutoModelForCausalLM.from_pretrained(trained.output / TARGET_FOLDER)
    in_memory = trained.target.model.state_dict()
    assert all(torch.equal(v, in_memory[k]) for k, v in loaded.state_dict().items())
    fine_tuned = HFTarget(loaded)
    drafter = build("medusa", fine_tuned, checkpoint=str(trained.output))
    plain = SpecDecoder(fine_tuned, None, reference.verify).generate(trained.prompts, 20, GREEDY)
    spec = SpecDecoder(fine_tuned, drafter, reference.verify).generate(trained.prompts, 20, GREEDY)
    assert spec.outputs == plain.outputs  # exact with respect to the FINE-TUNED target
    assert spec.stats.tau > 1.0

    # exporting again replaces the heads and the target together and leaves no temporary folder
    trained.method.export(trained.model, trained.output, {"training": {"steps": 30}})
    assert sorted(p.name for p in trained.output.iterdir()) == ["config.json", "model.safetensors", TARGET_FOLDER]
    assert not [p for p in trained.output.parent.iterdir() if p.name.startswith(".")]
    assert AutoModelForCausalLM.from_pretrained(trained.output / TARGET_FOLDER).config.num_hidden_layers == 3


@pytest.mark.integration
def test_specdec_run_decodes_the_exported_target_with_its_heads(trained, tmp_path):
    from hydra import compose, initialize_config_dir
    from rich.console import Console

    from experiments.run import run
    from experiments.run.schema import CONFIG_DIR

    overrides = ["target=hf", f"target.path={trained.output / TARGET_FOLDER}", "drafter=medusa",
                 f"drafter.checkpoint={trained.output}", "workload=synthetic", "workload.num_prompts=2",
                 "workload.prompt_length=5", "max_new_tokens=8", "logger=none",
                 f"threads={torch.get_num_threads()}"]  # keep this process's thread count
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    results = run(cfg, tmp_path, Console(file=io.StringIO()))
    assert results["greedy_equal"] is True and results["drafter"] == "medusa" and results["tau"] > 1.0


@pytest.mark.integration
def test_self_distillation_keeps_the_fine_tuned_target_nearer_the_original(tmp_path):
    divergence = {}
    for weight in (0.0, 10.0):
        target, method, *_ = train_medusa2(tmp_path / str(weight), 20, {**SETTINGS, "distill_weight": weight})
        divergence[weight] = measure_divergence(target.model, method.lm_head, method.held_out).kl
    assert divergence[10.0] < 0.5 * divergence[0.0]


@pytest.mark.integration
def test_the_evaluation_drafter_decodes_the_target_fine_tuned_in_place_and_refuses_another(trained):
    # specdec-train evaluates with the target it passed to prepare, which is now the fine-tuned one
    drafter = trained.method.drafter(trained.target, trained.model, depth=1)
    assert drafter.node_head.max() == 0
    plain = SpecDecoder(trained.target, None, reference.verify).generate(trained.prompts, 16, GREEDY)
    assert SpecDecoder(trained.target, drafter, reference.verify).generate(trained.prompts, 16, GREEDY).outputs == plain.outputs
    with pytest.raises(ValueError, match="fine-tuned target"):
        trained.method.drafter(HFTarget(tiny_model("llama", layers=3)), trained.model, depth=2)


def test_the_method_rejects_bad_settings_and_data_and_its_config_composes(tmp_path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from experiments.train.command import CONFIG_DIR

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="train", overrides=["train=medusa2", "train.trainable_layers=3"]))
    method = build_method(cfg.train)
    assert (method.trainable_layers, method.num_heads) == (3, 4)
    with pytest.raises(ValueError, match="unknown setting.*trainable_layer"):
        build_method({"name": "medusa2", "trainable_layer": 1})
    with pytest.raises(ValueError, match="trainable_layers must be >= 1"):
        build_method({"name": "medusa2", "trainable_layers": 0})
    with pytest.raises(ValueError, match="distill_weight must be >= 0"):
        build_method({"name": "medusa2", "distill_weight": -1.0})
    target = HFTarget(tiny_model("llama"))
    cache = make_cache(tmp_path, target, [list(range(20)), list(range(5, 25)), list(range(9, 30))])
    with pytest.raises(ValueError, match="needs >= 2 shards"):
        build_method({"name": "medusa2"}).prepare(target, cache, 2, 0, [0])
    with pytest.raises(ValueError, match="exceeds the target's 2 decoder layers"):
        build_method({"name": "medusa2", "trainable_layers": 3}).prepare(target, cache, 2, 0, [0, 1])
