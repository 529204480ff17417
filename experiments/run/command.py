"""specdec-run's job: check, build, measure, summarize, write (the modules beside this one, in that
order), and the Hydra entry point."""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from drafters.quantize import quantize_drafter
from experiments.cli import (
    LOCK_FILE,
    SWEEP_FLAGS,
    USAGE_ERROR,
    SpecdecUserError,
    check_command_line,
    exit_codes,
    hold_lock,
    pin_output_dir,
    user_errors,
)
from experiments.common import records
from experiments.common.records import BASELINE, SPECULATIVE
from experiments.common.outputs import clear_previous_run, write_outputs
from experiments.common.sinks import make_sink
from experiments.run.baseline_check import GENERATE, check_baseline, headline
from experiments.run.budget import choose_budget
from experiments.run.build import (
    build_drafter,
    decoder_sides,
    busy_share,
    load_pieces,
    make_sampling,
    make_verifier,
    peer_sides,
    stock_model,
)
from experiments.run.machine_load import MIN_JUDGED_S
from experiments.run.measure import measure
from experiments.run.provenance import provenance
from experiments.run.rivals import peer_options, rival_options
from experiments.run.schema import CONFIG_DIR, checked_settings
from experiments.run.summary import (
    comparison,
    prompt_rows,
    results_table,
    rivals_table,
    step_rows,
    summarize,
    unit_metrics,
    unit_rows,
    wandb_summary,
    wandb_tables,
)
from specdec.target_loader import target_device
from verifiers.base import UnverifiableTreeError


def run(
    cfg: DictConfig,
    run_dir: Path,
    console: Console | None = None,
    drafter_label: str | None = None,
    overrides: list[str] | None = None,
    run_name: str | None = None,
    group: str | None = None,
) -> dict[str, Any]:
    """One measurement into run_dir; returns what went into results.json. drafter_label names the
    drafter in results and tables (specdec-run passes its drafter config's name, as rivals are
    named; None = the drafter factory's name); overrides (Hydra's, as .hydra/overrides.yaml holds
    them) are recorded so that specdec-analyze can tell the records from another run's config.
    run_name and group name the run for the logger (W&B; run_name None = the run dir's name).

    A previous run's outputs in run_dir are removed once the input is checked. Raises SpecdecUserError for bad input,
    before any model loads where that can be known earlier.
    """
    console = console or Console()
    settings = checked_settings(cfg)
    config = OmegaConf.to_container(cfg, resolve=True)
    pieces = load_pieces(settings, config, console)
    # after the checks of the input, so that a refused rerun leaves the previous run whole
    cleared = clear_previous_run(run_dir) if run_dir.is_dir() else []
    if cleared:
        console.print(f"specdec-run: {run_dir} held a previous run; removed its {', '.join(cleared)}")
    drafter_options, budget = settings.drafter, {"mode": "fixed"}
    if settings.budget.mode == "auto":
        drafter_options, budget = choose_budget(pieces)
    drafter = build_drafter(drafter_options, pieces.target)
    with user_errors():
        quant = quantize_drafter(drafter, pieces.target, settings.drafter_quant) if drafter else None
    rival_configs = rival_options(settings.rivals, cfg)
    rivals = {label: build_drafter(options, pieces.target) for label, options in rival_configs.items()}
    peers = peer_options(settings.rivals)
    sides = decoder_sides(pieces, drafter, rivals)
    check, stock = None, None
    if (settings.baseline_check_tokens and settings.batch_size == 1 and pieces.target.kind == "model"
            and GENERATE not in {name for name, _ in peers.values()}):
        stock = stock_model(pieces)
        with console.status("timing our plain decoding against transformers' generate()"):
            check = check_baseline(pieces.requests, sides[BASELINE], peer_sides(pieces, {GENERATE: (GENERATE, {})}, stock)[GENERATE],
                                   pieces.plan(), settings.baseline_check_tokens)
        if check["ours_slower"]:  # generate() joins the timed passes, and the headline is against it
            peers[GENERATE] = (GENERATE, {})
    sides.update(peer_sides(pieces, peers, stock))
    logger = settings.logger
    with user_errors():
        sink = make_sink(logger.name, run_dir, console, config, logger.project, logger.mode, run_name or run_dir.name,
                         group=group)
    try:
        units = measure(pieces.requests, sides, pieces.plan(), console,
                        lambda step, unit: sink.log(unit_metrics(unit, pieces.sampling), step=step))
        label = drafter_label or settings.drafter.get("name") or "none"
        results = {**summarize(units, SPECULATIVE, pieces, label), "budget": budget, "config": config,
                   "contention": {**records.contention(unit_rows(units), busy_share(), MIN_JUDGED_S),
                                  "at_start": pieces.watch}}
        if check is not None:
            results["baseline_check"] = check
        if overrides is not None:
            results["overrides"] = overrides
        results["provenance"] = provenance("specdec-run", overrides or [], pieces.target.device)
        if pieces.target.kind == "model":  # a HeadTarget: the kernels the run's forwards took (auto: timed when loaded)
            results["packed_gemm_from"] = pieces.target.packed_gemm_from
        if quant is not None:
            results["drafter_quant"] = asdict(quant)
        if drafter is not None and drafter.report:  # what a drafter measured or decided when built
            results["drafter_report"] = dict(drafter.report)
        if rivals:  # each against the same baseline calls; the run's config is in the main results
            results["rivals"] = [
                {**summarize(units, label, pieces, label), **comparison(units, label, settings.seed),
                 "config": rival_configs[label], **({"drafter_report": dict(rival.report)} if rival.report else {})}
                for label, rival in rivals.items()
            ]
        if peers:
            results["peers"] = [
                {**summarize(units, label, pieces, label), **comparison(units, label, settings.seed),
                 "config": {"peer": name, **options}}
                for label, (name, options) in peers.items()
            ]
        results["headline"] = headline(results, unit_rows(units), settings.seed)
        prompts = prompt_rows(units, pieces.sampling, pieces.handle.tokenizer)
        write_outputs(run_dir, results, prompts, step_rows(units), unit_rows(units))
        sink.log_summary(wandb_summary(results), wandb_tables(results, prompts))
    finally:
        sink.finish()
    console.print(results_table(results, run_dir))
    if results.get("rivals") or results.get("peers"):
        console.print(rivals_table(results))
    return results


def check_config(cfg: DictConfig) -> None:
    """What run() checks before loading anything, for the command line as a whole (experiments.cli)."""
    with user_errors():
        settings = checked_settings(cfg)
        make_sampling(settings.sampling)
        make_verifier(settings.verifier, target_device(settings.target))


def main() -> None:
    """The command line checked, then Hydra started with the run dir (sweep dir with -m) locked: a
    second specdec-run into a dir in use is refused before Hydra writes anything there. A run
    refused once Hydra has started takes back what Hydra wrote (undo_refused_start)."""
    output_dir = check_command_line("specdec-run", CONFIG_DIR, "config", check_config)
    if output_dir is None:  # Hydra's flags (--help, --cfg), or a dir only a job can name
        hydra_main()
        return
    pin_output_dir(sys.argv, output_dir)
    sweep = any(arg in SWEEP_FLAGS for arg in sys.argv[1:])
    with exit_codes("specdec-run"), hold_lock(output_dir / LOCK_FILE, f"the run dir {output_dir}",
                                              "wait for that run to end, or choose another hydra.run.dir"):
        with contextlib.nullcontext() if sweep else undo_refused_start(output_dir):
            hydra_main()


@contextlib.contextmanager
def undo_refused_start(run_dir: Path) -> Iterator[None]:
    """On a refusal (exit status 2) after Hydra started: a dir this run made is removed; in a dir
    that held a run, Hydra's .hydra/ files and log are put back as they were, so the previous run
    stays whole (run() clears its outputs only once the input is checked)."""
    made = not any(path.name != LOCK_FILE for path in run_dir.iterdir())
    hydra_files = {path: path.read_bytes() for path in sorted((run_dir / ".hydra").glob("*")) if path.is_file()}
    logs = {path: path.stat().st_size for path in run_dir.glob("*.log")}
    try:
        yield
    except SystemExit as refusal:
        if refusal.code == USAGE_ERROR and made:
            shutil.rmtree(run_dir, ignore_errors=True)
        elif refusal.code == USAGE_ERROR:
            for path in (run_dir / ".hydra").glob("*"):
                if path not in hydra_files and path.is_file():
                    path.unlink()
            for path, data in hydra_files.items():
                path.write_bytes(data)
            for path in run_dir.glob("*.log"):
                os.truncate(path, logs[path]) if path in logs else path.unlink()
        raise


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="config")
def hydra_main(cfg: DictConfig) -> None:
    with exit_codes("specdec-run", (SpecdecUserError, UnverifiableTreeError)):
        hydra_config = HydraConfig.get()
        choice = hydra_config.runtime.choices.get("drafter")  # union_retrieval, where the factory says union
        # W&B names each run by its overrides and groups the runs of one sweep, so its UI compares them
        sweep = hydra_config.mode == RunMode.MULTIRUN
        run(cfg, Path(hydra_config.runtime.output_dir), drafter_label=choice if cfg.drafter.get("name") else None,
            overrides=list(hydra_config.overrides.task), run_name=hydra_config.job.override_dirname or None,
            group=str(hydra_config.sweep.dir) if sweep else None)
