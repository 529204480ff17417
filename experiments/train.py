"""specdec-train: train a drafter head for any Hugging Face target, resumably.

    specdec-train                                   # EAGLE-1 head for SmolLM2 on ShareGPT features
    specdec-train train=eagle3 steps=2000           # EAGLE-3: fused layers, training-time test
    specdec-train target=/path/to/hf/model data.conversations=5000

Stages, each resumable: (1) target features are extracted once into a shared on-disk cache
(data.features_dir, keyed by target; shards are written atomically), (2) the head trains with
AdamW, warmup + cosine and gradient clipping, checkpointing into the run dir every
checkpoint_every steps (rerun the same command with hydra.run.dir=<that dir> to resume after a
kill), (3) the final head is exported (output=DIR, safetensors + config.json) and (4) evaluated:
tau and greedy equality on held-out MT-bench prompts against plain decoding.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

import hydra
import torch
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from drafters.eagle import EagleConfig, EagleDrafter, EagleHead, save_head
from drafters.training.eagle_training import EagleData, EagleLoss, EagleLossConfig, select_draft_vocab
from drafters.training.features import CacheMeta, FeatureCache, extract_features
from drafters.training.trainer import TrainConfig, train
from experiments.sinks import make_sink
from specdec import assets
from specdec.decode import SpecDecoder
from specdec.sampling import SamplingParams
from specdec.target import HFTarget
from verifiers.reference import verify

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


@dataclass
class MethodConfig:
    name: str = "eagle"
    feature_layers: Optional[List[int]] = None  # null: the final-norm output (EAGLE-1)
    unroll: int = 2
    step_decay: float = 0.8
    regression_weight: float = 1.0
    feature_noise: float = 0.1
    draft_vocab: int = 8192


@dataclass
class DataConfig:
    features_dir: Optional[str] = None  # null: <cache>/features/<target>-sharegpt
    conversations: int = 3000
    max_length: int = 512
    per_shard: int = 16
    shards: Optional[int] = None  # train on the first N complete shards (null: all)
    extract: bool = True  # extract missing shards first; false: train on what the cache holds


@dataclass
class EvalConfig:
    prompts: int = 8
    max_new_tokens: int = 64
    depth: int = 4


@dataclass
class TrainRunConfig:
    train: MethodConfig = field(default_factory=MethodConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    target: str = "smollm2"  # or a Hugging Face model folder
    batch_size: int = 4
    steps: int = 600
    lr: float = 5e-4
    warmup_steps: int = 30
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    checkpoint_every: int = 50
    log_every: int = 10
    seed: int = 0
    threads: Optional[int] = None
    output: Optional[str] = None  # export the final head here (null: <run dir>/head)
    logger: str = "jsonl"


ConfigStore.instance().store(name="train_schema", node=TrainRunConfig)


def load_target(name: str) -> tuple[HFTarget, Any, str]:
    if name == "smollm2":
        model, tokenizer = assets.load_smollm2()
        return HFTarget(model), tokenizer, "smollm2"
    path = Path(name)
    if not path.is_dir():
        raise FileNotFoundError(f"target={name!r}: not 'smollm2' and not a Hugging Face model folder")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return HFTarget(AutoModelForCausalLM.from_pretrained(path)), AutoTokenizer.from_pretrained(path), path.name


def prepare_features(cfg: TrainRunConfig, target: HFTarget, tokenizer, label: str, layers: tuple[int, ...], console: Console) -> FeatureCache:
    directory = Path(cfg.data.features_dir or assets.cache_dir() / "features" / f"{label}-sharegpt")
    stored = tuple(dict.fromkeys((2, target.num_layers // 2, target.num_layers - 3, target.num_layers + 1) + layers))
    if cfg.data.extract:
        if (directory / "meta.json").exists():
            stored = tuple(json.loads((directory / "meta.json").read_text())["layers"])
        from drafters.training.data import chat_sequences

        sequences = chat_sequences(tokenizer, assets.load_sharegpt_conversations(cfg.data.conversations), cfg.data.max_length)
        meta = CacheMeta(str(label), target.hidden_size, target.num_layers, target.vocab_size, stored, cfg.data.max_length, cfg.data.per_shard)
        console.print(f"features: {len(sequences)} sequences -> {directory} (resumes where it stopped)")
        extract_features(target, sequences, directory, meta,
                         progress=lambda done, total, rate: console.print(f"  {done}/{total} tokens, {rate:.0f} tokens/s", end="\r"))
        console.print()
    return FeatureCache(directory)


def evaluate(target: HFTarget, tokenizer, head: EagleHead, cfg: EvalConfig) -> dict[str, Any]:
    """tau and greedy equality on the last MT-bench prompts (the first ones stay for specdec-run)."""
    prompts = [assets.encode_prompt(tokenizer, p) for p in assets.load_mtbench()[-cfg.prompts :]]
    greedy = SamplingParams(0.0)
    plain = SpecDecoder(target, None, verify).generate(prompts, cfg.max_new_tokens, greedy, eos_token_id=tokenizer.eos_token_id)
    drafter = EagleDrafter(target, head, depth=cfg.depth)
    spec = SpecDecoder(target, drafter, verify).generate(prompts, cfg.max_new_tokens, greedy, eos_token_id=tokenizer.eos_token_id)
    return {
        "tau": spec.stats.tau,
        "per_depth_alpha": spec.stats.per_depth_alpha,
        "greedy_equal": spec.outputs == plain.outputs,
        "speedup": spec.stats.tokens_per_s / max(plain.stats.tokens_per_s, 1e-9),
        "prompts": cfg.prompts,
    }


def run(cfg: TrainRunConfig, run_dir: Path, console: Console) -> dict[str, Any]:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.train.name not in ("eagle", "eagle3"):
        raise ValueError(f"train={cfg.train.name!r}: this trainer knows eagle and eagle3")
    target, tokenizer, label = load_target(cfg.target)
    layers = tuple(cfg.train.feature_layers or (target.num_layers + 1,))
    cache = prepare_features(cfg, target, tokenizer, label, layers, console)
    if cache.meta.hidden_size != target.hidden_size or cache.meta.vocab_size != target.vocab_size:
        raise ValueError(f"the feature cache at {cache.directory} was extracted from another target ({cache.meta.model})")
    embedding = target.model.get_input_embeddings().weight.detach()
    lm_head = target.model.get_output_embeddings().weight.detach()
    shards = list(range(min(cfg.data.shards or len(cache.shards), len(cache.shards))))
    data = EagleData(cache, layers, lm_head, target.num_layers + 1, cfg.batch_size, cfg.seed, shards)
    console.print(f"training on {len(data.sequences)} sequences, {data.num_tokens()} tokens ({len(shards)} shards)")
    draft_ids = select_draft_vocab(data.label_counts(target.vocab_size), cfg.train.draft_vocab)
    head = EagleHead(EagleConfig.for_target(target, layers, len(draft_ids)), draft_ids)
    loss_config = EagleLossConfig(cfg.train.unroll, cfg.train.step_decay, cfg.train.regression_weight, cfg.train.feature_noise)
    loss = EagleLoss(head, embedding, lm_head, loss_config)
    train_config = TrainConfig(cfg.steps, cfg.lr, cfg.warmup_steps, cfg.weight_decay, cfg.grad_clip, cfg.checkpoint_every, cfg.log_every, cfg.seed)
    sink = make_sink(cfg.logger, run_dir, console, OmegaConf.to_container(OmegaConf.structured(cfg)))
    try:
        def log(step: int, metrics: dict[str, float]) -> None:
            console.print(f"step {step}/{cfg.steps}  " + "  ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
            sink.log(metrics, step)

        train(head, data.batches, loss, train_config, run_dir, log)
        output = Path(cfg.output or run_dir / "head")
        summary = {"method": cfg.train.name, "steps": cfg.steps, "train_tokens": data.num_tokens(), "train_sequences": len(data.sequences)}
        save_head(head.to(torch.float16), output, extra={"training": summary})
        head = head.float()
        results = {**summary, "checkpoint": str(output), **evaluate(target, tokenizer, head, cfg.eval)}
        sink.log_summary(results)
    finally:
        sink.finish()
    (run_dir / "train_results.json").write_text(json.dumps(results, indent=2))
    console.print(results)
    return results


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="train")
def main(cfg: DictConfig) -> None:
    console = Console()
    settings = OmegaConf.to_object(cfg)
    try:
        run(settings, Path(HydraConfig.get().runtime.output_dir), console)
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as error:
        print(f"specdec-train: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
