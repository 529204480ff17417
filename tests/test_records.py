"""A run's figures recompute from its run dir alone (units.jsonl), specdec-analyze finds a damaged
units.jsonl, and a run notices a busy machine (experiments/common/records.py, experiments/run/machine_load.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from test_run_cli import SMALL, read_jsonl, run_in_process
from tiny_models import tiny_model

from experiments.common import records
from experiments.analyze import discover
from experiments.analyze.errors import AnalyzeError
from experiments.run import machine_load
from specdec.target import HFTarget
from specdec.intervals import rate_ratio_interval, ratio_interval

WITH_RIVAL = [*SMALL, "workload.num_prompts=5", "rivals=[ngram]", "logger=none"]


@pytest.mark.integration
def test_every_interval_a_run_prints_recomputes_from_its_units_jsonl(tmp_path):
    results = run_in_process(tmp_path, WITH_RIVAL)
    rows = read_jsonl(tmp_path / "units.jsonl")
    seed, repeats = results["seed"], results["repeats"]

    def speedup(side: str, reference: str) -> list[float]:
        def totals(name):
            return [r["tokens"][name] * repeats for r in rows], [sum(r["seconds"][name]) for r in rows]
        return rate_ratio_interval(*totals(side), *totals(reference), seed=seed).as_list()

    def tau(side: str) -> list[float]:
        return ratio_interval([r["emitted"][side] for r in rows], [r["request_steps"][side] for r in rows],
                              seed=seed).as_list()

    assert results["speedup_interval"] == speedup("speculative", "baseline")
    assert results["tau_interval"] == tau("speculative")
    [rival] = results["rivals"]
    assert rival["speedup_interval"] == speedup("ngram", "baseline")
    assert rival["ratio_to_drafter_interval"] == speedup("ngram", "speculative")
    assert rival["tau_interval"] == tau("ngram")
    # the point estimates too: tau is emitted tokens over request-steps
    emitted = sum(r["emitted"]["speculative"] for r in rows)
    assert results["tau"] == pytest.approx(emitted / sum(r["request_steps"]["speculative"] for r in rows))
    assert discover.read_run_dir(tmp_path, from_wandb=False).results["tau"] == results["tau"]


@pytest.mark.parametrize("damage", ["a unit dropped"] + [pytest.param(d, marks=pytest.mark.integration)
                                                      for d in ["cut mid-line", "a timing edited", "a side dropped"]])
def test_analyze_refuses_a_damaged_units_jsonl(tmp_path, damage):
    run_in_process(tmp_path, WITH_RIVAL)
    path = tmp_path / "units.jsonl"
    text = path.read_text()
    rows = [json.loads(line) for line in text.splitlines()]
    if damage == "cut mid-line":
        path.write_text(text[: len(text) // 2])
    else:
        if damage == "a unit dropped":
            rows = rows[1:]
        elif damage == "a timing edited":
            rows[0]["seconds"]["speculative"][0] *= 3
        else:
            del rows[-1]["tokens"]["ngram"]
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(AnalyzeError, match="units.jsonl"):
        discover.read_run_dir(tmp_path, from_wandb=False)


def test_the_share_of_other_processes_is_what_the_machine_spent_beyond_our_own_time():
    start = machine_load.CpuSample(wall_s=10.0, own_cpu_s=1.0, machine_busy_s=100.0, cores=2)
    # 2 s of wall on 2 cores: 4 core-seconds; the machine was busy 3.5 of them, ours 2.5
    end = machine_load.CpuSample(wall_s=12.0, own_cpu_s=3.5, machine_busy_s=103.5, cores=2)
    assert machine_load.others_share(start, end) == pytest.approx(0.25)
    idle_neighbours = machine_load.CpuSample(wall_s=12.0, own_cpu_s=4.6, machine_busy_s=103.5, cores=2)
    assert machine_load.others_share(start, idle_neighbours) == 0.0  # tick rounding never goes negative
    unknown = machine_load.CpuSample(wall_s=12.0, own_cpu_s=3.5, machine_busy_s=None, cores=0)
    assert machine_load.others_share(start, unknown) is None


@pytest.mark.integration
@pytest.mark.skipif(machine_load.sample().machine_busy_s is None, reason="no per-core CPU account here")
def test_a_busy_loop_beside_a_run_is_reported(tmp_path):
    # one spinning process takes about one core of the two the run may use
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        # forwards of 25 ms: each unit's calls last well past machine_load.MIN_JUDGED_S
        results = run_in_process(tmp_path, [*SMALL, "workload.num_prompts=3", "max_new_tokens=16", "target.forward_ms=25",
                                            "logger=none"])
    finally:
        spinner.kill()
        spinner.wait()
    contention = results["contention"]
    assert contention["busy"] is True and contention["busy_units"] >= 1
    assert contention["max_others_share"] > machine_load.BUSY_SHARE
    rows = read_jsonl(tmp_path / "units.jsonl")
    assert all(share is not None for row in rows for shares in row["others_share"].values() for share in shares)


def test_the_cores_left_free_are_all_of_them_on_a_quiet_machine_and_those_others_did_not_take_on_a_busy_one():
    def free(cores: int, share: float | None) -> int:
        start = machine_load.CpuSample(wall_s=0.0, own_cpu_s=0.0, machine_busy_s=0.0 if share is not None else None,
                                       cores=cores)
        end = machine_load.CpuSample(wall_s=1.0, own_cpu_s=0.0, machine_busy_s=None if share is None else share * cores,
                                     cores=cores)
        found, recorded = machine_load.free_cores(cores, start, end)
        assert recorded == (None if share is None else pytest.approx(share))
        return found

    assert free(2, 0.0) == 2 and free(2, machine_load.BUSY_SHARE) == 2 and free(2, None) == 2
    assert free(2, 0.15) == 1  # a core partly taken stalls every operator split over it
    assert free(2, 0.5) == 1 and free(2, 0.53) == 1 and free(2, 1.0) == 1  # never fewer than one
    assert free(16, 0.5) == 8 and free(16, 0.505) == 8 and free(16, 0.52) == 7 and free(16, 0.2) == 12


@pytest.mark.integration
@pytest.mark.skipif(machine_load.sample().machine_busy_s is None or len(os.sched_getaffinity(0)) != 2,
                    reason="needs a per-core CPU account and two cores")
def test_a_run_that_finds_a_busy_loop_as_it_starts_decodes_on_the_core_left_free(tmp_path):
    import torch

    folder = tmp_path / "tiny-llama"
    HFTarget(tiny_model("llama")).model.save_pretrained(folder)
    overrides = ["target=hf", f"target.path={folder}", "workload=synthetic", "drafter=ngram",
                 "workload.num_prompts=2", "max_new_tokens=8", "logger=none"]
    threads = torch.get_num_threads()
    try:
        quiet = run_in_process(tmp_path / "quiet", overrides)
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(0.3)
            busy = run_in_process(tmp_path / "busy", overrides)
        finally:
            spinner.kill()
            spinner.wait()
    finally:
        torch.set_num_threads(threads)
    assert quiet["contention"]["at_start"]["threads"] == 2 and quiet["threads"] == 2
    assert quiet["contention"]["busy_share"] == pytest.approx(machine_load.BUSY_SHARE)
    start = busy["contention"]["at_start"]
    assert start["cores"] == 2 and start["threads"] == 1 and start["others_share"] > 0.3 and busy["threads"] == 1
    # the spinner may keep the core it took: the run is judged busy only beyond it
    assert busy["contention"]["busy_share"] == pytest.approx(0.5 + machine_load.BUSY_SHARE)


def test_a_busy_run_says_so_above_its_figures():
    from experiments.run.summary import busy_rows

    busy = {"busy": True, "busy_share": 0.1, "others_share_per_unit": [0.02, 0.4], "judged_units": 2, "busy_units": 1,
            "max_others_share": 0.4}
    [(name, text)] = busy_rows(busy)
    assert "BUSY" in name and "40%" in text and "1 of 2 units" in text
    assert busy_rows({**busy, "busy": False}) == []
    assert busy_rows({**busy, "busy": None, "judged_units": 0}) == []  # every unit too short to judge
    no_account = {**busy, "busy": None, "others_share_per_unit": [None, None], "max_others_share": None}
    assert "unknown" in busy_rows(no_account)[0][1]
    left = {**busy, "busy": False, "at_start": {"cores": 2, "threads": 1, "others_share": 0.48}}
    [(name, text)] = busy_rows(left)
    assert "48%" in text and "on the 1 of 2 cores" in text
    assert busy_rows({**left, "at_start": {"cores": 2, "threads": 2, "others_share": 0.01}}) == []


def test_a_run_that_left_cores_to_others_counts_as_busy_as_one_they_slowed():
    quiet = {"busy": False, "at_start": {"cores": 2, "threads": 2, "others_share": 0.0}}
    assert records.machine_was_busy({"contention": quiet}) is False
    assert records.machine_was_busy({"contention": {**quiet, "busy": True}}) is True
    assert records.machine_was_busy({"contention": {**quiet, "at_start": {"cores": 2, "threads": 1,
                                                                           "others_share": 0.5}}}) is True
    assert records.machine_was_busy({"contention": {"busy": None, "at_start": None}}) is None  # threads set by hand
    assert records.machine_was_busy({}) is None  # recorded before contention was


def test_short_units_are_not_judged_and_long_ones_are():
    def row(seconds: float, share: float) -> dict:
        return {"seconds": {"baseline": [seconds], "speculative": [seconds]},
                "others_share": {"baseline": [share], "speculative": [share]}}

    short = records.contention([row(0.1, 0.5), row(0.1, 0.0)], busy_share=0.1, min_judged_s=1.0)
    assert short["busy"] is None and short["judged_units"] == 0
    mixed = records.contention([row(0.1, 0.9), row(0.6, 0.3), row(0.6, 0.05)], busy_share=0.1, min_judged_s=1.0)
    assert mixed["busy"] is True and mixed["judged_units"] == 2 and mixed["busy_units"] == 1
    assert mixed["max_others_share"] == pytest.approx(0.3)
