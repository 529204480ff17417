"""What a run writes into its run dir. Each file is written under a temporary name and renamed
(specdec.files.write_atomically), results.json last, so an interrupted run leaves complete files
or none, and a results.json on disk means the whole run finished."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from experiments.common import plots
from specdec.files import write_atomically


def write_file(path: Path, data: bytes) -> None:
    """The file is always absent or complete (specdec.files.write_atomically)."""
    write_atomically(path, lambda staged: staged.write_bytes(data))


def jsonl_bytes(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


# What a run and its analysis write into a run dir (specdec-analyze adds report.md and its PNGs);
# Hydra's own .hydra/ and log file belong to the run now starting and stay.
RUN_OUTPUTS = (
    "results.json", "prompts.jsonl", "steps.jsonl", "units.jsonl", "metrics.jsonl", "report.md", "wandb", "analysis-wandb",
)


def clear_previous_run(run_dir: Path) -> list[str]:
    """Remove a previous run's outputs from run_dir (a rerun into the same dir), so that the dir never
    holds one run's records beside another's config; returns what was removed."""
    found = [run_dir / name for name in RUN_OUTPUTS if (run_dir / name).exists()]
    found += sorted(run_dir.glob("*.png")) + sorted(run_dir.glob(".*.tmp"))
    for path in found:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return [path.name for path in found]


def write_outputs(run_dir: Path, results: dict, prompts: list[dict], steps: list[dict], units: list[dict]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    title = f"{results['drafter']} on {results['target']}, {results['workload']} (T={results['temperature']:g})"
    write_file(run_dir / "steps.jsonl", jsonl_bytes(steps))
    write_file(run_dir / "prompts.jsonl", jsonl_bytes(prompts))
    write_file(run_dir / "units.jsonl", jsonl_bytes(units))
    alpha, attempts = results["per_depth_alpha"], results["per_depth_attempts"]
    write_file(
        run_dir / "per_depth_alpha.png", plots.per_depth_alpha_png(alpha, attempts, f"Acceptance per depth\n{title}")
    )
    write_file(
        run_dir / "tau_per_prompt.png",
        plots.tau_histogram_png([p["tau"] for p in prompts], results["tau"], f"tau per prompt\n{title}"),
    )
    # last, so that a results.json on disk means the whole run finished
    write_file(run_dir / "results.json", (json.dumps(results, indent=2) + "\n").encode())
