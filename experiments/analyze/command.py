"""The specdec-analyze command: ``analyze()`` reads the runs and writes the report, ``main()`` is its
command line."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

from experiments.analyze.errors import AnalyzeError
from experiments.analyze.discover import find_runs
from experiments.analyze.findings import analyze_run, label_runs
from experiments.analyze.report import log_to_wandb, make_plots, report_markdown
from experiments.common.outputs import write_file


@dataclass(frozen=True)
class Written:
    out: Path
    report: Path
    plots: list[Path]
    wandb_dir: str | None  # the offline W&B run written, if any


def analyze(inputs: list[Path], out: Path | None = None, wandb: bool | None = None) -> Written:
    """Analyse the runs under `inputs` into `out` (default: the one input). wandb: log to a new
    offline W&B run; None = when a W&B run is among the inputs and wandb is importable."""
    if out is None and len(inputs) != 1:
        raise AnalyzeError(f"{len(inputs)} inputs given; say where the report goes with --out DIR")
    runs = find_runs(inputs)
    if out is None:  # a W&B run inside a run dir reports into that run dir
        out = runs[0].path if len(runs) == 1 and runs[0].from_wandb else inputs[0]
    analyses = [analyze_run(run, label) for run, label in zip(runs, label_runs(runs))]
    pngs = make_plots(analyses, runs)
    out.mkdir(parents=True, exist_ok=True)
    for name, data in pngs.items():
        write_file(out / name, data)
    report = out / "report.md"
    write_file(report, report_markdown(analyses, pngs, inputs).encode())
    wandb_dir = None
    if wandb is None:
        wandb = any(run.from_wandb for run in runs) and _wandb_importable()
    if wandb:
        if not _wandb_importable():
            raise AnalyzeError("--wandb needs the wandb package: pip install wandb (it logs offline, no account)")
        wandb_dir = log_to_wandb(out, analyses, pngs, inputs)
    return Written(out, report, [out / name for name in pngs], wandb_dir)


def _wandb_importable() -> bool:
    return importlib.util.find_spec("wandb") is not None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="specdec-analyze",
        description="Acceptance analysis of specdec-run outputs: report.md + PNG plots (offline).",
    )
    parser.add_argument("inputs", nargs="+", type=Path, metavar="RUN_DIR",
                        help="a specdec-run run dir, a Hydra multirun sweep dir, or a W&B offline run dir")
    parser.add_argument("--out", type=Path, help="where report.md and the plots go (default: the one RUN_DIR)")
    parser.add_argument("--wandb", action=argparse.BooleanOptionalAction, default=None,
                        help="also log tables and plots to a new offline W&B run in --out "
                             "(default: when a W&B run is given)")
    args = parser.parse_args(argv)
    try:
        written = analyze(args.inputs, args.out, args.wandb)
    except AnalyzeError as error:
        print(f"specdec-analyze: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"specdec-analyze: wrote {written.report} and {len(written.plots)} plots to {written.out}")
    if written.wandb_dir:
        print(f"specdec-analyze: offline W&B run in {written.wandb_dir} (wandb sync to upload)")
