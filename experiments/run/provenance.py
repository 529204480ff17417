"""Where, when and how a run was made, recorded in results.json (``provenance``), so that every figure
carries its machine, date, code and command (docs/RESULTS.md, "Evidence standard") and the
leaderboard can keep machines apart: timings from two machines do not compare."""

from __future__ import annotations

import datetime
import platform
import shlex
import subprocess
from pathlib import Path
from typing import Any

import torch
import transformers

from experiments.run.build import available_cores

REPO = Path(__file__).resolve().parents[2]


def provenance(program: str, overrides: list[str], device: torch.device) -> dict[str, Any]:
    return {
        "machine": machine(device),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(),
        "command": " ".join([program, *(shlex.quote(o) for o in overrides)]),
    }


def machine(device: torch.device) -> dict[str, Any]:
    """The processor that ran the forwards, and the software that ran them. ``label`` names the
    machine in the leaderboard: the GPU for a CUDA run, else the CPU model and the cores used."""
    cores = available_cores()
    cpu, features = cpu_model(), cpu_features()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    tag = f" [{', '.join(features)}]" if features else ""
    return {
        "label": gpu or f"{cpu}{tag}, {torch.get_num_threads()} threads",
        "cpu": cpu,
        "cpu_features": features,
        "cores": cores,
        "threads": torch.get_num_threads(),
        "gpu": gpu,
        "system": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


# instruction sets that decide which kernels oneDNN and MKL take (and so the timings): two VMs with the
# same model name ("Intel(R) Xeon(R) Processor") can differ in them
CPU_FEATURES = (("avx512f", "AVX-512"), ("avx512_bf16", "AVX512-BF16"), ("avx512_vnni", "AVX512-VNNI"),
                ("amx_tile", "AMX"))


def cpu_features() -> list[str]:
    """The CPU_FEATURES this processor has, by their usual names ([] where /proc/cpuinfo is absent)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((set(line.partition(":")[2].split()) for line in text.splitlines() if line.startswith("flags")), set())
    return [name for flag, name in CPU_FEATURES if flag in flags]


def commit() -> str | None:
    """The checkout's commit, "+changes" when tracked files differ from it; None outside a git checkout
    (an installed wheel, whose site-packages may lie inside some other repository)."""
    if not (REPO / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                 capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}+changes" if changed else head
