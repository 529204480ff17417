"""How busy the machine was while a side decoded: the share of our cores that other processes (or
the hypervisor, as steal time) took during the call.

A timing on a shared machine measures the neighbours too, and not evenly: the sides of a unit run
seconds apart, and a neighbour that starts or stops between them moves their ratio. So each call
records, beside its wall time, this process's CPU time and the machine's busy time on the cores
this process may run on; what the machine spent beyond our own time went to someone else.

Both come from the kernel's tick accounting (``/proc/stat`` per core, ``os.times`` for the
process), so they agree in resolution. Off Linux there is no per-core account: the share is None
and a run says it could not tell.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

# A unit whose calls lost more than this share of our cores to other processes marks the run busy.
# docs/MEASURING.md records what a quiet machine and a one-core busy loop give, which set it.
BUSY_SHARE = 0.10
# Units shorter than this (all their calls together) are not judged: CPU time is counted in ticks
# (SC_CLK_TCK, 100 per second per core), so a short unit's share is mostly rounding.
MIN_JUDGED_S = 1.0
# How long a run on CPU watches the machine (the target's load, topped up by waiting) before it
# chooses its threads: long enough that one busy core shows as far more ticks than rounding moves.
WATCH_S = 0.25
_STAT = Path("/proc/stat")
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal (guest time is inside user)


@dataclass(frozen=True)
class CpuSample:
    wall_s: float  # time.perf_counter()
    own_cpu_s: float  # this process's user + system time, every thread
    machine_busy_s: float | None  # busy time summed over the cores we may run on; None off Linux
    cores: int  # how many cores that sum covers


def sample() -> CpuSample:
    times = os.times()
    return CpuSample(time.perf_counter(), times.user + times.system, *_busy_seconds())


def others_share(start: CpuSample, end: CpuSample) -> float | None:
    """The share of our cores' capacity between two samples that went to other processes, in [0, 1];
    None when the machine's account is unavailable or no time passed."""
    wall = end.wall_s - start.wall_s
    if start.machine_busy_s is None or end.machine_busy_s is None or wall <= 0:
        return None
    others = (end.machine_busy_s - start.machine_busy_s) - (end.own_cpu_s - start.own_cpu_s)
    return min(max(others / (wall * end.cores), 0.0), 1.0)


def load_average() -> float | None:
    """The one-minute run-queue length, for the record (it lags a call by up to a minute, so the
    share above is what flags a run)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _busy_seconds() -> tuple[float | None, int]:
    try:
        cores = os.sched_getaffinity(0)
        lines = _STAT.read_text().splitlines()
    except (AttributeError, OSError):
        return None, 0
    tick = os.sysconf("SC_CLK_TCK")
    busy = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
            fields = rest.split()
            busy += sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields))
    return busy / tick, len(cores)


def free_cores(cores: int, start: CpuSample, end: CpuSample) -> tuple[int, float | None]:
    """How many of our ``cores`` other processes left free between two samples, and their share.

    Torch splits every operator over its threads and waits for the last one, so a thread that shares
    its core with another process stalls the whole forward for that process's time slices. A one-row
    decoding step is many small operators, a tree forward fewer and larger ones, so the stall hits
    the sides of a unit unevenly (docs/MEASURING.md). On the cores others leave free, every side
    runs as it would alone, on fewer threads. Within BUSY_SHARE all cores count as free; beyond it,
    a partly taken core counts as taken. At least one core is always ours."""
    share = others_share(start, end)
    if share is None or share <= BUSY_SHARE:
        return cores, share
    return max(1, cores - math.ceil(share * cores - BUSY_SHARE)), share


def watched_threads(cores: int, start: CpuSample) -> tuple[int, float | None]:
    """free_cores from ``start`` until now, after waiting out the rest of WATCH_S."""
    rest = WATCH_S - (time.perf_counter() - start.wall_s)
    if rest > 0:
        time.sleep(rest)
    return free_cores(cores, start, sample())
