"""specdec-bench: every drafter against plain decoding, on several workload families, temperatures
and answer lengths, then a generated leaderboard.

    specdec-bench --quick                       # a first look in minutes: outputs/bench-quick/LEADERBOARD.md
    specdec-bench                               # the full bench (resumable): outputs/bench/
    specdec-bench --families mtbench --temperatures 0 --lengths 256 --drafters union,eagle3 repeats=3
    specdec-bench leaderboard outputs/bench --out docs/LEADERBOARD.md --wandb
    specdec-bench studies --out outputs/studies threads=2    # the research questions (studies.py)

A cell is one family at one temperature and answer length: one specdec-run (experiments/run) whose
drafter is the first of --drafters and whose rivals are the others and the transformers peers, so
every side is paired with the same plain decoding, warmed, interleaved and repeated, with
intervals, exactly as specdec-run measures. Each cell writes its run dir, <out>/<family>/T<t>-<n>tok;
a cell whose dir holds its finished run is skipped, so rerunning a killed bench continues where it
stopped (the cell that was running starts again). The leaderboard is written from the run dirs
alone (leaderboard.py).

    plan.py         families, the default drafters and peers, the full and quick plans, the cells
    studies.py      the research questions of docs/RESULTS.md, each a list of specdec-runs
    command.py      checking and running the cells, the leaderboard files, the command line
    leaderboard.py  rows from results.json, the markdown tables, plots and the W&B run
"""

from experiments.bench.command import main

__all__ = ["main"]
