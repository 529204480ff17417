"""specdec-analyze on real specdec-run outputs (synthetic target, in-process, about a second each):
single runs, sweeps labelled by their overrides, W&B offline runs (a sweep's W&B runs grouped and
named by their overrides, read back through wandb's own reader), bad input; and the study presets,
every sweep point of which must compose against the schema.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from rich.console import Console

from experiments import run as specdec_run
from experiments.analyze import command, discover, findings, wandb_log
from experiments.analyze.errors import AnalyzeError
from experiments.analyze import main as specdec_analyze
from experiments.run import schema

SMALL = ["experiment=synthetic", "workload.num_prompts=3", "max_new_tokens=10", "logger=none"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def compose_run(overrides: list[str], **kwargs):
    with initialize_config_dir(config_dir=str(schema.CONFIG_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=overrides, **kwargs)


def make_run(run_dir: Path, overrides: list[str]) -> dict:
    """A finished run dir, laid out as Hydra leaves it (overrides in .hydra/overrides.yaml)."""
    results = specdec_run.run(compose_run(overrides), run_dir, Console(file=io.StringIO()))
    (run_dir / ".hydra").mkdir()
    (run_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A binary-tree run (sibling ranks > 0) and a two-point temperature sweep."""
    root = tmp_path_factory.mktemp("runs")
    make_run(root / "tree", [*SMALL, "drafter.branching=[2,2]", "sampling.temperature=1"])
    for job, temperature in enumerate(["0", "1"]):
        make_run(root / "sweep" / str(job), [*SMALL, f"sampling.temperature={temperature}"])
    return {"tree": root / "tree", "sweep": root / "sweep"}


def copy_of(path: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(path, tmp_path / path.name))


def test_a_single_run_gets_a_report_with_each_finding_and_readable_plots(runs, tmp_path):
    run_dir = copy_of(runs["tree"], tmp_path)
    results = json.loads((run_dir / "results.json").read_text())
    written = command.analyze([run_dir])
    assert written.out == run_dir and written.wandb_dir is None
    report = written.report.read_text()
    for section in ["## Findings", "## Runs compared", "## tau by drafter x workload category",
                    "## Per-depth conditional acceptance", "## Survival", "## Accepted sibling rank",
                    "## Acceptance vs position in the output", "## Time split"]:
        assert section in report
    assert f"tau = {results['tau']:.2f} tokens per target forward" in report
    assert f"Measured speedup is {results['speedup']:.2f}x" in report
    assert f"Conditional acceptance is {results['per_depth_alpha'][0]:.2f} at depth 1" in report
    assert "of accepted nodes were their parent's first-ranked child" in report
    names = {p.name for p in written.plots}
    assert {"per_depth_acceptance.png", "survival.png", "sibling_rank.png", "acceptance_by_position.png",
            "time_split.png", "speedup.png", "tau_by_category.png", "tau_vs_prompt_length.png"} <= names
    for plot in written.plots:
        assert plot.read_bytes().startswith(PNG_MAGIC) and f"]({plot.name})" in report


def test_the_analysis_matches_what_the_run_recorded(runs):
    run = discover.find_runs([runs["tree"]])[0]
    analysis = findings.analyze_run(run, "tree")
    results = run.results
    # the prediction is the run's own (same formula, same measured times)
    assert analysis.predicted_speedup == pytest.approx(results["predicted_speedup"], rel=1e-9)
    assert analysis.drafter_cost_ratio == pytest.approx(results["drafter_cost_ratio"], rel=1e-9)
    histogram = results["accepted_histogram"]
    assert analysis.survival[0] == 1.0 and analysis.survival[1] == pytest.approx(1 - histogram[0] / sum(histogram))
    assert sum(results["accepted_rank_histogram"]) == sum(n * c for n, c in enumerate(histogram))
    assert analysis.rank_shares[1] > 0  # a binary tree accepts second siblings too
    assert sum(analysis.time_shares.values()) == pytest.approx(1.0)
    # one category: its pooled tau is the run's tau
    assert analysis.category_tau["synthetic"].tau == pytest.approx(results["tau"])


def test_categories_and_positions_are_pooled_over_request_steps():
    prompts = [{"id": "a", "category": "math"}, {"id": "b", "category": "coding"}, {"id": "c", "category": "math"}]
    steps = [
        {"batch": 0, "prompt_ids": ["a", "b"], "num_accepted": [2, 0]},
        {"batch": 0, "prompt_ids": ["a", "b"], "num_accepted": [0, 1]},
        {"batch": 1, "prompt_ids": ["c"], "num_accepted": [3]},
    ]
    by_category = findings._category_tau(prompts, steps)
    assert by_category["math"].tau == pytest.approx((3 + 1 + 4) / 3) and by_category["math"].prompts == 2
    assert by_category["coding"].tau == pytest.approx((1 + 2) / 2) and by_category["coding"].request_steps == 2
    # 16 tokens in 8 bins of 2; depth 3 drafts: steps from position 13 on are cut to the budget
    curve = findings._position_curve(
        steps + [{"batch": 1, "prompt_ids": ["c"], "num_accepted": [0]}] * 12,
        {"max_new_tokens": 16, "per_depth_alpha": [0.5, 0.5, 0.5]},
    )
    assert (curve.bin_width, curve.cutoff) == (2, 13)
    # positions 0-1: a, b and c at 0 (3, 1 and 4 tokens), b at 1 (2 tokens); a's second step is at 3
    assert curve.bin_starts[:3] == [0, 2, 4] and curve.tau[0] == pytest.approx((3 + 1 + 4 + 2) / 4)
    assert max(curve.bin_starts) < 13


def test_a_sweep_dir_compares_its_runs_labelled_by_their_overrides(runs, tmp_path):
    sweep = copy_of(runs["sweep"], tmp_path)
    (sweep / "2" / ".hydra").mkdir(parents=True)  # a job that failed before writing results
    written = command.analyze([sweep])
    report = written.report.read_text()
    assert written.out == sweep
    assert f"Left out, unfinished (no results.json): `{sweep / '2'}`." in report
    rows = [line for line in report.splitlines() if line.startswith("| temperature=")]
    assert len(rows) == 6 * 2  # comparison, category, depth, survival, rank and time tables
    assert "Highest tau:" in report and "runs were slower than plain decoding" in report
    assert (sweep / "sweep.png").read_bytes().startswith(PNG_MAGIC)  # tau and speedup over temperature
    header = next(line for line in report.splitlines() if line.startswith("| run | drafter"))
    for column in ["tau [95% interval]", "speedup measured [95% interval]", "speedup predicted", "c",
                   "overhead share", "drafter", "prompts x passes"]:
        assert f"| {column} |" in header
    comparison = next(line for line in report.splitlines() if line.startswith("| temperature="))
    assert comparison.count("[") == 2  # tau and speedup with their intervals



def test_rivals_measured_in_one_run_are_compared_labelled_by_their_drafter(tmp_path):
    results = make_run(tmp_path / "run", [*SMALL, "rivals=[{drafter: synthetic, divergence: 0.0}]"])
    found = discover.find_runs([tmp_path / "run"])
    assert findings.label_runs(found) == ["drafter=synthetic", "drafter=synthetic(divergence=0.0)"]
    assert [run.results["tau"] for run in found] == [results["tau"], results["rivals"][0]["tau"]]
    report = command.analyze([tmp_path / "run"], wandb=False).report.read_text()
    row = next(line for line in report.splitlines() if line.startswith("| drafter=synthetic(divergence=0.0) |"))
    tau, tau_from_alpha = row.split(" | ")[5:7]
    assert tau.split(" [")[0] == f"{results['rivals'][0]['tau']:.2f}"
    assert tau_from_alpha == "4.00"  # q = p at T = 0: every draft of the 3-chain is accepted
    assert "in 100% of the steps that drafted, the tree ended before a rejection did" in report


def test_the_tree_end_share_counts_steps_whose_accepted_path_had_nothing_deeper():
    # 10 steps drafted; 5 accepted 1 or 2 drafts, 4 of them at a node with children; 2 accepted 2
    assert findings.tree_end_share([5, 3, 2], [10, 4]) == pytest.approx((5 - 4 + 2) / 10)
    assert findings.tree_end_share([10, 0], [10]) == 0.0  # every step ended in a rejection
    assert findings.tree_end_share([3], []) == 0.0  # nothing drafted


def test_several_inputs_go_into_one_comparison(runs, tmp_path):
    runs_found = discover.find_runs([runs["tree"], runs["sweep"], runs["sweep"] / "1"])  # 1 counted once
    assert findings.label_runs(runs_found) == [
        "branching=[2,2] temperature=1", "temperature=0", "temperature=1"
    ]


def log_wandb_run(run_dir: Path, results: dict, prompts: list[dict] | None = None) -> Path:
    """A W&B offline run with batch rows, then the run's summary (with specdec-run's tables when
    ``prompts`` are given); the last row is still pending at the end, so W&B copies it into the
    summary after the run's figures. Padding makes the summary span several 32 KiB blocks of the log."""
    import wandb

    from experiments.run.summary import wandb_tables

    run = wandb.init(project="test", dir=str(run_dir), mode="offline", config={"drafter": {"name": "synthetic"}},
                     settings=wandb.Settings(console="off", silent=True))
    for step in range(2):
        run.log({"tau": 99.0, "tokens_per_s": 1.0}, step=step)
    tables = {} if prompts is None else {name: wandb.Table(columns=table.columns, data=table.rows)
                                         for name, table in wandb_tables(results, prompts).items()}
    run.summary.update({**{k: v for k, v in results.items() if k != "config"}, **tables, "padding": "x" * 100_000})
    run.finish()
    # finish can return before wandb's service has written the log's last records (a copy taken
    # right after it once lacked the summary); teardown waits for the service to exit
    wandb.teardown()
    return next((run_dir / "wandb").glob("offline-run-*"))


@pytest.mark.integration
def test_a_wandb_offline_run_is_read_through_its_run_dir_or_from_its_log_alone(runs, tmp_path):
    run_dir = copy_of(runs["tree"], tmp_path)
    results = json.loads((run_dir / "results.json").read_text())
    wandb_run = log_wandb_run(run_dir, results)

    # inside a run dir: the run dir's files, report there, and the analysis logged to a new offline run
    written = command.analyze([wandb_run])
    assert written.out == run_dir and "| synthetic |" in written.report.read_text()
    assert written.wandb_dir is not None and list(Path(written.wandb_dir).glob("run-*.wandb"))
    assert Path(written.wandb_dir).is_relative_to(run_dir / "analysis-wandb")

    # alone: the summary from the log; the last batch's tau (99) must not replace the run's
    alone = Path(shutil.copytree(wandb_run, tmp_path / "alone"))
    [run] = discover.find_runs([alone])
    assert run.results["tau"] == results["tau"] and run.results["config"] == {"drafter": {"name": "synthetic"}}
    report = command.analyze([alone], wandb=False).report.read_text()
    assert f"tau = {results['tau']:.2f}" in report and "Left out (no per-step rows: read from a W&B log" in report
    assert run.prompts is None  # logged without its tables


@pytest.mark.integration
def test_a_wandb_logs_prompts_table_gives_the_per_prompt_rows(runs, tmp_path):
    """Alone, a W&B log still has its per-prompt rows (the prompts table): the prompt-length
    analysis uses them; the per-step ones (categories, position) stay out."""
    run_dir = copy_of(runs["tree"], tmp_path)
    results = json.loads((run_dir / "results.json").read_text())
    prompts = [json.loads(line) for line in (run_dir / "prompts.jsonl").read_text().splitlines()]
    alone = Path(shutil.copytree(log_wandb_run(run_dir, results, prompts), tmp_path / "alone"))
    [run] = discover.find_runs([alone])
    assert run.prompts == [{k: v for k, v in p.items() if k != "output"} for p in prompts] and run.steps is None
    analysis = findings.analyze_run(run, "synthetic")
    assert analysis.prompt_tau == [p["tau"] for p in prompts] and analysis.category_tau is None

    with pytest.raises(AnalyzeError, match="mixes two runs: its results count 3 prompts, its prompts table holds 2"):
        discover.find_runs([Path(shutil.copytree(log_wandb_run(copy_of(runs["tree"], tmp_path / "cut"), results, prompts[:2]),
                                                 tmp_path / "cut-alone"))])


@pytest.mark.slow  # heavy: CI runs it after the default suite
def test_a_sweeps_wandb_runs_share_its_group_are_named_by_their_overrides_and_hold_its_tables(tmp_path):
    sweep = tmp_path / "sweep"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DATA_DIR": str(tmp_path / "wandb-data")}
    done = subprocess.run(
        [sys.executable, "-m", "experiments.run", "-m", *[o for o in SMALL if o != "logger=none"], "logger=wandb",
         "sampling.temperature=0,1", f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for job in ("0", "1"):
        run_dir = sweep / job
        results = json.loads((run_dir / "results.json").read_text())
        prompts = [json.loads(line) for line in (run_dir / "prompts.jsonl").read_text().splitlines()]
        [wandb_run] = (run_dir / "wandb").glob("offline-run-*")
        logged = wandb_log.read_run(wandb_run)  # through wandb's own reader of the log
        job_config = yaml.safe_load((run_dir / ".hydra" / "hydra.yaml").read_text())["hydra"]["job"]
        assert logged.group == str(sweep) and logged.name == job_config["override_dirname"]
        assert f"sampling.temperature={job}" in logged.name and logged.summary["overrides"] == results["overrides"]
        for figure in ("tau", "speedup"):
            low, high = results[f"{figure}_interval"]
            assert logged.summary[figure] == results[figure]
            assert (logged.summary[f"{figure}_interval_low"], logged.summary[f"{figure}_interval_high"]) == (low, high)
        per_prompt, per_depth = logged.tables["prompts"], logged.tables["per_depth"]
        assert [row[per_prompt["columns"].index("tau")] for row in per_prompt["data"]] == [p["tau"] for p in prompts]
        assert per_depth["columns"] == ["depth", "alpha", "attempts", "survival"]
        assert [row[1] for row in per_depth["data"]] == results["per_depth_alpha"]
        shutil.copytree(wandb_run, tmp_path / "alone" / job)

    # the W&B runs alone, without their run dirs: labelled by the overrides they logged
    runs = discover.find_runs([tmp_path / "alone" / "0", tmp_path / "alone" / "1"])
    assert findings.label_runs(runs) == ["temperature=0", "temperature=1"]


@pytest.mark.parametrize("content,message", [("not a log", "wandb could not read .*bad header"),
                                             ("", "is not a W&B run log")], ids=["foreign", "empty"])
def test_a_file_that_is_not_a_wandb_log_is_refused(tmp_path, content, message):
    (tmp_path / "run-x.wandb").write_text(content)
    with pytest.raises(AnalyzeError, match=message):
        wandb_log.read_run(tmp_path)


def test_an_old_wandb_without_its_log_reader_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(wandb_log.importlib.metadata, "version", lambda package: "0.30.0")
    with pytest.raises(AnalyzeError, match=r"needs wandb >= 0.31 .* wandb 0.30.0 is installed"):
        wandb_log.read_records(tmp_path / "run-x.wandb")


@pytest.mark.parametrize(
    "setup,message",
    [
        (lambda d: d / "missing", "does not exist"),
        (lambda d: (d / "notes.txt").write_text("hi") and d / "notes.txt", "is a file"),
        (lambda d: d, "is not a specdec-run run dir"),
        (lambda d: (d / ".hydra").mkdir() or d, "did not finish"),
        (lambda d: (d / "results.json").write_text('{"tau": 1.5}') and d, "lacks drafter"),
        (lambda d: (d / "results.json").write_text("{oops") and d, "is not valid JSON"),
    ],
    ids=["missing", "file", "empty-dir", "unfinished", "foreign-json", "broken-json"],
)
def test_what_is_not_a_run_gets_a_clear_error(tmp_path, setup, message):
    with pytest.raises(AnalyzeError, match=message):
        command.analyze([setup(tmp_path)])


def test_several_inputs_need_an_output_dir(runs):
    with pytest.raises(AnalyzeError, match="--out DIR"):
        command.analyze([runs["tree"], runs["sweep"]])


def test_the_command_line_reports_bad_input_in_one_line_and_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        specdec_analyze([str(tmp_path)])  # what the specdec-analyze console script calls
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("specdec-analyze: error:") and error.count("\n") == 1


# -- the study presets --------------------------------------------------------------------------------

STUDIES = sorted(p.stem for p in (schema.CONFIG_DIR / "experiment").glob("study_*.yaml"))


def sweep_points(params) -> list[list[str]]:
    """The overrides of each job the basic sweeper would launch for `hydra.sweeper.params`."""
    parsed = OverridesParser.create().parse_overrides([f"{key}={value}" for key, value in params.items()])
    choices = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] for o in parsed]
    return [list(point) for point in itertools.product(*choices)]


def test_the_synthetic_study_is_the_one_preset():  # the others are specdec-bench studies (tests/test_bench.py)
    assert STUDIES == ["study_analytic"]


@pytest.mark.parametrize("study", STUDIES)
def test_every_sweep_point_of_a_study_composes(study):
    with initialize_config_dir(config_dir=str(schema.CONFIG_DIR), version_base="1.3"):
        hydra_cfg = compose(config_name="config", overrides=[f"experiment={study}"], return_hydra_config=True).hydra
        points = sweep_points(hydra_cfg.sweeper.params)
        assert len(points) >= 2 and str(hydra_cfg.sweep.dir).startswith(f"multirun/{study}/")
        for point in points:
            cfg = compose(config_name="config", overrides=[f"experiment={study}", *point])
            assert schema.checked_settings(cfg).max_new_tokens >= 1


@pytest.mark.integration
def test_the_analytic_study_runs_as_a_multirun_on_the_synthetic_target(tmp_path):
    sweep = tmp_path / "sweep"
    done = subprocess.run(
        [sys.executable, "-m", "experiments.run", "-m", "experiment=study_analytic", "drafter.divergence=0.2",
         "workload.num_prompts=1", "max_new_tokens=6", "logger=none", f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    runs = discover.find_runs([sweep])
    assert sorted(findings.label_runs(runs)) == ["branching=[1,1,1,1]", "branching=[1,1]", "branching=[1]"]


def test_the_parallel_launcher_is_joblib():
    launcher = compose_run(["hydra/launcher=parallel"], return_hydra_config=True).hydra.launcher
    assert "JoblibLauncher" in launcher._target_ and launcher.n_jobs == 2


@pytest.mark.parametrize("contract", ["bitwise", pytest.param("logits", marks=pytest.mark.integration)])
def test_a_greedy_divergence_is_a_bug_only_under_the_bitwise_contract(tmp_path, contract):
    make_run(tmp_path / "run", SMALL)
    path = tmp_path / "run" / "results.json"
    results = json.loads(path.read_text())
    results.update(exactness_contract=contract, greedy_equal=False, greedy_mismatches=["p1"], greedy_equal_tokens=0.9)
    path.write_text(json.dumps(results))
    report = command.analyze([tmp_path / "run"], wandb=False).report.read_text()
    if contract == "logits":
        assert "leaves plain decoding's on 1 of 3 prompts, 90.0% of its tokens" in report and "a bug" not in report
        assert "NO (logits)" in report
    else:
        assert "DIFFERS from plain decoding" in report and "a bug" in report
