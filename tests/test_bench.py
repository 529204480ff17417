"""specdec-bench: the plan's cells, a bench end to end on the synthetic target, resuming a killed
bench, refusing bad input before any run, and the generated leaderboard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments.bench import command, leaderboard, studies
from experiments.bench.plan import FULL, QUICK, STANDARD, BenchPlan, cells

SYNTHETIC = ["--families", "synthetic", "--drafters", "synthetic", "--peers", "none", "--temperatures", "0,1",
             "--lengths", "6", "--prompts", "3", "target=synthetic", "repeats=1",
             "warmup_tokens=2", "logger=none"]


def bench(tmp_path: Path, *extra: str) -> Path:
    out = tmp_path / "bench"
    command.main([*SYNTHETIC, "--out", str(out), *extra])
    return out


def test_the_quick_plan_spreads_mtbench_over_its_categories_and_puts_user_overrides_last():
    plan = BenchPlan(**{**QUICK.__dict__, "overrides": (*QUICK.overrides, "repeats=3")})
    mtbench, sharegpt = cells(plan)
    assert mtbench.name == "mtbench/T0-64tok" and sharegpt.name == "sharegpt/T0-64tok"
    assert "workload.per_category=1" in mtbench.overrides and "workload.num_prompts=8" in mtbench.overrides
    assert not any(o.startswith("workload.per_category") for o in sharegpt.overrides)  # one category: no spreading
    assert mtbench.overrides[-2:] == ("repeats=1", "repeats=3")  # the user's last, so they win
    assert "drafter=union" in mtbench.overrides and "rivals=[eagle3,ngram,recycling,hf_generate]" in mtbench.overrides


def test_the_full_plan_covers_every_family_temperature_and_length():
    planned = cells(FULL)
    assert len(planned) == len(FULL.families) * 2 * 2
    sampled = [c for c in planned if c.temperature == 1.0]
    assert all("sampling=sample" in c.overrides and "sampling.temperature=1" in c.overrides for c in sampled)
    assert {c.max_new_tokens for c in planned} == {64, 256}
    # the full MT-bench is every prompt: no per-category cut
    assert not any(o.startswith("workload.per_category") for c in planned for o in c.overrides)


def test_the_standard_grid_covers_four_families_both_temperatures_and_composes():
    from experiments.cli import check_overrides
    from experiments.run.command import check_config
    from experiments.run.schema import CONFIG_DIR

    planned = cells(STANDARD)
    assert len({c.family for c in planned}) >= 4 and {c.temperature for c in planned} == {0.0, 1.0}
    prompts = {c.family: next(o for o in c.overrides if o.startswith("workload.num_prompts=")) for c in planned}
    assert prompts["long_context"] == "workload.num_prompts=6" and prompts["mtbench"] == "workload.num_prompts=16"
    assert all("rivals=[eagle3,recycling,ngram,hf_generate,hf_prompt_lookup]" in c.overrides for c in planned)
    for cell in planned:  # every cell is a valid specdec-run command line
        check_overrides(list(cell.overrides), CONFIG_DIR, "config", check_config)
    with_questions = command.plan_from(command.bench_parser().parse_args(["--standard", "--question-file", "q.jsonl"]))
    assert "workload.num_prompts=16" in next(c for c in cells(with_questions) if c.family == "specbench").overrides


@pytest.mark.integration
def test_a_cell_that_found_the_machine_busy_runs_again_once(tmp_path, monkeypatch, capsys):
    import experiments.run.command as run_command

    fewer_threads = {"busy": False, "at_start": {"cores": 2, "threads": 1, "others_share": 0.5}}
    original, contention = run_command.run, iter([{"busy": True}, {"busy": False}, fewer_threads, {"busy": True}])
    calls = []

    def flagged(cfg, run_dir, *args, **kwargs):
        calls.append(run_dir.name)
        return {**original(cfg, run_dir, *args, **kwargs), "contention": next(contention)}

    monkeypatch.setattr(run_command, "run", flagged)
    bench(tmp_path)
    # busy, quiet; on fewer threads (others held a core as it started), busy (kept)
    assert calls == ["T0-6tok", "T0-6tok", "T1-6tok", "T1-6tok"]
    out = capsys.readouterr().out
    assert "busy during synthetic/T0-6tok: running it again" in out and "kept, flagged in the leaderboard" in out


def test_a_bench_runs_every_cell_then_writes_the_leaderboard(tmp_path):
    out = bench(tmp_path)
    for cell in ("synthetic/T0-6tok", "synthetic/T1-6tok"):
        results = json.loads((out / cell / "results.json").read_text())
        assert results["drafter"] == "synthetic" and results["num_prompts"] == 3
        assert results["provenance"]["command"].startswith("specdec-run workload=synthetic")
        assert results["provenance"]["machine"]["label"]
    board = (out / "LEADERBOARD.md").read_text()
    assert "### T = 0, 6 tokens" in board and "### T = 1, 6 tokens" in board
    assert "| synthetic | synthetic |" in board and "3/3" in board and "n/a" in board
    plots = sorted(p.name for p in (out / "data" / "leaderboard").iterdir())
    assert len([p for p in plots if p.startswith("tau_vs_speedup")]) == 2


@pytest.mark.integration
def test_a_killed_bench_continues_with_the_cells_it_has_not_finished(tmp_path, monkeypatch, capsys):
    out = bench(tmp_path)
    first = (out / "synthetic/T0-6tok/results.json").read_text()
    (out / "synthetic/T1-6tok/results.json").unlink()  # as if killed while that cell ran
    ran = []
    import experiments.run.command as run_command

    original = run_command.run
    monkeypatch.setattr(run_command, "run", lambda cfg, run_dir, *a, **k: ran.append(run_dir) or original(cfg, run_dir, *a, **k))
    bench(tmp_path)
    assert ran == [out / "synthetic/T1-6tok"]
    assert (out / "synthetic/T0-6tok/results.json").read_text() == first
    assert "1 of 2 cells already done" in capsys.readouterr().out


def test_a_cell_dir_holding_another_run_is_refused_before_anything_runs(tmp_path, capsys):
    out = bench(tmp_path, "--temperatures", "0")
    with pytest.raises(SystemExit) as exit_info:
        bench(tmp_path, "--temperatures", "0", "seed=1")  # the same cell dir, another run
    assert exit_info.value.code == 2
    message = capsys.readouterr().err.strip()
    assert message.startswith("specdec-bench: error:") and "holds another run" in message and "\n" not in message
    assert json.loads((out / "synthetic/T0-6tok/results.json").read_text())["seed"] == 0


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--families", "gsm8k"], "unknown family 'gsm8k'"),
        (["--families", "specbench"], "add --question-file FILE"),
        (["--drafters", "none"], "--drafters names no drafter"),
        (["--temperatures", "zero"], "cannot read 'zero'"),
        (["--prompts", "0"], "--prompts must be >= 1"),
        (["--families", "synthetic", "--drafters", "nonesuch", "--peers", "none", "target=synthetic"],
         "cell synthetic/T0-64tok: unknown drafter 'nonesuch'"),
    ],
)
def test_bad_input_is_one_line_before_any_cell_runs(tmp_path, capsys, arguments, message):
    with pytest.raises(SystemExit) as exit_info:
        command.main([*arguments, "--out", str(tmp_path / "bench")])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert message in error and "\n" not in error
    assert not (tmp_path / "bench").exists()


def fake_results(path: Path, machine: str | None, speedup: float, peers: bool = False) -> None:
    side = {"drafter": "union", "num_prompts": 4, "repeats": 2, "speedup": speedup, "speedup_interval": [speedup - 0.1, speedup + 0.1],
            "tau": 2.0, "tau_interval": [1.9, 2.1], "greedy_equal": False, "greedy_mismatches": ["p3"],
            "drafter_cost_ratio": 0.1, "target_time_ratio": 1.2, "mean_tree_nodes": 6.0}
    results = {**side, "temperature": 0.0, "max_new_tokens": 64, "overrides": ["drafter=union"], "target": "SmolLM2",
               "exactness_contract": "bitwise", "warmup_tokens": 16, "contention": {"busy": False},
               "config": {"drafter": {"name": "union"}, "workload": {"name": "mtbench", "categories": None},
                          "target": {"name": "smollm2", "dtype": "float32"}},
               "provenance": {"machine": {"label": machine}, "date": "2026-12-03T00:00:00+00:00", "commit": "abc",
                              "command": "specdec-run drafter=union"}}
    if machine is None:  # written before runs recorded their provenance
        del results["provenance"]
    if peers:
        results["peers"] = [{"drafter": "hf_generate", "num_prompts": 4, "repeats": 2, "speedup": 1.05,
                             "speedup_interval": [1.0, 1.1], "greedy_equal": True, "greedy_mismatches": []}]
    path.mkdir(parents=True)
    (path / "results.json").write_text(json.dumps(results))


def test_the_leaderboard_keeps_machines_apart_and_peers_report_no_acceptance(tmp_path):
    fake_results(tmp_path / "a", "CPU one", 1.5, peers=True)
    fake_results(tmp_path / "b", "GPU two", 2.5)
    rows = leaderboard.leaderboard_rows([tmp_path])
    board = leaderboard.leaderboard_markdown(rows, [tmp_path], "specdec-bench leaderboard x", "plots")
    assert board.index("## CPU one: SmolLM2, float32") < board.index("## GPU two")
    assert ("| mtbench | union | 1.50x [1.40, 1.60] | 2.00 [1.90, 2.10] | 0.100 | 1.20 | 6.0 | 3/4 | bitwise | yes | no "
            "| 4 x 2 |") in board
    assert "| mtbench | hf_generate (transformers) | 1.05x [1.00, 1.10] | - | - | - | - | 4/4 |" in board
    top = board.split("## Top rows")[1].split("## CPU one")[0]
    assert "| CPU one | SmolLM2 | float32 | T = 0, 64 tokens | mtbench | union | 1.50x" in top and "GPU two" in top
    assert "specdec-run drafter=union" in board and "commit abc" in board


def test_rows_say_dtype_contract_warm_up_and_a_busy_machine_and_never_rank_dtypes_together(tmp_path):
    fake_results(tmp_path / "a", "CPU one", 1.5)
    fake_results(tmp_path / "b", "CPU one", 2.5)
    b = json.loads((tmp_path / "b" / "results.json").read_text())
    b["config"]["target"]["dtype"] = "bfloat16"
    b.update(exactness_contract="logits", warmup_tokens=0, contention={"busy": True})
    (tmp_path / "b" / "results.json").write_text(json.dumps(b))
    board = leaderboard.leaderboard_markdown(leaderboard.leaderboard_rows([tmp_path]), [tmp_path], "x", None)
    # the faster bfloat16 run is the top row of its own dtype, not the float32 one's
    assert "## CPU one: SmolLM2, float32" in board and "## CPU one: SmolLM2, bfloat16" in board
    top = board.split("## Top rows")[1].split("## CPU one")[0]
    assert "| float32 | T = 0, 64 tokens | mtbench | union | 1.50x" in top
    assert "| bfloat16 | T = 0, 64 tokens | mtbench | union | 2.50x" in top
    assert "| 3/4 | logits | no | **YES** | 4 x 2 |" in board


def test_a_draft_model_that_is_the_target_says_so(tmp_path):
    fake_results(tmp_path / "a", "CPU one", 0.9)
    a = json.loads((tmp_path / "a" / "results.json").read_text())
    a["config"]["drafter"] = {"name": "draft_model", "model_path": "smollm2"}
    (tmp_path / "a" / "results.json").write_text(json.dumps(a))
    [row] = leaderboard.leaderboard_rows([tmp_path])
    assert row.side == "union (target drafting for itself)"


@pytest.mark.parametrize("date, checkpoint, miniature", [
    ("2026-12-03T00:00:00+00:00", None, True), (None, None, True),  # dated before the published head, or never
    ("2026-12-03T00:00:00+00:00", "heads/domino", False),  # a head of its own: whatever it was, not the bundle
    ("2027-01-01T00:00:00+00:00", None, False),
])
def test_a_domino_row_that_ran_the_miniature_bundle_says_so(tmp_path, date, checkpoint, miniature):
    fake_results(tmp_path / "a", "CPU one", 1.1)
    a = json.loads((tmp_path / "a" / "results.json").read_text())
    a["config"]["drafter"] = {"name": "domino", "checkpoint": checkpoint}
    a["provenance"]["date"] = date
    (tmp_path / "a" / "results.json").write_text(json.dumps(a))
    [row] = leaderboard.leaderboard_rows([tmp_path])
    assert row.side == "union" + (" (miniature head)" if miniature else "")


def test_runs_kept_as_named_results_files_count_as_runs_of_their_own(tmp_path):
    fake_results(tmp_path / "a", "CPU one", 1.5)
    fake_results(tmp_path / "b", "CPU one", 1.2)
    (tmp_path / "a" / "results.json").rename(tmp_path / "t0_64.results.json")
    (tmp_path / "b" / "results.json").rename(tmp_path / "t1_64.results.json")
    (tmp_path / "eagle-smollm2-train_results.json").write_text("{}")  # specdec-train's: not a run
    rows = leaderboard.leaderboard_rows([tmp_path], machine="CPU two")
    assert sorted(r.run for r in rows) == [str(tmp_path / "t0_64.results.json"), str(tmp_path / "t1_64.results.json")]
    assert {r.machine for r in rows} == {"CPU one"}  # a recorded machine wins over --machine
    fake_results(tmp_path / "c", None, 1.1)
    unrecorded = [r for r in leaderboard.leaderboard_rows([tmp_path / "c"], machine="CPU two")]
    assert [r.machine for r in unrecorded] == ["CPU two"]
    assert [r.machine for r in leaderboard.leaderboard_rows([tmp_path / "c"])] == [leaderboard.NOT_RECORDED]


def test_the_leaderboard_command_writes_the_file_plots_and_refuses_an_empty_dir(tmp_path, capsys):
    fake_results(tmp_path / "runs" / "a", "CPU one", 1.5)
    target = tmp_path / "docs" / "LEADERBOARD.md"
    command.main(["leaderboard", str(tmp_path / "runs"), "--out", str(target)])
    assert target.read_text().startswith("# Leaderboard")
    assert len(list((tmp_path / "docs" / "data" / "leaderboard").glob("*.png"))) == 2
    assert "![tau against speedup](data/leaderboard/tau_vs_speedup-cpu-one-smollm2-float32-t0-64tok.png)" in target.read_text()
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):
        command.main(["leaderboard", str(tmp_path / "empty"), "--out", str(target)])
    assert "no results.json under" in capsys.readouterr().err


def test_the_leaderboard_goes_to_an_offline_wandb_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.chdir(tmp_path)
    fake_results(tmp_path / "runs" / "a", "CPU one", 1.5, peers=True)
    command.main(["leaderboard", "runs", "--out", "LEADERBOARD.md", "--wandb"])
    run_dir, = (tmp_path / "outputs" / "leaderboard-wandb" / "wandb").glob("offline-run-*")
    # what the run logged, as wandb stores it in the run's files at log time
    tables = sorted(p.name.split("_")[0] for p in run_dir.rglob("*.table.json"))
    assert tables == ["leaderboard", "top"] and len(list(run_dir.rglob("*.png"))) == 2


# -- specdec-bench studies ------------------------------------------------------------------------------


def test_every_study_run_is_a_checked_command_line_of_at_least_40_prompts(tmp_path):
    from experiments.cli import check_overrides
    from experiments.run.command import check_config
    from experiments.run.schema import CONFIG_DIR

    found = studies.studies(tmp_path, ("threads=2",))
    assert list(found) == ["temperature", "forecast", "drafter-cost", "context", "tree-budget", "tree-budget-gemma3",
                           "quantized"]
    runs = [run for study in found.values() for run in study.runs]
    assert len({run.name for run in runs}) == len(runs) == 15
    for run in runs:
        assert run.overrides[-3:] == ("max_new_tokens=64", "repeats=1", "threads=2")  # the user's last
        assert "workload.num_prompts=40" in run.overrides
        check_overrides(list(run.overrides), CONFIG_DIR, "config", check_config)
    mtbench = [run for run in runs if "workload.per_category=5" in run.overrides]  # 8 categories x 5
    assert len(mtbench) == 4 + 1 + 2 + 1 + 3
    # the forecast reads the acceptance of a run that comes before it, under the same dir
    order = [run.name for run in runs]
    (forecast,) = found["forecast"].runs
    assert f"budget.acceptance={tmp_path / 'b_T0' / 'results.json'}" in forecast.overrides
    assert order.index("b_T0") < order.index("a_sharegpt_forecast")


@pytest.mark.integration
def test_studies_run_resumably_and_write_a_report_per_study(tmp_path, monkeypatch, capsys):
    tiny = ("target=synthetic", "workload=synthetic", "workload.num_prompts=2", "max_new_tokens=5", "repeats=1",
            "warmup_tokens=0", "logger=none")

    def synthetic_studies(out, user=()):
        return {
            "one": studies.Study("one", "q1", (studies.StudyRun("x_1", (*tiny, "drafter=synthetic", *user)),)),
            "two": studies.Study("two", "q2", (
                studies.StudyRun("y_1", (*tiny, "drafter=synthetic", "drafter.divergence=0.2", *user)),
                studies.StudyRun("y_2", (*tiny, "drafter=synthetic", "drafter.divergence=0.6", *user)),
            )),
        }

    monkeypatch.setattr(command, "studies", synthetic_studies)
    out = tmp_path / "studies"
    command.main(["studies", "--only", "two", "--out", str(out), "seed=3"])
    assert not (out / "x_1").exists()
    for name in ("y_1", "y_2"):
        assert json.loads((out / name / "results.json").read_text())["overrides"][-1] == "seed=3"
    report = (out / "reports" / "two" / "report.md").read_text()
    assert "y_1" in report and "y_2" in report
    command.main(["studies", "--out", str(out), "seed=3"])
    assert "2 of 3 cells already done" in capsys.readouterr().out and (out / "reports" / "one" / "report.md").is_file()


def test_an_unknown_study_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        command.main(["studies", "--only", "temprature"])
    assert exit_info.value.code == 2
    message = capsys.readouterr().err.strip()
    assert "--only 'temprature': choose from temperature, forecast" in message and "\n" not in message


def test_a_run_under_the_logits_contract_says_so_in_its_contract_column(tmp_path):
    fake_results(tmp_path / "a", "GPU", 1.5)
    results = json.loads((tmp_path / "a" / "results.json").read_text())
    results["exactness_contract"] = "logits"
    (tmp_path / "a" / "results.json").write_text(json.dumps(results))
    fake_results(tmp_path / "b", "CPU", 1.2)  # recorded before runs named their contract
    results = json.loads((tmp_path / "b" / "results.json").read_text())
    del results["exactness_contract"]
    (tmp_path / "b" / "results.json").write_text(json.dumps(results))
    board = leaderboard.leaderboard_markdown(leaderboard.leaderboard_rows([tmp_path]), [tmp_path], "x", "plots")
    assert "| 3/4 | logits |" in board.split("## GPU")[1] and "| 3/4 | - |" in board.split("## CPU")[1].split("## GPU")[0]


# -- the bench's promises (issue 44) ----------------------------------------------------------------


def test_every_cell_is_checked_before_any_model_loads(tmp_path, monkeypatch, capsys):
    import experiments.run.build as build
    from specdec import target_loader

    def refuse(*args, **kwargs):
        raise AssertionError("a model loaded before the bad cell was reported")

    monkeypatch.setattr(target_loader, "load_hf_target", refuse)
    monkeypatch.setattr(build, "open_target", refuse)
    with pytest.raises(SystemExit) as exit_info:  # the synthetic drafter, on the default target (SmolLM2)
        command.main(["--families", "synthetic", "--drafters", "synthetic,ngram", "--out", str(tmp_path / "bench")])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("specdec-bench: error: cell synthetic/T0-64tok: drafter 'synthetic' needs") and "\n" not in error
    assert "needs target=synthetic" in error and not (tmp_path / "bench").exists()


def test_the_printed_command_of_each_cell_is_the_one_its_results_record(tmp_path, capsys):
    out = bench(tmp_path, "--temperatures", "0", "--drafters", "synthetic,ngram")
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("specdec-run ")]
    recorded = json.loads((out / "synthetic/T0-6tok/results.json").read_text())["provenance"]["command"]
    assert "'rivals=[ngram]'" in recorded and printed == [recorded]


@pytest.mark.parametrize("damage", ["cut short", "empty record"])
def test_an_unreadable_or_empty_record_is_named_with_its_path(tmp_path, capsys, damage):
    fake_results(tmp_path / "runs" / "a", "CPU one", 1.5)
    fake_results(tmp_path / "runs" / "b", "CPU one", 1.2)
    broken = tmp_path / "runs" / "b" / "results.json"
    broken.write_text(broken.read_text()[:200] if damage == "cut short" else "{}")
    with pytest.raises(SystemExit) as exit_info:
        command.main(["leaderboard", str(tmp_path / "runs"), "--out", str(tmp_path / "LEADERBOARD.md")])
    error = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "\n" not in error
    assert error.startswith(f"specdec-bench: error: {broken} ")
    assert not (tmp_path / "LEADERBOARD.md").exists()


def test_a_bench_dir_another_bench_is_writing_is_refused(tmp_path, capsys):
    import os

    from experiments.cli import LOCK_FILE, hold_lock

    with hold_lock(tmp_path / "bench" / LOCK_FILE, "held by this test", "-"):
        with pytest.raises(SystemExit) as exit_info:
            bench(tmp_path)
    assert exit_info.value.code == 2
    assert f"the bench dir {tmp_path / 'bench'} is in use by process {os.getpid()}" in capsys.readouterr().err
    assert list((tmp_path / "bench").iterdir()) == []


def test_a_read_only_leaderboard_location_is_one_line_before_reading(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        command.main(["leaderboard", str(tmp_path / "nothing-here"), "--out", "/proc/sys/specdec-test/LEADERBOARD.md"])
    error = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "/proc/sys is not a writable folder" in error and "\n" not in error
