"""specdec-train's Hydra schema (every default lives here or in drafters.training.trainer.TrainConfig)
and every check that needs nothing loaded."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from drafters.training.data import MIN_SEQUENCE_LENGTH
from drafters.training.methods import build_method, check_feature_source, check_target_kind
from drafters.training.trainer import TrainConfig
from experiments.common.sinks import SINKS, LoggerConfig
from experiments.cli import require
from experiments.train.schedule import ScheduleConfig, check_schedule
from specdec.target_loader import TARGETS, TargetConfig, check_target_config, target_device


@dataclass
class DataConfig:
    features_dir: Optional[str] = None  # null: <cache>/features/<target>-sharegpt
    conversations: int = 3000
    max_length: int = 512
    per_shard: int = 16
    shards: Optional[int] = None  # train on the first N complete shards (null: all)
    extract: bool = True  # extract missing shards first; false: train on what the cache holds
    regenerate: bool = False  # answers written by the target itself (first turn), cached and resumable
    regenerate_tokens: int = 256
    regenerate_temperature: float = 0.0
    regenerate_batch: int = 32  # requests decoded together (continuous batching)
    # a file of sequences tokenised beforehand (experiments.train.sources.write_sequences; scripts/device/stage.py
    # writes one), trained on in place of ShareGPT (null: ShareGPT)
    sequences: Optional[str] = None


@dataclass
class OnlineConfig:
    """features=online: the target computes each batch's features as training runs (no cache)."""

    batch_tokens: int = 4096  # padded tokens per batch (about), in place of batch_size
    label_tokens: int = 200_000  # target choices counted to pick the draft vocabulary


@dataclass
class EvalConfig:
    prompts: int = 8  # 0: no evaluation (a machine without the MT-bench package)
    max_new_tokens: int = 64
    depth: int = 4
    curve: bool = False  # also measure tau of every snapshot (needs loop.snapshot_every > 0)


@dataclass
class TrainRunConfig:
    # the method's own settings (configs/train/<name>.yaml); each method checks its keys
    train: Dict[str, Any] = field(default_factory=lambda: {"name": "eagle"})
    target: TargetConfig = field(default_factory=TargetConfig)  # configs/target/<name>.yaml
    loop: TrainConfig = field(default_factory=TrainConfig)  # steps, learning-rate schedule, checkpoints, seed
    features: str = "cached"  # cached (extracted once into data.features_dir) | online (computed as training runs)
    data: DataConfig = field(default_factory=DataConfig)
    online: OnlineConfig = field(default_factory=OnlineConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)  # configs/logger/<name>.yaml
    batch_size: int = 4  # per process under torchrun (features=cached)
    threads: Optional[int] = None
    output: Optional[str] = None  # export the final head here (null: <run dir>/head)
    init: Optional[str] = None  # an exported head to train further, e.g. on new data (null: a new head)
    resume: Optional[str] = None  # latest | an earlier run dir to continue in (see experiments.train)
    schedule: Optional[ScheduleConfig] = None  # configs/schedule/<name>.yaml: several methods on one time budget
    # specdec-run's default drafter as a target's YAML picks it (configs/train.yaml); not read here
    drafter: Optional[Dict[str, Any]] = None


ConfigStore.instance().store(name="train_schema", node=TrainRunConfig)
# the settings that shape the head and its data (a key covers everything under it): a resumed run must keep them
RESUME_KEYS = ("train", "target", "features", "data", "online", "init", "batch_size", "loop.lr", "loop.warmup_steps",
               "loop.weight_decay", "loop.grad_clip", "loop.seed")


def checked_settings(cfg: DictConfig) -> TrainRunConfig:
    """Everything that can be checked without reading the target; raises SpecdecUserError (or the
    ValueError of a registry or specdec.target_loader) naming the option."""
    settings: TrainRunConfig = OmegaConf.to_object(cfg)
    loop, data, evaluation = settings.loop, settings.data, settings.eval
    for name, value, least, meaning in [
        ("loop.steps", loop.steps, 0, "0 extracts the features and stops"),
        ("batch_size", settings.batch_size, 1, "sequences per step and process"),
        ("loop.checkpoint_every", loop.checkpoint_every, 1, "a checkpoint every N steps"),
        ("loop.log_every", loop.log_every, 1, "a metrics line every N steps"),
        ("loop.warmup_steps", loop.warmup_steps, 0, "0: no warmup"),
        ("loop.snapshot_every", loop.snapshot_every, 0, "0: no snapshots"),
        ("data.conversations", data.conversations, 1, "ShareGPT conversations to train on"),
        ("data.max_length", data.max_length, MIN_SEQUENCE_LENGTH, "shorter sequences are not trained on"),
        ("data.per_shard", data.per_shard, 1, "sequences per feature shard"),
        ("data.regenerate_tokens", data.regenerate_tokens, 1, "the longest regenerated answer"),
        ("data.regenerate_batch", data.regenerate_batch, 1, "requests decoded together"),
        ("online.batch_tokens", settings.online.batch_tokens, 1, "padded tokens per batch"),
        ("online.label_tokens", settings.online.label_tokens, 1, "target choices counted for the draft vocabulary"),
        ("eval.prompts", evaluation.prompts, 0, "held-out MT-bench prompts; 0: no evaluation"),
        ("eval.max_new_tokens", evaluation.max_new_tokens, 1, "tokens per evaluation answer"),
        ("eval.depth", evaluation.depth, 1, "draft depth in the evaluation"),
    ]:
        require(value >= least, f"{name} must be >= {least} ({meaning}); got {name}={value}")
    for name, value in [("threads", settings.threads), ("data.shards", data.shards)]:
        require(value is None or value >= 1, f"{name} must be >= 1 or null; got {name}={value}")
    for name, value, positive in [("loop.lr", loop.lr, True), ("loop.grad_clip", loop.grad_clip, True),
                                  ("loop.weight_decay", loop.weight_decay, False),
                                  ("data.regenerate_temperature", data.regenerate_temperature, False)]:
        bound = "> 0" if positive else ">= 0"
        require(math.isfinite(value) and (value > 0 if positive else value >= 0),
                f"{name} must be a finite number {bound}; got {name}={value}")
    SINKS.check(settings.logger.name)
    require(not data.sequences or Path(data.sequences).is_file(),
            f"data.sequences={data.sequences}: no such file; pass one written by experiments.train.sources.write_sequences")
    require(not (data.sequences and data.regenerate),
            "data.regenerate=true answers ShareGPT's conversations, and data.sequences holds tokens only; drop one")
    method = build_method(settings.train).name
    check_feature_source(method, settings.features)
    online = settings.features == "online"
    if settings.schedule is not None:
        check_schedule(settings.schedule)
        require(online, "schedule= trains with features=online; pass features=online")
        require(settings.resume is None and settings.init is None and not evaluation.curve,
                "schedule= trains new heads in a new run dir: drop resume=, init= and eval.curve=true")
    require(not evaluation.curve or loop.snapshot_every > 0,
            "eval.curve=true measures the snapshots, and loop.snapshot_every=0 keeps none; set loop.snapshot_every=N")
    require(loop.steps > 0 or (data.extract and not online),
            "loop.steps=0 extracts the features and stops, and data.extract=false or features=online extracts none: "
            "nothing to do")
    require(loop.steps > 0 or settings.resume is None,
            f"loop.steps=0 trains nothing, so resume={settings.resume} has nothing to continue; drop one of them")
    target = settings.target
    # the feature cache and its data parallelism (gloo) are CPU code; a GPU trains with features=online
    require(online or target.device in ("auto", "cpu"),
            f"features=cached trains on the CPU; got target.device={target.device} (drop it, or train on the GPU "
            f"with features=online)")
    check_target_config(target)
    check_target_kind(method, TARGETS.trait(target.name, "kind"), f"target={target.name}")
    # the head's loss multiplies by the target's LM head and embeddings, and the cached features are
    # shared by every run on the target: one precision for all of them
    require(online or target.dtype == "float32",
            f"features=cached trains on the float32 target; got target.dtype={target.dtype} (drop it, or use "
            f"features=online)")
    require(settings.init is None or Path(settings.init).is_dir(),
            f"init={settings.init}: no such folder; pass a head exported by specdec-train (its output=DIR)")
    # online, the features never leave the device the target computes on
    device = str(target_device(target)) if online else "cpu"
    return replace(settings, target=replace(target, device=device))
