"""specdec-bench's job: plan the cells, check them all, run each missing one with specdec-run's
run(), then write the leaderboard; and the command line."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from hydra import compose, initialize_config_dir
from rich.console import Console

from experiments.analyze.command import analyze

from experiments.bench.leaderboard import (
    leaderboard_markdown,
    leaderboard_plots,
    leaderboard_rows,
    log_leaderboard,
    read_results,
    with_readme_figures,
)
from experiments.bench.plan import FAMILIES, FULL, QUICK, STANDARD, BenchPlan, cells
from experiments.bench.studies import studies
from experiments.cli import (
    LOCK_FILE,
    ArgumentParser,
    CommandLineError,
    SpecdecUserError,
    check_overrides,
    check_writable,
    exit_codes,
    hold_lock,
)
from experiments.common.outputs import write_file
from experiments.common.records import machine_was_busy
from experiments.run import command as run_command  # its run() looked up at each cell: tests stand in for it
from experiments.run.schema import CONFIG_DIR


# a cell whose run found the machine busy (records.machine_was_busy) runs again this many times;
# if every run was busy, the last is kept and the leaderboard flags it
BUSY_RERUNS = 1


class Runnable(Protocol):
    """One specdec-run of a bench or a study: its run dir under the output dir, and its command line."""

    @property
    def name(self) -> str: ...

    @property
    def overrides(self) -> tuple[str, ...]: ...


def cell_state(cell: Runnable, out: Path) -> str:
    """"done" (a finished run of exactly this cell), "todo" (nothing, or a killed run), or the
    overrides of another run that the cell's dir holds."""
    results = out / cell.name / "results.json"
    if not results.is_file():
        return "todo"
    recorded = read_results(results).get("overrides")
    return "done" if recorded == list(cell.overrides) else " ".join(recorded or ["(none recorded)"])


def run_cells(planned: Sequence[Runnable], out: Path, console: Console, command: str = "specdec-bench") -> list[Runnable]:
    """Run every cell whose dir under `out` holds no finished run of it; returns the cells run.
    Every cell's config is checked before the first runs, so bad input stops the bench before any
    model loads; a dir holding another run is refused rather than overwritten, and so is a bench
    dir another bench is writing into (its lock file)."""
    for cell in planned:
        try:
            check_overrides(list(cell.overrides), CONFIG_DIR, "config", run_command.check_config)
        except CommandLineError as error:
            raise SpecdecUserError(f"cell {cell.name}: {error}") from None
    with hold_lock(out / LOCK_FILE, f"the bench dir {out}", f"wait for that {command} to end, or pass another --out"):
        return _run_checked_cells(planned, out, console, command)


def _run_checked_cells(planned: Sequence[Runnable], out: Path, console: Console, command: str) -> list[Runnable]:
    for cell in planned:
        state = cell_state(cell, out)
        if state not in ("done", "todo"):
            raise SpecdecUserError(
                f"{out / cell.name} holds another run (specdec-run {state}); pass another --out, or delete that dir")
    todo = [cell for cell in planned if cell_state(cell, out) == "todo"]
    if len(todo) < len(planned):
        console.print(f"{command}: {len(planned) - len(todo)} of {len(planned)} cells already done in {out}; resuming")
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        for number, cell in enumerate(todo, 1):
            console.rule(f"{command}: cell {number} of {len(todo)}: {cell.name}")
            # the command its results.json records (provenance); not markup: [ngram] is a rival, not a style
            console.print(shlex.join(["specdec-run", *cell.overrides]), markup=False, highlight=False, soft_wrap=True)
            cfg = compose(config_name="config", overrides=list(cell.overrides))
            drafter = [o.split("=", 1)[1] for o in cell.overrides if o.startswith("drafter=")]  # the config's name
            for attempt in range(1 + BUSY_RERUNS):
                results = run_command.run(cfg, out / cell.name, console, drafter_label=drafter[-1] if drafter else None,
                              overrides=list(cell.overrides))
                if not machine_was_busy(results):
                    break
                console.print(f"{command}: the machine was busy during {cell.name}: "
                              + ("running it again" if attempt < BUSY_RERUNS else "kept, flagged in the leaderboard"),
                              soft_wrap=True)
    return todo


def write_leaderboard(inputs: list[Path], markdown: Path, command: str, console: Console, wandb_dir: Path | None = None,
                      machine: str | None = None, readme: Path | None = None) -> None:
    """The markdown file, its plots in data/<its name>/ beside it, and an offline W&B run of both in
    wandb_dir (None: none); machine labels runs that recorded none (leaderboard_rows); readme: a file
    whose generated block gets the top rows (README.md's "Which drafter is fastest")."""
    rows = leaderboard_rows(inputs, machine)
    if not rows:
        raise SpecdecUserError(f"the runs under {', '.join(map(str, inputs))} measured no drafter; nothing to rank")
    if readme is not None and not readme.is_file():
        raise SpecdecUserError(f"--readme {readme}: no such file; name the README whose figures to rewrite")
    rewritten = None if readme is None else (readme, with_readme_figures(readme.read_text(), rows, command, str(readme)))
    plot_dir = markdown.parent / "data" / markdown.stem.lower()
    pngs = leaderboard_plots(rows)
    for name, data in pngs.items():
        write_file(plot_dir / name, data)
    write_file(markdown, leaderboard_markdown(rows, inputs, command, f"data/{plot_dir.name}").encode())
    console.print(f"specdec-bench: wrote {markdown} ({len(rows)} rows) and {len(pngs)} plots in {plot_dir}")
    if rewritten is not None:
        write_file(rewritten[0], rewritten[1].encode())
        console.print(f"specdec-bench: rewrote the generated figures in {rewritten[0]}")
    if wandb_dir is not None:
        run_dir = log_leaderboard(wandb_dir, rows, {name: plot_dir / name for name in pngs})
        console.print(f"specdec-bench: offline W&B run in {run_dir} (wandb sync to upload)")


def bench_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="specdec-bench",
        description="Every drafter against plain decoding on several workload families, temperatures and answer "
                    "lengths (one specdec-run per combination), then a generated leaderboard. Rerun the same "
                    "command to resume a killed bench. `specdec-bench leaderboard DIR...` only writes the leaderboard.",
        epilog="OVERRIDE: any specdec-run override, for every cell (repeats=3, target=hf target.path=DIR, batch_size=4)",
    )
    parser.add_argument("--quick", action="store_true",
                        help=f"a first look: {', '.join(QUICK.families)}, {QUICK.prompts} prompts, "
                             f"{QUICK.lengths[0]} tokens, T=0, {', '.join(QUICK.drafters + QUICK.peers)}")
    parser.add_argument("--standard", action="store_true",
                        help=f"the grid docs/LEADERBOARD.md comes from: {', '.join(STANDARD.families)}, T=0 and 1, "
                             f"{STANDARD.lengths[0]} tokens, {', '.join(STANDARD.drafters + STANDARD.peers)}")
    parser.add_argument("--out", type=Path, help="the bench dir (default outputs/bench, outputs/bench-quick or "
                                                 "outputs/bench-standard)")
    parser.add_argument("--families", help=f"comma-separated, of {', '.join(FAMILIES)}")
    parser.add_argument("--temperatures", help="comma-separated, e.g. 0,1")
    parser.add_argument("--lengths", help="answer lengths (max_new_tokens), comma-separated, e.g. 64,256,1024")
    parser.add_argument("--drafters", help="drafter config names, comma-separated; the first is each run's drafter")
    parser.add_argument("--peers", help="transformers peers, comma-separated, or none")
    parser.add_argument("--prompts", type=int, help="prompts per family (default: each family's own)")
    parser.add_argument("--question-file", type=Path, help="a Spec-Bench question.jsonl: adds the specbench family")
    parser.add_argument("--wandb", action="store_true", help="also log the leaderboard to an offline W&B run in OUT/wandb")
    parser.add_argument("overrides", nargs="*", metavar="OVERRIDE")
    return parser


def leaderboard_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="specdec-bench leaderboard",
                                     description="Turn bench (or specdec-run) run dirs into a leaderboard.")
    parser.add_argument("inputs", nargs="+", type=Path, metavar="DIR", help="a bench dir or run dir")
    parser.add_argument("--out", type=Path, default=Path("docs/LEADERBOARD.md"), help="the markdown file to write")
    parser.add_argument("--wandb", action="store_true",
                        help="also log it to an offline W&B run in outputs/leaderboard-wandb (wandb sync to upload)")
    parser.add_argument("--machine", help="the machine of runs whose results.json records none (made before "
                                          "runs recorded their provenance); default: a table of their own")
    parser.add_argument("--readme", type=Path, help="also rewrite this file's generated block with the top rows "
                                                     "(README.md: tests/test_readme_figures.py checks it)")
    return parser


def studies_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="specdec-bench studies",
        description="The research questions of docs/RESULTS.md, one specdec-run per point (experiments/bench/studies.py), "
                    "then a specdec-analyze report per study in OUT/reports. Rerun the same command to resume.",
        epilog="OVERRIDE: any specdec-run override, for every run (threads=2)",
    )
    parser.add_argument("--only", help=f"comma-separated, of {', '.join(studies(Path('.')))}")
    parser.add_argument("--out", type=Path, default=Path("outputs/studies"), help="the studies dir")
    parser.add_argument("overrides", nargs="*", metavar="OVERRIDE")
    return parser


def run_studies(args: argparse.Namespace, console: Console) -> None:
    """Every run of the chosen studies, then the report of each study whose runs are all done."""
    known = studies(args.out, tuple(args.overrides))
    names = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else list(known)
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise SpecdecUserError(f"--only {args.only!r}: choose from {', '.join(known)}")
    chosen = [known[n] for n in known if n in names]
    run_cells([run for study in chosen for run in study.runs], args.out, console, "specdec-bench studies")
    for study in chosen:
        written = analyze([args.out / run.name for run in study.runs], args.out / "reports" / study.name)
        console.print(f"specdec-bench studies: {study.question}: {written.report}")


def plan_from(args: argparse.Namespace) -> BenchPlan:
    if args.quick and args.standard:
        raise SpecdecUserError("--quick and --standard are two different grids; choose one")
    base = QUICK if args.quick else STANDARD if args.standard else FULL

    def listed(text: str | None, default: tuple, kind=str) -> tuple:
        if text is None:
            return default
        items = tuple(item.strip() for item in text.split(",") if item.strip())
        if items == ("none",):
            return ()
        try:
            return tuple(kind(item) for item in items)
        except ValueError:
            raise SpecdecUserError(f"cannot read {text!r} as a comma-separated list of numbers") from None

    families = listed(args.families, base.families)
    reading_file = tuple(name for name, family in FAMILIES.items() if family.question_file)
    if args.question_file is not None:
        families = tuple(f for f in families if f not in reading_file) + reading_file
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise SpecdecUserError(f"unknown family {unknown[0]!r}; choose from {', '.join(FAMILIES)}")
    needing = next((f for f in families if f in reading_file), None)
    if needing is not None and args.question_file is None:
        raise SpecdecUserError(f"the {needing} family reads a Spec-Bench question file: add --question-file FILE")
    drafters = listed(args.drafters, base.drafters)
    if not drafters:
        raise SpecdecUserError("--drafters names no drafter; name at least one drafter config")
    plan = BenchPlan(
        families=families,
        temperatures=listed(args.temperatures, base.temperatures, float),
        lengths=listed(args.lengths, base.lengths, int),
        drafters=drafters,
        peers=listed(args.peers, base.peers),
        prompts=args.prompts if args.prompts is not None else base.prompts,
        question_file=str(args.question_file) if args.question_file is not None else None,
        overrides=(*base.overrides, *args.overrides),
        family_prompts=base.family_prompts,
    )
    if not plan.temperatures or not plan.lengths:
        raise SpecdecUserError("--temperatures and --lengths each need at least one value")
    if plan.prompts is not None and plan.prompts < 1:
        raise SpecdecUserError(f"--prompts must be >= 1; got {plan.prompts}")
    return plan


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    console = Console()
    command = "specdec-bench " + " ".join(shlex.quote(a) for a in argv)
    with exit_codes("specdec-bench", (SpecdecUserError, ValueError), "interrupted; rerun the same command to continue"):
        if argv[:1] == ["leaderboard"]:
            args = leaderboard_parser().parse_args(argv[1:])
            check_writable(args.out, "--out")
            wandb_dir = Path("outputs/leaderboard-wandb") if args.wandb else None
            write_leaderboard(args.inputs, args.out, command, console, wandb_dir, args.machine, args.readme)
            return
        if argv[:1] == ["studies"]:
            run_studies(studies_parser().parse_intermixed_args(argv[1:]), console)
            return
        args = bench_parser().parse_intermixed_args(argv)
        plan = plan_from(args)
        out = args.out or Path("outputs/bench-quick" if args.quick else "outputs/bench-standard" if args.standard else "outputs/bench")
        run_cells(cells(plan), out, console)
        write_leaderboard([out], out / "LEADERBOARD.md", command, console, out / "wandb" if args.wandb else None)
