"""specdec-train: train a drafter head for any Hugging Face target, resumably.

    specdec-train                                   # EAGLE-1 head for SmolLM2 on ShareGPT features
    specdec-train train=eagle3 steps=2000           # EAGLE-3: fused layers, training-time test
    specdec-train target=/path/to/hf/model data.conversations=5000
    specdec-train train=eagle3 data.regenerate=true init=drafters/checkpoints/eagle3-smollm2  # fine-tune on the target's own answers
    torchrun --nproc_per_node=2 -m experiments.train steps=1000  # data parallel (gloo on CPU)

Stages, each resumable: (1) target features are extracted once into a shared on-disk cache
(data.features_dir, keyed by target; shards are written atomically), (2) the head trains with
AdamW, warmup + cosine and gradient clipping, checkpointing into the run dir every
checkpoint_every steps (rerun the same command with hydra.run.dir=<that dir> to resume after a
kill; init=DIR starts from an exported head instead of a new one), (3) the final head is exported
(output=DIR, safetensors + config.json) and (4) evaluated:
tau and greedy equality on held-out MT-bench prompts against plain decoding; with
snapshot_every=N and eval.curve=true also tau of every N-step snapshot against the training
tokens it had seen (train_results.json "curve" and tau_vs_tokens.png). Methods (EAGLE, EAGLE-3,
Medusa, ...) live in drafters/training/ behind drafters.training.methods.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional

import hydra
import torch
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from drafters.training.features import CacheMeta, FeatureCache, extract_features
from drafters.training.methods import TrainMethod, build_method
from drafters.training.trainer import TrainConfig, init_distributed, snapshots, train
from experiments.sinks import make_sink
from specdec import assets
from specdec.decode import SpecDecoder
from specdec.sampling import SamplingParams
from specdec.target import HFTarget
from verifiers.reference import verify

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


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


@dataclass
class EvalConfig:
    prompts: int = 8
    max_new_tokens: int = 64
    depth: int = 4
    curve: bool = False  # also measure tau of every snapshot (needs snapshot_every > 0)


@dataclass
class TrainRunConfig:
    # the method's own settings (configs/train/<name>.yaml); each method checks its keys
    train: Dict[str, Any] = field(default_factory=lambda: {"name": "eagle"})
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    target: str = "smollm2"  # or a Hugging Face model folder
    batch_size: int = 4  # per process under torchrun
    steps: int = 600
    lr: float = 5e-4
    warmup_steps: int = 30
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    checkpoint_every: int = 50
    snapshot_every: int = 0
    log_every: int = 10
    seed: int = 0
    threads: Optional[int] = None
    output: Optional[str] = None  # export the final head here (null: <run dir>/head)
    init: Optional[str] = None  # an exported head to train further, e.g. on new data (null: a new head)
    logger: str = "jsonl"


ConfigStore.instance().store(name="train_schema", node=TrainRunConfig)


def load_target(name: str, dtype: torch.dtype = torch.float32) -> tuple[HFTarget, Any, str]:
    """``smollm2`` or a Hugging Face model folder whose tokenizer has a chat template, as a target."""
    if name == "smollm2":
        model, tokenizer = assets.load_smollm2(dtype)
        return HFTarget(model, packed_gemm_from="auto"), tokenizer, "smollm2"
    path = Path(name)
    if not path.is_dir():
        raise FileNotFoundError(f"target={name!r}: not 'smollm2' and not a Hugging Face model folder")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"target={name!r}: its tokenizer has no chat template (a base model?); specdec-train renders the "
            f"ShareGPT conversations and the MT-bench evaluation prompts through one"
        )
    return HFTarget(AutoModelForCausalLM.from_pretrained(path, dtype=dtype), packed_gemm_from="auto"), tokenizer, path.name


def data_source(data: DataConfig) -> str:
    """Names the training text: ShareGPT as written, or with answers the target regenerated."""
    return f"sharegpt-regen{data.regenerate_tokens}-T{data.regenerate_temperature:g}" if data.regenerate else "sharegpt"


def regeneration_cache(label: str, data: DataConfig) -> Path:
    """Where the target ``label``'s regenerated answers are kept (resumable; build_datastore --generate
    shares the file)."""
    return assets.cache_dir() / "regenerated" / f"{label}-{data_source(data)}.jsonl"


def features_dir(cfg: TrainRunConfig, label: str) -> Path:
    return Path(cfg.data.features_dir or assets.cache_dir() / "features" / f"{label}-{data_source(cfg.data)}")


def training_sequences(cfg: TrainRunConfig, target: HFTarget, tokenizer, label: str, console: Console) -> list[list[int]]:
    from drafters.training.data import answered_sequences, chat_sequences, regenerated_answers

    conversations = assets.load_sharegpt_conversations(cfg.data.conversations)
    if not cfg.data.regenerate:
        return chat_sequences(tokenizer, conversations, cfg.data.max_length)
    d = cfg.data
    cache_file = regeneration_cache(label, d)
    console.print(f"regenerating answers with the target -> {cache_file} (resumes where it stopped)")
    pairs = regenerated_answers(target, tokenizer, conversations, d.max_length, cache_file, d.regenerate_tokens,
                                SamplingParams(d.regenerate_temperature), d.regenerate_batch,
                                progress=lambda done, total: console.print(f"  {done}/{total} answers", end="\r"))
    return answered_sequences(pairs, d.max_length)


def prepare_features(cfg: TrainRunConfig, target: HFTarget, tokenizer, label: str, layers: tuple[int, ...], console: Console) -> FeatureCache:
    directory = features_dir(cfg, label)
    stored = tuple(dict.fromkeys((2, target.num_layers // 2, target.num_layers - 3, target.num_layers + 1) + layers))
    if cfg.data.extract:
        if (directory / "meta.json").exists():
            stored = tuple(json.loads((directory / "meta.json").read_text())["layers"])
        sequences = training_sequences(cfg, target, tokenizer, label, console)
        meta = CacheMeta(str(label), target.hidden_size, target.num_layers, target.vocab_size, stored, cfg.data.max_length, cfg.data.per_shard)
        console.print(f"features: {len(sequences)} sequences -> {directory} (resumes where it stopped)")
        extract_features(target, sequences, directory, meta,
                         progress=lambda done, total, rate: console.print(f"  {done}/{total} tokens, {rate:.0f} tokens/s", end="\r"))
        console.print()
    return FeatureCache(directory)


def evaluate(target: HFTarget, tokenizer, drafter, cfg: EvalConfig, plain: bool = True) -> dict[str, Any]:
    """tau (and, with ``plain``, greedy equality and speedup) on the LAST MT-bench prompts: the
    first ones stay held out for specdec-run."""
    prompts = [assets.encode_prompt(tokenizer, p) for p in assets.load_mtbench()[-cfg.prompts :]]
    greedy = SamplingParams(0.0)
    spec = SpecDecoder(target, drafter, verify).generate(prompts, cfg.max_new_tokens, greedy, eos_token_id=tokenizer.eos_token_id)
    results = {"tau": spec.stats.tau, "per_depth_alpha": spec.stats.per_depth_alpha, "prompts": cfg.prompts}
    if plain:
        base = SpecDecoder(target, None, verify).generate(prompts, cfg.max_new_tokens, greedy, eos_token_id=tokenizer.eos_token_id)
        results.update(greedy_equal=spec.outputs == base.outputs, speedup=spec.stats.tokens_per_s / max(base.stats.tokens_per_s, 1e-9))
    return results


def tau_curve(method: TrainMethod, model: torch.nn.Module, target: HFTarget, tokenizer, cfg: TrainRunConfig,
              run_dir: Path, tokens_per_step: float, console: Console) -> list[dict[str, Any]]:
    """tau of every snapshot against the training tokens it had seen."""
    from safetensors.torch import load_file

    curve = []
    for step, path in snapshots(run_dir):
        model.load_state_dict(load_file(str(path)))
        point = evaluate(target, tokenizer, method.drafter(target, model.eval(), cfg.eval.depth), cfg.eval, plain=False)
        curve.append({"step": step, "train_tokens_seen": round(step * tokens_per_step), **point})
        console.print(f"curve: step {step}: tau {point['tau']:.3f}")
    return curve


def plot_curve(curve: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    axis.plot([p["train_tokens_seen"] / 1e6 for p in curve], [p["tau"] for p in curve], marker="o")
    axis.set(xlabel="training tokens seen (millions)", ylabel="tau (tokens per target forward)", title=title)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    temporary = path.with_name(f".{path.name}.tmp.png")
    figure.savefig(temporary, dpi=120)
    plt.close(figure)
    temporary.replace(path)


def run(cfg: TrainRunConfig, run_dir: Path, console: Console) -> dict[str, Any]:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    rank, world = init_distributed()
    if world > 1:  # Hydra names each process's run dir by its own clock: every process uses process 0's
        shared = [str(run_dir)]
        torch.distributed.broadcast_object_list(shared, src=0)
        run_dir = Path(shared[0])
    method = build_method(cfg.train)
    target, tokenizer, label = load_target(cfg.target)
    # loaded before the (long) feature extraction, so a wrong path or head fails at once
    head = method.load(target, Path(cfg.init)) if cfg.init else None
    layers = method.feature_layers(target)
    cache = prepare_features(cfg, target, tokenizer, label, layers, console) if rank == 0 else None
    if world > 1:
        torch.distributed.barrier()  # process 0 extracted what was missing
        cache = cache or FeatureCache(features_dir(cfg, label))
    if cache.meta.hidden_size != target.hidden_size or cache.meta.vocab_size != target.vocab_size:
        raise ValueError(f"the feature cache at {cache.directory} was extracted from another target ({cache.meta.model})")
    shards = list(range(min(cfg.data.shards or len(cache.shards), len(cache.shards))))
    torch.manual_seed(cfg.seed)  # the head's initial weights: the same in every process
    prepared = method.prepare(target, cache, cfg.batch_size, cfg.seed, shards, head)
    console.print(f"training on {prepared.num_sequences} sequences, {prepared.num_tokens} tokens ({len(shards)} shards), {world} process(es)")
    train_config = TrainConfig(cfg.steps, cfg.lr, cfg.warmup_steps, cfg.weight_decay, cfg.grad_clip, cfg.checkpoint_every,
                               cfg.log_every, cfg.seed, cfg.snapshot_every)
    sink = make_sink(cfg.logger if rank == 0 else "none", run_dir, console, OmegaConf.to_container(OmegaConf.structured(cfg)))
    try:
        def log(step: int, metrics: dict[str, float]) -> None:
            console.print(f"step {step}/{cfg.steps}  " + "  ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
            sink.log(metrics, step)

        train(prepared.model, prepared.batches, prepared.loss, train_config, run_dir, log)
        if rank != 0:
            return {}
        output = Path(cfg.output or run_dir / "head")
        tokens_per_step = cfg.batch_size * world * prepared.num_tokens / prepared.num_sequences
        summary = {"method": cfg.train["name"], "init": cfg.init, "steps": cfg.steps, "processes": world, "train_tokens": prepared.num_tokens,
                   "train_sequences": prepared.num_sequences, "train_tokens_seen": round(cfg.steps * tokens_per_step)}
        model = prepared.model
        method.export(model.to(torch.float16), output, {"training": summary})
        model = model.float().eval()
        results = {**summary, "checkpoint": str(output), **evaluate(target, tokenizer, method.drafter(target, model, cfg.eval.depth), cfg.eval)}
        if cfg.eval.curve:
            results["curve"] = tau_curve(method, model, target, tokenizer, cfg, run_dir, tokens_per_step, console)
            plot_curve(results["curve"], run_dir / "tau_vs_tokens.png", f"{cfg.train['name']}: tau vs training tokens (depth {cfg.eval.depth})")
        sink.log_summary(results)
    finally:
        sink.finish()
    temporary = run_dir / ".train_results.json.tmp"
    temporary.write_text(json.dumps(results, indent=2))
    temporary.replace(run_dir / "train_results.json")
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
