"""specdec-train's command: the Hydra entry point, its run dir (locked, or an earlier one resumed),
the recipe (experiments.train.recipe) on the settings, and the exported head's evaluation. The
usage is experiments.train's docstring."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import hydra
import torch
from safetensors.torch import load_file
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from torch import nn

from drafters.training.data import answered_sequences
from drafters.training.methods import HeadMethod, build_method
from drafters.training.trainer import MARKER, checkpoint_draft_ids, init_distributed, latest_checkpoint, snapshots
from experiments.cli import check_command_line, exit_codes, hold_lock, pin_output_dir, require, user_errors
from experiments.common import prompt_sets
from experiments.common.answers import answered_prompts
from experiments.common.sinks import make_sink
from experiments.common.config_dir import CONFIG_DIR  # specdec-run's: its target/ and logger/ groups are this command's too
from experiments.train import schedule as timed
from experiments.train.recipe import CachedFeatures, Features, OnlineFeatures, TrainRecipe
from experiments.train.schema import RESUME_KEYS, EvalConfig, TrainRunConfig, checked_settings
from experiments.train.sources import (opened_target, opening_prompts_for, prepare_features, shared_sequences,
                                       token_sequences, training_sequences)
from specdec import assets
from specdec.decode import SpecDecoder
from specdec.files import write_atomically
from specdec.sampling import SamplingParams
from specdec.target import HFTarget
from specdec.target_loader import TargetHandle
from verifiers.reference import verify

RESULTS_FILE = "train_results.json"  # written once a run has trained, exported and evaluated its head
LOCK_FILE = ".train.lock"  # held in the run dir while a training writes there
BUSY = "wait for that training to end, or choose another hydra.run.dir"


def evaluate(target: HFTarget, tokenizer, drafter, cfg: EvalConfig, chat: bool, plain: bool = True) -> dict[str, Any]:
    """tau (and, with ``plain``, greedy equality and speedup) on the LAST MT-bench prompts, as chat
    turns or (a base model) raw text: the first ones stay held out for specdec-run."""
    prompts = [prompt_sets.encode_prompt(tokenizer, replace(p, chat=chat)) for p in prompt_sets.load_mtbench()[-cfg.prompts :]]
    greedy = SamplingParams(0.0)
    spec = SpecDecoder(target, drafter, verify).generate(prompts, cfg.max_new_tokens, greedy, eos_token_id=tokenizer.eos_token_id)
    # the attempts tell an alpha of 0 from a depth no draft reached
    results = {"tau": spec.stats.tau, "per_depth_alpha": spec.stats.per_depth_alpha,
               "per_depth_attempts": spec.stats.per_depth_attempts, "prompts": cfg.prompts}
    if plain:
        base = SpecDecoder(target, None, verify).generate(prompts, cfg.max_new_tokens, greedy, eos_token_id=tokenizer.eos_token_id)
        results.update(greedy_equal=spec.outputs == base.outputs, speedup=spec.stats.tokens_per_s / max(base.stats.tokens_per_s, 1e-9))
    return results


def evaluated(method: HeadMethod, model: nn.Module, target: HFTarget, tokenizer, cfg: TrainRunConfig) -> dict[str, Any]:
    """evaluate on an exported head; nothing with eval.prompts=0."""
    if not cfg.eval.prompts:
        return {}
    return evaluate(target, tokenizer, method.drafter(target, model, cfg.eval.depth), cfg.eval, cfg.target.chat)


def tau_curve(method: HeadMethod, model: nn.Module, target: HFTarget, tokenizer, cfg: TrainRunConfig,
              run_dir: Path, tokens_per_step: float, console: Console) -> list[dict[str, Any]]:
    """tau of every snapshot against the training tokens it had seen."""
    curve = []
    for step, path in snapshots(run_dir):
        model.load_state_dict(load_file(str(path)))
        drafter = method.drafter(target, model.eval(), cfg.eval.depth)
        point = evaluate(target, tokenizer, drafter, cfg.eval, cfg.target.chat, plain=False)
        curve.append({"step": step, "train_tokens_seen": round(step * tokens_per_step), **point})
        console.print(f"curve: step {step}: tau {point['tau']:.3f}")
    return curve


def plot_curve(curve: list[dict[str, Any]], path: Path, title: str) -> None:
    # matplotlib: ~0.5 s to import, for the curve's plot alone
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


def features_for(cfg: TrainRunConfig, method: HeadMethod, target: HFTarget, tokenizer, label: str, console: Console,
                 rank: int, world: int, head: nn.Module | None, resumed_ids: torch.Tensor | None) -> Features | None:
    """cfg.features' source for training ``head`` (None: a new one, or the checkpoint's on a resume,
    whose draft vocabulary is ``resumed_ids`` [K]); None when loop.steps=0 has extracted the cache
    and nothing is to train."""
    if cfg.features == "online":
        shared_sequences(cfg, target, tokenizer, label, console, rank, world)
        sequences = token_sequences(training_sequences(cfg, target, tokenizer, label, console))
        return OnlineFeatures.of(method, target, sequences, cfg.online.batch_tokens, cfg.loop.seed, cfg.online.label_tokens,
                                 head, resumed_ids)
    cache = prepare_features(cfg, target, tokenizer, label, method.feature_layers(target), console, rank, world)
    if cfg.loop.steps == 0:
        console.print(f"loop.steps=0: the features are in {cache.directory}; stopping before training (nothing trained, "
                      f"exported or evaluated)")
        return None
    if cache.meta.hidden_size != target.hidden_size or cache.meta.vocab_size != target.vocab_size:
        raise ValueError(f"the feature cache at {cache.directory} was extracted from another target ({cache.meta.model})")
    shards = list(range(min(cfg.data.shards or len(cache.shards), len(cache.shards))))
    return CachedFeatures(cache, cfg.batch_size, cfg.loop.seed, shards)


def run(cfg: TrainRunConfig, handle: TargetHandle, run_dir: Path, console: Console) -> dict[str, Any]:
    """specdec-train: the recipe on the target ``handle`` opened (sources.opened_target), then the
    exported head evaluated and train_results.json written."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    rank, world = init_distributed()
    if world > 1:  # Hydra names each process's run dir by its own clock: every process uses process 0's
        shared = [str(run_dir)]
        torch.distributed.broadcast_object_list(shared, src=0)
        run_dir = Path(shared[0])
    method = build_method(cfg.train)
    checkpoint = latest_checkpoint(run_dir) if cfg.loop.steps else None
    resumed_ids = checkpoint_draft_ids(checkpoint[1]) if checkpoint else None  # read before rank 0 promotes the folder
    if checkpoint:
        console.print(f"resuming from step {checkpoint[0]} of {run_dir}")
    target, tokenizer, label = handle.load(), handle.tokenizer, handle.cache_name
    # loaded before the (long) feature extraction, so a wrong path or head fails at once
    if cfg.init:
        with assets.model_loading_errors(f"init={cfg.init}", "pass a head exported by specdec-train with this train= and target"):
            head = method.load(target, Path(cfg.init))
    else:
        head = None
    features = features_for(cfg, method, target, tokenizer, label, console, rank, world, head, resumed_ids)
    if features is None:
        return {}
    recipe = TrainRecipe(method, target, run_dir)
    torch.manual_seed(cfg.loop.seed)  # the head's initial weights: the same in every process
    prepared = recipe.setup(features, head)
    console.print(f"training on {prepared.num_sequences} sequences, {prepared.num_tokens} tokens ({cfg.features} features "
                  f"on {target.device}), {world} process(es)")
    if rank == 0:  # it describes a finished run; left beside a killed rerun, it would pass for this run's
        (run_dir / RESULTS_FILE).unlink(missing_ok=True)
    sink = make_sink(cfg.logger.name if rank == 0 else "none", run_dir, console,
                     OmegaConf.to_container(OmegaConf.structured(cfg)), cfg.logger.project, cfg.logger.mode, run_dir.name,
                     keep_until_step=checkpoint[0] if checkpoint else None)
    try:
        def log(step: int, metrics: dict[str, float]) -> None:
            console.print(f"step {step}/{cfg.loop.steps}  " + "  ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
            sink.log(metrics, step)

        recipe.train(cfg.loop, log)
        if rank != 0:
            return {}
        output = Path(cfg.output or run_dir / "head")
        tokens_per_step = features.tokens_per_step(prepared, world)
        summary = {"method": cfg.train["name"], "init": cfg.init, "steps": cfg.loop.steps, "processes": world,
                   "features": cfg.features, "train_tokens": prepared.num_tokens,
                   "train_sequences": prepared.num_sequences, "train_tokens_seen": round(cfg.loop.steps * tokens_per_step)}
        model = recipe.cleanup(output, {"training": summary})
        results = {**summary, "checkpoint": str(output), **evaluated(method, model, target, tokenizer, cfg)}
        if cfg.eval.curve:
            results["curve"] = tau_curve(method, model, target, tokenizer, cfg, run_dir, tokens_per_step, console)
            plot_curve(results["curve"], run_dir / "tau_vs_tokens.png", f"{cfg.train['name']}: tau vs training tokens (depth {cfg.eval.depth})")
        sink.log_summary(results)
    finally:
        sink.finish()
    write_atomically(run_dir / RESULTS_FILE, lambda path: path.write_text(json.dumps(results, indent=2)))
    console.print(results)
    return results


def run_schedule(cfg: TrainRunConfig, handle: TargetHandle, run_dir: Path, console: Console) -> dict[str, Any]:
    """specdec-train schedule=NAME (experiments.train.schedule): the target's own answers, then each
    method on its share of the budget, exported into output/<method>; train_results.json holds
    every method's record and every failure, rewritten after each phase."""
    started = time.monotonic()
    plan = cfg.schedule
    timed.check_methods(plan, CONFIG_DIR)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    target, tokenizer = handle.load(), handle.tokenizer
    output = Path(cfg.output or run_dir / "heads")
    results: dict[str, Any] = {"device": str(target.device), "budget_s": plan.budget_s, "methods": {}, "failed": {}}
    write_results = lambda: write_atomically(run_dir / RESULTS_FILE, lambda path: path.write_text(json.dumps(results, indent=2)))
    sequences = training_sequences(cfg, target, tokenizer, handle.key, console)
    if plan.generate_s > 0:
        try:
            pairs = answered_prompts(target, opening_prompts_for(cfg, tokenizer), cfg.data.max_length,
                                     run_dir / "own_answers.jsonl", handle.eos_token_id, cfg.data.regenerate_tokens,
                                     SamplingParams(cfg.data.regenerate_temperature), cfg.data.regenerate_batch,
                                     deadline=started + plan.generate_s)
            sequences += answered_sequences(pairs, cfg.data.max_length)
            results["own_answers"] = {"sequences": len(pairs), "answer_tokens": sum(len(answer) for _, answer in pairs)}
            console.print(f"own answers: {results['own_answers']}")
        except Exception:  # an optional phase: the heads still train on the data's own answers
            results["failed"]["own_answers"] = traceback.format_exc()
            console.print(f"own answers failed:\n{results['failed']['own_answers']}")
    data = token_sequences(sequences)
    results["train_tokens"] = len(data.tokens)
    write_results()
    for index, name in enumerate(plan.methods):
        end = timed.share_end(plan, index, started)
        console.print(f"{name}: {end - time.monotonic():.0f} s of the budget")
        try:
            results["methods"][name] = train_share(cfg, name, target, tokenizer, data, end, run_dir / name,
                                                   output / name, console)
            console.print(f"{name}: {json.dumps(results['methods'][name])}")
        except Exception:  # recorded, and the next method still gets its share of the time
            results["failed"][name] = traceback.format_exc()
            console.print(f"{name} failed:\n{results['failed'][name]}")
        write_results()
        if target.device.type == "cuda":
            torch.cuda.empty_cache()
    console.print(f"done in {time.monotonic() - started:.0f} s: {', '.join(results['methods']) or 'no method'} trained")
    return results


def train_share(cfg: TrainRunConfig, name: str, target: HFTarget, tokenizer, data, end: float, run_dir: Path,
                output: Path, console: Console) -> dict[str, Any]:
    """One method of a schedule trained by ``end`` (time.monotonic()), exported and evaluated."""
    plan = cfg.schedule
    method = build_method(timed.method_options(plan, name, 1, CONFIG_DIR))
    features = OnlineFeatures.of(method, target, data, cfg.online.batch_tokens, cfg.loop.seed, cfg.online.label_tokens, None)
    torch.manual_seed(cfg.loop.seed)  # the head's initial weights
    timing = TrainRecipe(method, target, run_dir)
    timing.setup(features)
    step_seconds = timed.step_seconds(timing.prepared, timing.loss)
    steps = max(1, int((end - time.monotonic() - plan.reserve_s) / step_seconds))
    steps = min(steps, plan.max_steps or steps)
    # the settings that follow the run's length (Domino's curriculum) are rebuilt for the planned steps
    method = build_method(timed.method_options(plan, name, steps, CONFIG_DIR))
    recipe = TrainRecipe(method, target, run_dir)
    recipe.setup(features, timing.prepared.model)
    loop = replace(cfg.loop, steps=steps, warmup_steps=min(cfg.loop.warmup_steps, steps // 10),
                   checkpoint_every=max(1, steps // 4), log_every=max(1, steps // 40))
    started = time.monotonic()

    def log(step: int, metrics: dict[str, float]) -> None:
        elapsed = max(time.monotonic() - started, 1e-9)
        console.print(f"{name} step {step}/{steps}  " + "  ".join(f"{k}={v:.4g}" for k, v in metrics.items())
                      + f"  labels/s={recipe.counted.labels / elapsed:.0f}")

    reached = recipe.train(loop, log, deadline=end - plan.reserve_s)
    seconds = time.monotonic() - started
    counted = recipe.counted
    summary = {"method": name, "steps": reached, "planned_steps": steps, "seconds": round(seconds, 1),
               "step_seconds_timed": round(step_seconds, 4), "labels_seen": counted.labels,
               "positions_seen": counted.positions, "labels_per_s": round(counted.labels / seconds),
               "epochs": round(counted.labels / max(data.num_trained(), 1), 3), "train_tokens": len(data.tokens)}
    model = recipe.cleanup(output, {"training": summary})
    return {**summary, "checkpoint": str(output), **evaluated(method, model, target, tokenizer, cfg)}


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
    target computes is not one (runs from before target.device have none), nor online.* for cached
    features. A run from before ``features`` existed trained on cached features."""
    flat = {"features": "cached", **_flatten(config)}
    return {key: value for key, value in flat.items()
            if any(key == kept or key.startswith(f"{kept}.") for kept in RESUME_KEYS) and key != "target.device"
            and (flat["features"] == "online" or not key.startswith("online."))}


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
    if {path.name for path in hydra_dir.iterdir()} <= {".hydra", f"{job_name}.log", LOCK_FILE}:
        shutil.rmtree(hydra_dir)


def check_config(cfg: DictConfig) -> None:
    """checked_settings and opened_target for the command line as a whole (experiments.cli), before
    Hydra starts."""
    with user_errors():
        settings = checked_settings(cfg)
        if settings.schedule is not None:
            timed.check_methods(settings.schedule, CONFIG_DIR)
        opened_target(settings)


def main() -> None:
    """The command line checked, then Hydra started with the run dir locked, as specdec-run does: a
    second training into a dir in use is refused in one line before Hydra writes there. Under
    torchrun process 0 holds it for all (the others train in its dir)."""
    output_dir = check_command_line("specdec-train", CONFIG_DIR, "train", check_config)
    if output_dir is None or os.environ.get("RANK", "0") != "0":  # Hydra's own flags (--help, --cfg); torchrun's others
        hydra_main()
        return
    pin_output_dir(sys.argv, output_dir)
    with exit_codes("specdec-train"):
        refuse_resuming_in_hydra_dir(sys.argv[1:], output_dir)
        with hold_lock(output_dir / LOCK_FILE, f"the run dir {output_dir}", BUSY):
            hydra_main()


def refuse_resuming_in_hydra_dir(argv: list[str], output_dir: Path) -> None:
    """resume=DIR with hydra.run.dir=DIR: Hydra would write this command's settings over the ones
    that run started with (DIR/.hydra, which the resume checks against) before the run dir's lock is
    taken a second time."""
    resume = next((arg.partition("=")[2] for arg in argv if arg.startswith("resume=")), None)
    require(resume in (None, "latest", "null") or Path(resume).resolve() != output_dir.resolve(),
            f"resume={resume} is also hydra.run.dir: a resumed run trains in its own dir, so drop hydra.run.dir "
            f"(Hydra would overwrite the settings that run started with)")


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
        resumed = run_dir != hydra_dir and os.environ.get("RANK", "0") == "0"
        with hold_lock(run_dir / LOCK_FILE, f"the run dir {run_dir}", BUSY) if resumed else contextlib.nullcontext():
            if run_dir != hydra_dir:
                remove_hydra_dir(hydra_dir, hydra_config.job.name)
            (run if settings.schedule is None else run_schedule)(settings, handle, run_dir, console)
