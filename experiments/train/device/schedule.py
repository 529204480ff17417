"""Train drafter heads on a time budget, the target's features computed as training runs (no Hydra).

    python3 -m experiments.train.device.schedule --staged .gpu --out "$OUT" --budget 480   # what scripts/gpu_train.sh runs

The one command of a lent GPU call (scripts/gpu_train.sh); it runs on a CPU as well, which the tests
use with a tiny target. It reassembles what experiments.train.device.stage staged (the target and the
tokenised conversations), then within ``--budget`` seconds of its start:

1. optionally lets the target answer staged opening prompts itself for ``--generate-seconds``
   (greedy, through the project's own decode loop), adding those answers to the training data;
2. trains each of ``--methods`` in turn (by default EAGLE-3, then MTP, then Domino) through the
   training recipe (experiments.train.recipe, features=online, as specdec-train features=online), on batches of about ``--batch-tokens`` tokens
   whose target features drafters.training.online computes with one target forward per batch. A
   feature cache for this many tokens would not fit the machine's disk (several [T, 576] layers in
   16 bits per token), and the target's forward costs no more than the head's step, so there is no
   cache. Each method gets ``--shares`` of the time left when it starts (time one leaves unused
   goes to the next); a few timed steps decide its number of steps, so its learning-rate schedule
   ends when its time does, and the trainer's deadline stops it cleanly (a complete checkpoint,
   written atomically) should the estimate be off;
3. exports each head as soon as it is trained, in float16 as specdec-train does (OUT/<method>/
   config.json + model.safetensors, loadable with drafter=<method> drafter.checkpoint=DIR), then
   measures its teacher-forced accuracy on the held-out conversations with its own loss's metrics
   (accuracy_j: depth j + 1, the later depths fed the head's own outputs as when it drafts);
4. keeps OUT/results.json up to date after every phase: the data, each method's steps, labelled
   tokens per second, epochs and held-out accuracy, and any phase that failed (a failure in one
   phase is recorded and the next still runs: the device time is spent either way).

bf16 autocast on CUDA (the heads' weights stay float32, the target runs in bfloat16); float32 on a CPU.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

CONFIG_DIR = Path(__file__).resolve().parents[3] / "configs" / "train"
METHODS = ("eagle3", "mtp", "domino")
STEPS_PLACEHOLDER = "${loop.steps}"  # configs/train/*.yaml values that follow the run's length (Domino's curriculum)


def method_options(name: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """configs/train/<name>.yaml as specdec-train reads it (a `train:` section for global-package
    files), with ``overrides`` on top; values that follow loop.steps stay placeholders (resolve_steps)."""
    import yaml

    path = CONFIG_DIR / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
        raise ValueError(f"--methods: no configs/train/{name}.yaml; known methods: {known}")
    options = yaml.safe_load(path.read_text())
    options = dict(options.get("train", options))
    return {**options, **overrides}


def resolve_steps(options: dict[str, Any], steps: int) -> dict[str, Any]:
    return {key: steps if value == STEPS_PLACEHOLDER else value for key, value in options.items()}


def parse_overrides(pairs: list[str], methods: list[str]) -> dict[str, dict[str, Any]]:
    """--set METHOD.KEY=VALUE (VALUE in YAML: 3, 0.5, [1, 2]) -> {method: {key: value}}."""
    import yaml

    overrides: dict[str, dict[str, Any]] = {name: {} for name in methods}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        method, dot, option = key.partition(".")
        if not sep or not dot or method not in overrides:
            raise ValueError(f"--set {pair}: expected METHOD.KEY=VALUE with METHOD one of {', '.join(methods)}")
        overrides[method][option] = yaml.safe_load(value)
    return overrides


def load_target(target_dir: Path, name: str, device):
    """The staged model as an HFTarget, loaded as specdec-train's target=hf loads one: bfloat16 on a
    GPU (features and labels for training), float32 on a CPU."""
    from specdec.target_loader import TargetConfig, load_hf_target

    dtype = "bfloat16" if device.type == "cuda" else "float32"
    cfg = TargetConfig(name="hf", path=str(target_dir), device=str(device), dtype=dtype)
    target = load_hf_target(target_dir, f"--staged {target_dir.parent}", cfg)
    target.model.config._name_or_path = name  # checkpoints name the target it came from, not this machine's folder
    return target


def own_answers(target, prompts: list[list[int]], eos_token_id: int | None, seconds: float, batch: int,
                max_new_tokens: int):
    """The target's greedy answers to ``prompts``, one wave of ``batch`` requests at a time until
    ``seconds`` pass: prompt + answer sequences with the answer's tokens trained on."""
    import torch

    from drafters.training.online import TokenSequences
    from specdec.decode import SpecDecoder
    from specdec.sampling import SamplingParams
    from verifiers.reference import verify

    decoder = SpecDecoder(target, None, verify)
    end = time.monotonic() + seconds
    parts = []
    for first in range(0, len(prompts), batch):
        if time.monotonic() >= end:
            break
        wave = prompts[first : first + batch]
        answers = decoder.generate(wave, max_new_tokens, SamplingParams(0.0), eos_token_id=eos_token_id,
                                   max_batch=batch).outputs
        for prompt, answer in zip(wave, answers):
            tokens = torch.tensor(prompt + answer, dtype=torch.int64)
            trained = torch.cat([torch.zeros(len(prompt), dtype=torch.bool), torch.ones(len(answer), dtype=torch.bool)])
            parts.append(TokenSequences(tokens, torch.tensor([0, len(tokens)]), trained))
    return TokenSequences.concatenate(parts) if parts else None


def timed_step_seconds(prepared, loss_fn, steps: int = 2) -> float:
    """Seconds per training step (the target's forward, the loss, backward), from ``steps`` steps
    after a first that warms the kernels up; gradients are dropped, nothing is updated."""
    import torch

    device = next(prepared.model.parameters()).device
    batches = prepared.batches(0)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        loss, _ = loss_fn(next(batches))
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    prepared.model.zero_grad(set_to_none=True)
    return sum(times[1:]) / steps


def held_out_accuracy(held_out, loss_fn, num_batches: int) -> dict[str, float]:
    """Each metric of a method's loss over ``num_batches`` held-out batches (each of its batches
    once), weighted by their labelled tokens."""
    import torch

    totals: dict[str, float] = {}
    weight = 0
    with torch.no_grad():
        for batch, _ in zip(held_out.batches(0), range(num_batches)):
            labelled = int(batch.valid.sum())
            _, metrics = loss_fn(batch)
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + value * labelled
            weight += labelled
    return {key: value / max(weight, 1) for key, value in totals.items()} | {"labelled_tokens": weight}


def write_results(out: Path, results: dict[str, Any]) -> None:
    from specdec.files import write_atomically

    write_atomically(out / "results.json", lambda path: path.write_text(json.dumps(results, indent=2)))


def train_method(name: str, options: dict[str, Any], target, train_data, held_out_data, draft_ids, args, end: float,
                 run_dir: Path, out: Path, log) -> dict[str, Any]:
    """Train, export and evaluate one method by ``end`` (time.monotonic()); returns its record for results.json."""
    import torch

    from drafters.training.methods import build_method
    from drafters.training.online import OnlineData
    from drafters.training.trainer import TrainConfig
    from experiments.train.recipe import OnlineFeatures, TrainRecipe

    method = build_method(resolve_steps(options, 1))
    layers = method.feature_layers(target)
    features = OnlineFeatures(OnlineData(target, train_data, layers, args.batch_tokens, args.seed), draft_ids)
    shutil.rmtree(run_dir, ignore_errors=True)  # a run of this call: no resuming another call's state
    torch.manual_seed(args.seed)  # the head's initial weights
    timing = TrainRecipe(method, target, run_dir)
    timing.setup(features)
    step_seconds = timed_step_seconds(timing.prepared, timing.loss)
    planned = max(1, int((end - time.monotonic() - args.reserve) / step_seconds))
    steps = min(planned, args.max_steps) if args.max_steps else planned
    # the settings that follow the run's length (Domino's curriculum) are rebuilt for the planned steps
    method = build_method(resolve_steps(options, steps))
    recipe = TrainRecipe(method, target, run_dir)
    recipe.setup(features, timing.prepared.model)
    config = TrainConfig(steps=steps, lr=args.lr, warmup_steps=min(30, max(1, steps // 10)),
                         checkpoint_every=max(1, steps // 4), log_every=max(1, steps // 40), seed=args.seed)
    counted = recipe.counted
    started = time.monotonic()

    def log_step(step: int, metrics: dict[str, float]) -> None:
        elapsed = max(time.monotonic() - started, 1e-9)
        shown = {k: v for k, v in metrics.items() if k in ("loss", "ce_0", "accuracy_0", "accuracy_1", "ce_refined",
                                                             "block_accuracy", "grad_norm", "lr")}
        log(f"{name} step {step}/{steps}  " + "  ".join(f"{k}={v:.4g}" for k, v in shown.items())
            + f"  labels/s={counted.labels / elapsed:.0f}  positions/s={counted.positions / elapsed:.0f}")

    reached = recipe.train(config, log_step, deadline=end - args.reserve)
    seconds_trained = time.monotonic() - started
    per_epoch = train_data.num_trained()
    summary = {"method": name, "steps": reached, "planned_steps": steps, "seconds": round(seconds_trained, 1),
               "step_seconds_timed": round(step_seconds, 4), "labels_seen": counted.labels,
               "positions_seen": counted.positions, "labels_per_s": round(counted.labels / seconds_trained),
               "positions_per_s": round(counted.positions / seconds_trained),
               "epochs": round(counted.labels / max(per_epoch, 1), 3), "train_tokens": features.data.num_tokens(),
               "train_sequences": len(train_data), "batch_tokens": args.batch_tokens, "device": str(target.device)}
    model = recipe.cleanup(out / name, {"training": {**summary, "trainer": "experiments/train/device/schedule.py"}})
    held_out = OnlineFeatures(OnlineData(target, held_out_data, layers, args.batch_tokens, args.seed), draft_ids)
    evaluation = TrainRecipe(method, target, run_dir)
    evaluation.setup(held_out, model)
    accuracy = held_out_accuracy(evaluation.prepared, evaluation.loss, len(held_out.data.groups))
    return {**summary, "checkpoint": str(out / name), "held_out": accuracy}


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    parser = argparse.ArgumentParser(prog="python3 -m experiments.train.device.schedule", description=__doc__.split("\n\n")[0])
    parser.add_argument("--staged", type=Path, default=Path(".gpu"), help="what experiments.train.device.stage staged")
    parser.add_argument("--out", type=Path, required=True, help="checkpoints and results.json go here")
    parser.add_argument("--budget", type=float, default=480, help="seconds from start to the last export")
    parser.add_argument("--methods", default=",".join(METHODS), help="trained in this order")
    parser.add_argument("--shares", default="0.7,0.15,0.15", help="each method's share of the time left when it starts")
    parser.add_argument("--batch-tokens", type=int, default=65536, help="padded tokens per batch (about)")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reserve", type=float, default=15, help="seconds each method keeps for its export and evaluation")
    parser.add_argument("--max-steps", type=int, default=0, help="cap each method's steps (0: as many as its time allows)")
    parser.add_argument("--label-tokens", type=int, default=2_000_000, help="labels counted to pick the draft vocabulary")
    parser.add_argument("--generate-seconds", type=float, default=60, help="time for the target's own answers (0: none)")
    parser.add_argument("--generate-batch", type=int, default=256, help="requests decoded together")
    parser.add_argument("--generate-tokens", type=int, default=256, help="the longest own answer")
    parser.add_argument("--device", default="auto", help="auto (cuda if there is one), cuda or cpu")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="METHOD.KEY=VALUE",
                        help="a training setting on top of configs/train/METHOD.yaml, e.g. eagle3.unroll=2")
    args = parser.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    shares = [float(x) for x in args.shares.split(",")]
    for name, value, least in [("--budget", args.budget, 1), ("--batch-tokens", args.batch_tokens, 1),
                               ("--generate-batch", args.generate_batch, 1), ("--generate-tokens", args.generate_tokens, 1),
                               ("--label-tokens", args.label_tokens, 1), ("--reserve", args.reserve, 0),
                               ("--max-steps", args.max_steps, 0), ("--generate-seconds", args.generate_seconds, 0)]:
        if not value >= least:
            parser.error(f"{name} must be >= {least}; got {value}")
    if len(shares) != len(methods) or min(shares) <= 0:
        parser.error(f"--shares needs one positive share per method ({len(methods)}); got {args.shares}")
    try:
        overrides = parse_overrides(args.overrides, methods)
        options = {name: method_options(name, overrides[name]) for name in methods}
        from drafters.training.methods import build_method, check_feature_source

        for name in methods:  # a wrong setting fails here, before the minutes of loading and training
            check_feature_source(build_method(resolve_steps(options[name], 1)).name, "online")
    except ValueError as error:
        parser.error(str(error))

    import torch

    from drafters.training.online import OnlineData, TokenSequences, choice_vocabulary
    from experiments.train.device.stage import MANIFEST, PAYLOAD, assemble, read_data

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    args.out.mkdir(parents=True, exist_ok=True)

    def log(line: str) -> None:
        print(f"[{time.monotonic() - started:7.1f}s] {line}", flush=True)

    target_dir = assemble(args.staged)
    manifest = json.loads((args.staged / MANIFEST).read_text())
    data = read_data(args.staged / PAYLOAD / "data.npz")
    target = load_target(target_dir, manifest["model"], device)
    log(f"target {manifest['model']} on {device} ({target.dtype}); data {manifest['data']}")
    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                               "torch": torch.__version__, "budget_s": args.budget, "data": manifest["data"],
                               "methods": {}, "failed": {}}
    train_data = data["train"]
    if args.generate_seconds > 0 and data["prompts"]:
        try:
            answers = own_answers(target, data["prompts"], manifest["eos_token_id"], args.generate_seconds,
                                  args.generate_batch, args.generate_tokens)
            if answers is not None:
                train_data = TokenSequences.concatenate([train_data, answers])
                results["own_answers"] = {"sequences": len(answers), "answer_tokens": int(answers.trained.sum())}
                log(f"own answers: {results['own_answers']}")
        except Exception:  # an optional phase: the heads still train on ShareGPT's answers
            results["failed"]["own_answers"] = traceback.format_exc()
            log(f"own answers failed:\n{results['failed']['own_answers']}")
    results["train_labels_per_epoch"] = train_data.num_trained()
    write_results(args.out, results)

    vocabularies: dict[int, Any] = {}
    for index, name in enumerate(methods):
        left = started + args.budget - time.monotonic()
        end = time.monotonic() + left * shares[index] / sum(shares[index:])
        log(f"{name}: {end - time.monotonic():.0f} s of the {left:.0f} s left")
        try:
            size = build_method(resolve_steps(options[name], 1)).draft_vocab_size(target)
            if size not in vocabularies:  # one vocabulary for every head of the same size: counted once
                probe = OnlineData(target, train_data, (target.num_layers + 1,), args.batch_tokens, args.seed)
                vocabularies[size] = choice_vocabulary(probe, size, args.label_tokens)
            results["methods"][name] = train_method(name, options[name], target, train_data, data["held_out"],
                                                    vocabularies[size], args, end, args.staged / "runs" / name, args.out, log)
            log(f"{name}: {json.dumps(results['methods'][name])}")
        except Exception:  # recorded, and the next method still gets its share of the device time
            results["failed"][name] = traceback.format_exc()
            log(f"{name} failed:\n{results['failed'][name]}")
        write_results(args.out, results)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    log(f"done in {time.monotonic() - started:.0f} s: {', '.join(results['methods']) or 'no method'} trained")
    return 1 if results["failed"] and not results["methods"] else 0


if __name__ == "__main__":
    sys.exit(main())
