"""specdec-train: train a drafter head for any Hugging Face target, resumably.

    specdec-train                                   # EAGLE-1 head for SmolLM2 on ShareGPT features
    specdec-train train=eagle3 loop.steps=2000      # EAGLE-3: fused layers, training-time test
    specdec-train target=hf target.path=/path/to/hf/model data.conversations=5000
    specdec-train train=eagle3 data.regenerate=true init=drafters/checkpoints/eagle3-smollm2  # fine-tune on the target's own answers
    torchrun --nproc_per_node=2 -m experiments.train loop.steps=1000  # data parallel (gloo on CPU)

    specdec-train loop.steps=0                      # extract the features only
    specdec-train train=eagle3 loop.steps=2000 resume=latest  # continue the last killed eagle3 run

The target is chosen as for specdec-run (configs/target/, specdec.target_loader): target=smollm2 or
target=hf target.path=DIR, a float32 model whose tokenizer has a chat template. Every default lives
in the schema: the training loop's (loop.*) in drafters.training.trainer.TrainConfig, the rest in
TrainRunConfig below; configs/train.yaml only picks the config groups.

Stages, each resumable: (1) target features are extracted once into a shared on-disk cache
(data.features_dir, keyed by target; shards are written atomically; loop.steps=0 stops here), (2)
the head trains with AdamW, warmup + cosine and gradient clipping, checkpointing into the run dir
every loop.checkpoint_every steps (init=DIR starts from an exported head instead of a new one), (3)
the final head is exported (output=DIR, safetensors + config.json) and (4) evaluated: tau and greedy
equality on held-out MT-bench prompts against plain decoding; with loop.snapshot_every=N and
eval.curve=true also tau of every N-step snapshot against the training tokens it had seen
(train_results.json "curve" and tau_vs_tokens.png). Methods (EAGLE, EAGLE-3, Medusa, ...) live in
drafters/training/ behind drafters.training.methods.

Resuming after a kill: a run dir with a checkpoint continues from it (it says "resuming from step N
of <dir>"), ending bitwise equal to an unbroken run. resume=PATH continues the run in the dir PATH;
resume=latest continues the newest unfinished run beside this command's own run dir (by default
outputs/train/<train.name>/): one that holds a complete checkpoint and no train_results.json, the
newest being the one that wrote a checkpoint last. Either way the command must repeat the settings
that shape the head and its data (train.*, target.*, data.*, init, batch_size, loop.lr,
loop.warmup_steps, loop.weight_decay, loop.grad_clip, loop.seed; loop.steps may grow), checked
against the run's .hydra/config.yaml, which stays the record of how the run started; the new run
dir Hydra made for this command is removed. Rerunning with hydra.run.dir=<that dir> also resumes,
but overwrites that record.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, Optional

import hydra
import torch
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from drafters.training.data import MIN_SEQUENCE_LENGTH
from drafters.training.features import META, CacheMeta, FeatureCache, default_layers, extract_features
from drafters.training.methods import HeadMethod, build_method
from drafters.training.trainer import MARKER, TrainConfig, init_distributed, latest_checkpoint, snapshots, train
from experiments.common.sinks import SINKS, LoggerConfig, make_sink
from experiments.cli import check_command_line, exit_codes, require, user_errors
from specdec import assets
from specdec.decode import SpecDecoder
from specdec.files import write_atomically
from specdec.sampling import SamplingParams
from specdec.target import HFTarget
from specdec.target_loader import TargetConfig, TargetHandle, check_target_config, open_target
from verifiers.reference import verify

# shared with specdec-run: its target/ and logger/ groups are this command's too
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
RESULTS_FILE = "train_results.json"  # written once a run has trained, exported and evaluated its head


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
    curve: bool = False  # also measure tau of every snapshot (needs loop.snapshot_every > 0)


@dataclass
class TrainRunConfig:
    # the method's own settings (configs/train/<name>.yaml); each method checks its keys
    train: Dict[str, Any] = field(default_factory=lambda: {"name": "eagle"})
    target: TargetConfig = field(default_factory=TargetConfig)  # configs/target/<name>.yaml
    loop: TrainConfig = field(default_factory=TrainConfig)  # steps, learning-rate schedule, checkpoints, seed
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)  # configs/logger/<name>.yaml
    batch_size: int = 4  # per process under torchrun
    threads: Optional[int] = None
    output: Optional[str] = None  # export the final head here (null: <run dir>/head)
    init: Optional[str] = None  # an exported head to train further, e.g. on new data (null: a new head)
    resume: Optional[str] = None  # latest | an earlier run dir to continue in (see the module docstring)


ConfigStore.instance().store(name="train_schema", node=TrainRunConfig)
# the settings that shape the head and its data (a key covers everything under it): a resumed run must keep them
RESUME_KEYS = ("train", "target", "data", "init", "batch_size", "loop.lr", "loop.warmup_steps", "loop.weight_decay",
               "loop.grad_clip", "loop.seed")


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
        ("eval.prompts", evaluation.prompts, 1, "held-out MT-bench prompts"),
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
    require(not evaluation.curve or loop.snapshot_every > 0,
            "eval.curve=true measures the snapshots, and loop.snapshot_every=0 keeps none; set loop.snapshot_every=N")
    require(loop.steps > 0 or data.extract,
            "loop.steps=0 extracts the features and stops, and data.extract=false extracts none: nothing to do")
    require(loop.steps > 0 or settings.resume is None,
            f"loop.steps=0 trains nothing, so resume={settings.resume} has nothing to continue; drop one of them")
    target = settings.target
    # the trainer, its feature cache and its data parallelism (gloo) are CPU code; a GPU trains
    # through experiments.gpu_train (scripts/gpu_train.sh)
    require(target.device in ("auto", "cpu"),
            f"specdec-train computes on the CPU; got target.device={target.device} (drop it; heads train on a GPU "
            f"through scripts/gpu_train.sh)")
    settings = replace(settings, target=replace(target, device="cpu"))
    target = settings.target
    check_target_config(target)
    require(target.name != "synthetic",
            "target=synthetic has no weights to train a head on; use target=smollm2 or target=hf target.path=DIR")
    # the head's loss multiplies by the target's LM head and embeddings, and the cached features are
    # shared by every run on the target: one precision for all of them
    require(target.dtype == "float32",
            f"specdec-train trains on the float32 target; got target.dtype={target.dtype} (drop it, or use target=smollm2)")
    require(settings.init is None or Path(settings.init).is_dir(),
            f"init={settings.init}: no such folder; pass a head exported by specdec-train (its output=DIR)")
    return settings


def open_chat_target(cfg: TargetConfig) -> TargetHandle:
    """The target with its tokenizer read and its weights not yet loaded (``handle.load()``), refused
    when the tokenizer has no chat template: the ShareGPT conversations (and specdec-train's MT-bench
    evaluation prompts) are rendered through one."""
    handle = open_target(cfg, with_tokenizer=True)
    if not getattr(handle.tokenizer, "chat_template", None):
        setting = f"target.path={cfg.path}" if cfg.name == "hf" else f"target={cfg.name}"
        raise ValueError(f"{setting}: its tokenizer has no chat template (a base model?); the ShareGPT conversations "
                         f"are rendered through one, so pass a chat (instruct) model")
    return handle


def opened_target(settings: TrainRunConfig) -> TargetHandle:
    """open_chat_target (a model folder, its config and tokenizer read, the weights not loaded), and
    the feature cache that data.extract=false trains on checked; before Hydra makes a run dir too
    (check_config)."""
    handle = open_chat_target(settings.target)
    if not settings.data.extract:
        cache = features_dir(settings, handle.key)
        require((cache / META).is_file(), f"data.extract=false trains on the cached features, and {cache} holds none; "
                                          f"extract them first (data.extract=true; loop.steps=0 extracts only)")
    return handle


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
    from drafters.training.data import answered_sequences, chat_sequences
    from experiments.common.answers import regenerated_answers

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


def prepare_features(cfg: TrainRunConfig, target: HFTarget, tokenizer, label: str, layers: tuple[int, ...], console: Console,
                     rank: int = 0, world: int = 1) -> FeatureCache:
    """The feature cache, with what it lacks extracted first (``data.extract``). Under torchrun every
    process extracts its own share of the shards into the one folder (``extract_features``,
    distributed) and all return once the whole cache is on disk; answers regenerated by the target
    are one shared file, so process 0 writes it first and the others then read it whole."""
    directory = features_dir(cfg, label)
    if cfg.data.extract:
        if cfg.data.regenerate and world > 1:
            if rank == 0:
                training_sequences(cfg, target, tokenizer, label, console)
            torch.distributed.barrier()
        # an existing cache keeps its layers; another run's meta.json is written atomically, and a
        # process that finds none computes the default its writer did
        stored = default_layers(target.num_layers, layers)
        if (directory / META).exists():
            stored = tuple(json.loads((directory / META).read_text())["layers"])
        sequences = training_sequences(cfg, target, tokenizer, label, console)
        meta = CacheMeta(str(label), target.hidden_size, target.num_layers, target.vocab_size, stored, cfg.data.max_length, cfg.data.per_shard)
        console.print(f"features: {len(sequences)} sequences -> {directory} (resumes where it stopped)")
        extract_features(target, sequences, directory, meta, distributed=world > 1,
                         progress=(lambda done, total, rate: console.print(f"  {done}/{total} tokens, {rate:.0f} tokens/s", end="\r"))
                         if rank == 0 else None)
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


def tau_curve(method: HeadMethod, model: torch.nn.Module, target: HFTarget, tokenizer, cfg: TrainRunConfig,
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


def run(cfg: TrainRunConfig, handle: TargetHandle, run_dir: Path, console: Console) -> dict[str, Any]:
    """Train, export and evaluate a head on the target ``handle`` opened (opened_target)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    rank, world = init_distributed()
    if world > 1:  # Hydra names each process's run dir by its own clock: every process uses process 0's
        shared = [str(run_dir)]
        torch.distributed.broadcast_object_list(shared, src=0)
        run_dir = Path(shared[0])
    method = build_method(cfg.train)
    checkpoint = latest_checkpoint(run_dir) if cfg.loop.steps else None
    if checkpoint:
        console.print(f"resuming from step {checkpoint[0]} of {run_dir}")
    target, tokenizer, label = handle.load(), handle.tokenizer, handle.key
    # loaded before the (long) feature extraction, so a wrong path or head fails at once
    if cfg.init:
        with assets.model_loading_errors(f"init={cfg.init}", "pass a head exported by specdec-train with this train= and target"):
            head = method.load(target, Path(cfg.init))
    else:
        head = None
    layers = method.feature_layers(target)
    cache = prepare_features(cfg, target, tokenizer, label, layers, console, rank, world)
    if cfg.loop.steps == 0:
        console.print(f"loop.steps=0: the features are in {cache.directory}; stopping before training (nothing trained, "
                      f"exported or evaluated)")
        return {}
    if cache.meta.hidden_size != target.hidden_size or cache.meta.vocab_size != target.vocab_size:
        raise ValueError(f"the feature cache at {cache.directory} was extracted from another target ({cache.meta.model})")
    shards = list(range(min(cfg.data.shards or len(cache.shards), len(cache.shards))))
    torch.manual_seed(cfg.loop.seed)  # the head's initial weights: the same in every process
    prepared = method.prepare(target, cache, cfg.batch_size, cfg.loop.seed, shards, head)
    console.print(f"training on {prepared.num_sequences} sequences, {prepared.num_tokens} tokens ({len(shards)} shards), {world} process(es)")
    if rank == 0:  # it describes a finished run; left beside a killed rerun, it would pass for this run's
        (run_dir / RESULTS_FILE).unlink(missing_ok=True)
    sink = make_sink(cfg.logger.name if rank == 0 else "none", run_dir, console,
                     OmegaConf.to_container(OmegaConf.structured(cfg)), cfg.logger.project, cfg.logger.mode, run_dir.name,
                     keep_until_step=checkpoint[0] if checkpoint else None)
    try:
        def log(step: int, metrics: dict[str, float]) -> None:
            console.print(f"step {step}/{cfg.loop.steps}  " + "  ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
            sink.log(metrics, step)

        train(prepared.model, prepared.batches, prepared.loss, cfg.loop, run_dir, log)
        if rank != 0:
            return {}
        output = Path(cfg.output or run_dir / "head")
        tokens_per_step = cfg.batch_size * world * prepared.num_tokens / prepared.num_sequences
        summary = {"method": cfg.train["name"], "init": cfg.init, "steps": cfg.loop.steps, "processes": world,
                   "train_tokens": prepared.num_tokens, "train_sequences": prepared.num_sequences,
                   "train_tokens_seen": round(cfg.loop.steps * tokens_per_step)}
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
    write_atomically(run_dir / RESULTS_FILE, lambda path: path.write_text(json.dumps(results, indent=2)))
    console.print(results)
    return results


def resumed_run_dir(settings: TrainRunConfig, cfg: DictConfig, hydra_dir: Path) -> Path:
    """The dir to train in: Hydra's new one, or with resume= an earlier run's, checked to hold a
    complete checkpoint written with this command's settings."""
    if settings.resume is None:
        return hydra_dir
    if settings.resume == "latest":
        run_dir = latest_unfinished_run(hydra_dir.parent, hydra_dir)
    else:
        run_dir = Path(settings.resume)
        require(run_dir.is_dir(), f"resume={settings.resume}: no such folder; pass a specdec-train run dir or resume=latest")
        require(latest_checkpoint(run_dir) is not None,
                f"resume={settings.resume}: the folder holds no complete checkpoint (state/{MARKER}) to resume from")
    check_same_settings(run_dir, cfg)
    return run_dir


def latest_unfinished_run(parent: Path, hydra_dir: Path) -> Path:
    """The run dir under ``parent`` with a complete checkpoint and no train_results.json whose
    checkpoint was written last."""
    unfinished = []
    for run_dir in parent.iterdir() if parent.is_dir() else ():
        if run_dir.is_dir() and run_dir != hydra_dir and not (run_dir / RESULTS_FILE).exists():
            checkpoint = latest_checkpoint(run_dir)
            if checkpoint is not None:
                unfinished.append(((checkpoint[1] / MARKER).stat().st_mtime_ns, run_dir))
    require(bool(unfinished), f"resume=latest: no unfinished run with a checkpoint in {parent}; start a new run "
                              f"(without resume=) or pass resume=RUN_DIR")
    return max(unfinished)[1]


def check_same_settings(run_dir: Path, cfg: DictConfig) -> None:
    """A resume must train the head the run started, on the same data (RESUME_KEYS)."""
    recorded = run_dir / ".hydra" / "config.yaml"
    try:
        before = OmegaConf.to_container(OmegaConf.load(recorded), resolve=True)
        overrides = " ".join(OmegaConf.load(run_dir / ".hydra" / "overrides.yaml"))
    except (OSError, ValueError, TypeError) as error:
        raise ValueError(f"resume={run_dir}: cannot read the settings it started with from {recorded.parent} ({error}); "
                         f"is it a specdec-train run dir?") from error
    now = OmegaConf.to_container(cfg, resolve=True)
    earlier, current = (resume_settings(settings) for settings in (before, now))
    changed = [key for key in sorted(earlier.keys() | current.keys()) if earlier.get(key) != current.get(key)]
    require(not changed,
            f"resume={run_dir}: that run started with {', '.join(f'{k}={earlier.get(k)!r}' for k in changed)}, this "
            f"command has {', '.join(f'{k}={current.get(k)!r}' for k in changed)}; repeat its settings (its command "
            f"line: {overrides or 'the defaults'}) or start a new run")


def resume_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The RESUME_KEYS settings of a config, flat (``loop.lr``, ``train.unroll``, ...); where the
    target computes is not one (runs from before target.device have none)."""
    return {key: value for key, value in _flatten(config).items()
            if any(key == kept or key.startswith(f"{kept}.") for kept in RESUME_KEYS) and key != "target.device"}


def _flatten(settings: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def remove_hydra_dir(hydra_dir: Path, job_name: str) -> None:
    """A resumed run writes into the earlier run's dir; the new one Hydra made holds nothing but its
    record of this command (kept only if something else is in it)."""
    if {path.name for path in hydra_dir.iterdir()} <= {".hydra", f"{job_name}.log"}:
        shutil.rmtree(hydra_dir)


def check_config(cfg: DictConfig) -> None:
    """checked_settings and opened_target for the command line as a whole (experiments.cli), before
    Hydra starts."""
    with user_errors():
        opened_target(checked_settings(cfg))


def main() -> None:
    check_command_line("specdec-train", CONFIG_DIR, "train", check_config)
    hydra_main()


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="train")
def hydra_main(cfg: DictConfig) -> None:
    console = Console()
    interrupted = "interrupted; rerun with resume=latest (or resume=<its run dir>) to continue from its last checkpoint"
    with exit_codes("specdec-train", interrupted=interrupted), user_errors():
        settings = checked_settings(cfg)
        handle = opened_target(settings)
        hydra_config = HydraConfig.get()
        hydra_dir = Path(hydra_config.runtime.output_dir)
        run_dir = resumed_run_dir(settings, cfg, hydra_dir)
        if run_dir != hydra_dir:
            remove_hydra_dir(hydra_dir, hydra_config.job.name)
        run(settings, handle, run_dir, console)


if __name__ == "__main__":
    main()
