"""A run's figures recompute from its run dir alone (units.jsonl), specdec-analyze finds a damaged
units.jsonl, and a run notices a busy machine (experiments/common/records.py, experiments/run/machine_load.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from test_run_cli import SMALL, read_jsonl, run_in_process

from experiments.common import records
from experiments.analyze import AnalyzeError, discover
from experiments.run import machine_load
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


def test_short_units_are_not_judged_and_long_ones_are():
    def row(seconds: float, share: float) -> dict:
        return {"seconds": {"baseline": [seconds], "speculative": [seconds]},
                "others_share": {"baseline": [share], "speculative": [share]}}

    short = records.contention([row(0.1, 0.5), row(0.1, 0.0)], busy_share=0.1, min_judged_s=1.0)
    assert short["busy"] is None and short["judged_units"] == 0
    mixed = records.contention([row(0.1, 0.9), row(0.6, 0.3), row(0.6, 0.05)], busy_share=0.1, min_judged_s=1.0)
    assert mixed["busy"] is True and mixed["judged_units"] == 2 and mixed["busy_units"] == 1
    assert mixed["max_others_share"] == pytest.approx(0.3)
