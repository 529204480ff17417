"""specdec-run end to end: outputs, greedy equality, reproducibility, batching, bad input, sweeps.

Most runs go in-process through `experiments.run.run` on the synthetic preset (about a second
each); a few go through the real command line for exit codes and multirun.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from rich.console import Console
from tiny_models import save_base_model, tiny_model

from experiments import cli
from experiments.common import outputs
from experiments.common.prompt_sets import load_mtbench
from experiments.run import build, command, schema, summary
from experiments.run.rivals import rival_options
from specdec import target_loader

SMALL = ["experiment=synthetic", "workload.num_prompts=3", "max_new_tokens=12"]
RESULT_KEYS = {
    "tau", "speedup", "tokens_per_s", "tokens_per_s_baseline", "per_depth_alpha", "greedy_equal", "drafter",
    "num_prompts", "max_new_tokens", "temperature", "time_split", "time_split_baseline", "drafter_cost_ratio",
    "target_time_ratio", "predicted_speedup", "config",
}


def run_in_process(run_dir: Path, overrides: list[str]) -> dict:
    with initialize_config_dir(config_dir=str(schema.CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    return command.run(cfg, run_dir, Console(file=io.StringIO()))


def run_command(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    # from an unrelated directory: the configs must be found relative to the package
    return subprocess.run(
        [sys.executable, "-m", "experiments.run", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama", sharpness=4.0).save_pretrained(path)
    return path


def test_synthetic_run_writes_results_steps_prompts_plots_and_metrics(tmp_path):
    results = run_in_process(tmp_path, SMALL)
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert RESULT_KEYS <= on_disk.keys()
    assert on_disk["greedy_equal"] is True and on_disk["greedy_mismatches"] == []
    assert on_disk["exactness_contract"] == "bitwise" and on_disk["greedy_equal_tokens"] == 1.0
    assert on_disk["num_prompts"] == 3 and on_disk["drafter"] == "synthetic" and on_disk["temperature"] == 0.0
    assert on_disk["tau"] >= 1 and on_disk["speedup"] > 0 and len(on_disk["per_depth_alpha"]) == 3
    assert on_disk["config"]["workload"]["num_prompts"] == 3
    assert on_disk["threads"] == build.available_cores()
    assert results["tau"] == on_disk["tau"]

    steps = read_jsonl(tmp_path / "steps.jsonl")
    assert steps and sum(s["active_requests"] for s in steps) > 0
    prompts = read_jsonl(tmp_path / "prompts.jsonl")
    assert [p["id"] for p in prompts] == ["synthetic-0", "synthetic-1", "synthetic-2"]
    assert all(p["category"] == "synthetic" and p["generated_tokens"] == 12 and p["tau"] >= 1 for p in prompts)
    # per-prompt tau pools back to the run's tau (each prompt weighted by its decode steps)
    per_prompt_steps = [sum(p["id"] in s["prompt_ids"] for s in steps) for p in prompts]
    pooled = sum(p["tau"] * n for p, n in zip(prompts, per_prompt_steps)) / sum(per_prompt_steps)
    assert pooled == pytest.approx(on_disk["tau"])
    along = on_disk["tau_along_answer"]  # quarters of the 12-token answers, pooling back to tau
    assert [(row["from_token"], row["to_token"]) for row in along][0] == (0, 3) and along[-1]["to_token"] == 12
    assert sum(row["tau"] * row["steps"] for row in along) / sum(row["steps"] for row in along) == pytest.approx(
        on_disk["tau"])
    for plot in ("per_depth_alpha.png", "tau_per_prompt.png"):
        assert (tmp_path / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # logger=jsonl: one line per unit and timed pass (one prompt per unit at batch 1), then the summary
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert on_disk["units"] == 3 and on_disk["repeats"] == 2 and len(metrics) == 3 * 2 + 1
    assert metrics[-1]["summary"]["tau"] == on_disk["tau"]
    assert metrics[-1]["summary"]["speedup_interval_low"] == on_disk["speedup_interval"][0]
    low, high = on_disk["tau_interval"]
    assert low <= on_disk["tau"] <= high and on_disk["speedup_interval"][0] <= on_disk["speedup"]
    units = read_jsonl(tmp_path / "units.jsonl")  # what the intervals were computed from
    assert [u["prompt_ids"] for u in units] == [["synthetic-0"], ["synthetic-1"], ["synthetic-2"]]
    assert all(len(u["seconds"]["speculative"]) == 2 and u["tokens"]["baseline"] == 12 for u in units)
    assert on_disk["reproducible"] is True and len(on_disk["speedup_per_pass"]) == 2
    assert not list(tmp_path.glob(".*.tmp"))


def test_tau_along_the_answer_counts_each_step_where_its_request_stood():
    # request 0 emits 3, 1, 4 tokens; request 1 emits 1, 1, 1, 1, 1 (10-token answers, 2-token segments
    # at segments=5): a step counts in the segment of the tokens generated before it
    steps = [[
        {"request": 0, "num_accepted": 2}, {"request": 1, "num_accepted": 0},
        {"request": 0, "num_accepted": 0}, {"request": 1, "num_accepted": 0},
        {"request": 0, "num_accepted": 3}, {"request": 1, "num_accepted": 0},
        {"request": 1, "num_accepted": 0}, {"request": 1, "num_accepted": 0},
    ]]
    rows = summary.tau_along_answer(steps, max_new_tokens=10, seed=0, segments=5)
    assert [(r["from_token"], r["to_token"], r["steps"], r["tau"]) for r in rows] == [
        (0, 2, 3, 5 / 3), (2, 4, 3, 1.0), (4, 6, 2, 2.5)]
    assert rows[0]["tau_interval"] is None  # one unit: no interval


@pytest.mark.integration
def test_a_fixed_seed_reproduces_sampled_output_and_another_seed_changes_it(tmp_path):
    def outputs(name: str, seed: int) -> list[list[int]]:
        run_in_process(tmp_path / name, [*SMALL, "sampling=sample", "logger=none", f"seed={seed}"])
        return [p["output"] for p in read_jsonl(tmp_path / name / "prompts.jsonl")]

    first, again, other = outputs("a", 7), outputs("b", 7), outputs("c", 8)
    assert first == again
    assert first != other
    assert json.loads((tmp_path / "a" / "results.json").read_text())["greedy_equal"] is None


@pytest.mark.integration
def test_batches_give_the_same_outputs_as_single_prompts(tmp_path):
    single = run_in_process(tmp_path / "single", [*SMALL, "workload.num_prompts=5", "logger=none"])
    batched = run_in_process(tmp_path / "batched", [*SMALL, "workload.num_prompts=5", "batch_size=2", "logger=none"])
    assert batched["greedy_equal"] is True
    outputs = lambda name: [p["output"] for p in read_jsonl(tmp_path / name / "prompts.jsonl")]
    assert outputs("single") == outputs("batched")
    assert batched["tau"] == pytest.approx(single["tau"])
    per_prompt_tau = lambda name: [p["tau"] for p in read_jsonl(tmp_path / name / "prompts.jsonl")]
    assert per_prompt_tau("batched") == pytest.approx(per_prompt_tau("single"))


@pytest.mark.integration
def test_an_hf_target_in_batches_is_greedy_equal(tmp_path, tiny_model_dir):
    # requests in one batch accept different numbers of drafts, so their caches grow raggedly
    results = run_in_process(tmp_path, [
        "target=hf", f"target.path={tiny_model_dir}", "workload=synthetic", "workload.num_prompts=5",
        "workload.prompt_length=7", "max_new_tokens=10", "batch_size=3", "drafter=ngram", "logger=none",
    ])
    assert results["greedy_equal"] is True and results["num_prompts"] == 5
    assert results["tau"] >= 1 and results["generated_tokens"] == results["generated_tokens_baseline"] == 50
    assert 1 <= results["packed_gemm_from"] <= 9  # configs/target/hf.yaml: auto, timed at load


@pytest.mark.integration
def test_rivals_are_measured_against_the_same_baseline_runs(tmp_path):
    results = run_in_process(tmp_path, [*SMALL, "rivals=[synthetic,{drafter: synthetic, divergence: 0.0}]"])
    same, exact = json.loads((tmp_path / "results.json").read_text())["rivals"]
    assert [same["drafter"], exact["drafter"]] == ["synthetic", "synthetic(divergence=0.0)"]
    assert exact["config"]["divergence"] == 0.0 and same["config"]["divergence"] == results["config"]["drafter"]["divergence"]
    for rival in (same, exact):  # one baseline run per group serves every drafter
        assert rival["wall_s_baseline"] == results["wall_s_baseline"] and rival["num_prompts"] == 3
        assert rival["greedy_equal"] is True
    # the drafter itself as a rival drafts the same trees; q = p is always accepted at T = 0
    assert same["tau"] == results["tau"] and same["per_depth_alpha"] == results["per_depth_alpha"]
    assert exact["per_depth_alpha"] == [1.0, 1.0, 1.0] and results["tau"] < 4.0


def forbid_model_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad input was reported")

    monkeypatch.setattr(target_loader, "load_hf_target", refuse)


def test_rival_configs_take_the_runs_values_for_interpolations():
    """union_retrieval prices its trees at ``${batch_size}``: a rival's YAML resolves it as the run's."""
    with initialize_config_dir(config_dir=str(schema.CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["batch_size=4", "group_size=8", "drafter=union_retrieval"])
    settings = schema.checked_settings(cfg)
    assert settings.drafter["cost_batch"] == 4
    rivals = rival_options(["union_retrieval", {"drafter": "union_retrieval", "cost_batch": 1}], cfg)
    assert [options["cost_batch"] for options in rivals.values()] == [4, 1]


@pytest.mark.parametrize(
    "overrides,message",
    [
        ([*SMALL, "sampling.temperature=-1"], "temperature must be >= 0"),
        ([*SMALL, "sampling.top_p=0"], "top_p must lie in"),
        ([*SMALL, "drafter.name=nope"], "unknown drafter 'nope'; choose one of none, .*ngram"),
        ([*SMALL, "workload.name=nope"], "unknown workload 'nope'; choose one of .*mtbench"),
        (["drafter=eagle3", "+drafter.dpeth=2"], "drafter 'eagle3' takes no option dpeth; its options are checkpoint, depth"),
        ([*SMALL, "batch_size=0"], "batch_size must be >= 1"),
        (["workload=jsonl"], "workload=jsonl needs a prompt file"),
        (["workload=jsonl", "workload.path=/no/such/file.jsonl"], "does not exist"),
        (["target=hf"], "target=hf needs a model folder"),
        (["target.packed_gemm_from=0"], "packed_gemm_from must be an integer >= 1, auto .* or null .*; got 0"),
        (["target.packed_gemm_from=fast"], "packed_gemm_from must be .*; got 'fast'"),
        (["target.device=gpu"], "target.device='gpu' is not a device; choose auto, cpu, cuda or cuda:N"),
        (["target.device=mps"], "target.device='mps' is not a device"),
        (["target=synthetic", "workload=mtbench"], "target=synthetic has no tokenizer"),
        (["drafter=draft_model"], "no value for drafter.model_path"),
        ([*SMALL, "rivals=[eagle4]"], "rivals entry 'eagle4': a rivals entry is a drafter config's name .*eagle3"),
        ([*SMALL, "rivals=[{drafter: eagle3, dpeth: 2}]"], "configs/drafter/eagle3.yaml has no option dpeth"),
        ([*SMALL, "rivals=[{depth: 2}]"], "a rivals entry is a drafter config's name"),
        ([*SMALL, "rivals=[none]"], "the baseline .* is always measured"),
        ([*SMALL, "rivals=[ngram,ngram]"], "listed twice"),
        ([*SMALL, "drafter=none", "rivals=[ngram]"], "drafter=none has nothing to compare them with"),
    ],
)
def test_bad_input_is_one_clear_error_before_any_model_loads(tmp_path, monkeypatch, overrides, message):
    forbid_model_loading(monkeypatch)
    with pytest.raises(cli.SpecdecUserError, match=message):
        run_in_process(tmp_path, overrides)
    assert not (tmp_path / "results.json").exists()


def test_bad_jsonl_prompts_are_reported_before_loading(tmp_path, monkeypatch):
    forbid_model_loading(monkeypatch)
    (tmp_path / "wrong_field.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "empty_prompt.jsonl").write_text('{"prompt": "   "}\n')
    with pytest.raises(cli.SpecdecUserError, match="no field 'prompt'; its fields are \\['text'\\]"):
        run_in_process(tmp_path, ["workload=jsonl", f"workload.path={tmp_path / 'wrong_field.jsonl'}"])
    with pytest.raises(cli.SpecdecUserError, match="empty"):
        run_in_process(tmp_path, ["workload=jsonl", f"workload.path={tmp_path / 'empty_prompt.jsonl'}"])


def test_a_prompt_over_the_context_window_is_reported_before_loading(tmp_path, monkeypatch, tiny_model_dir):
    forbid_model_loading(monkeypatch)  # the tiny model's window is 256 tokens
    overrides = ["target=hf", f"target.path={tiny_model_dir}", "drafter=ngram", "workload=synthetic",
                 "workload.prompt_length=250", "max_new_tokens=16"]  # the bundled heads fit SmolLM2 only: refused first
    message = "prompt synthetic-0 has 250 tokens; .* context window of 256"
    with pytest.raises(cli.SpecdecUserError, match=message):
        run_in_process(tmp_path, overrides)


@pytest.fixture(scope="module")
def base_model_dir(tmp_path_factory) -> Path:
    return save_base_model(tmp_path_factory.mktemp("tiny-gpt2"))


@pytest.mark.integration
def test_a_base_model_without_a_chat_template_runs_chat_workloads_as_raw_text(tmp_path, monkeypatch, base_model_dir):
    overrides = ["target=hf", f"target.path={base_model_dir}", "workload=mtbench", "workload.num_prompts=2",
                 "max_new_tokens=6", "drafter=ngram", "logger=none"]
    with monkeypatch.context() as patched:
        forbid_model_loading(patched)
        with pytest.raises(cli.SpecdecUserError, match="no chat template .* workload.chat=false"):
            run_in_process(tmp_path, overrides)
    results = run_in_process(tmp_path, [*overrides, "workload.chat=false"])
    assert results["greedy_equal"] is True and results["generated_tokens"] == 12
    first = read_jsonl(tmp_path / "prompts.jsonl")[0]
    assert first["prompt_tokens"] == len(load_mtbench(1)[0].text)  # one token per character: the raw text


@pytest.mark.integration
def test_a_draft_model_with_another_vocabulary_is_refused(tmp_path, tiny_model_dir):
    other = tmp_path / "other-vocab"
    tiny_model("llama", vocab_size=96).save_pretrained(other)
    overrides = ["target=hf", f"target.path={tiny_model_dir}", "workload=synthetic", "drafter=draft_model",
                 f"drafter.model_path={other}"]
    with pytest.raises(cli.SpecdecUserError, match="vocabulary"):
        run_in_process(tmp_path, overrides)


def test_an_interrupted_write_leaves_no_partial_file(tmp_path, monkeypatch):
    destination = tmp_path / "results.json"

    def interrupt(source, target):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupt)
    with pytest.raises(KeyboardInterrupt):
        outputs.write_file(destination, b'{"tau": 2.0}')
    assert list(tmp_path.iterdir()) == []


def test_the_command_line_reports_bad_input_in_one_line_and_exits_nonzero(tmp_path):
    done = run_command([*SMALL, "sampling.temperature=-1", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["specdec-run: error: temperature must be >= 0 (0 = greedy); got -1.0"]
    assert not (tmp_path / "run" / "results.json").exists()


@pytest.mark.parametrize("args, message", [  # a sweep's bad choice in the fast tier, the others with integration
    pytest.param(["drafter=nope"], "unknown drafter 'nope'; choose one of dflash, domino, ", marks=pytest.mark.integration),
    pytest.param(["verifier=fast"], "unknown verifier 'fast'; choose one of auto, block, ", marks=pytest.mark.integration),
    (["-m", "drafter=ngram,nope"], "unknown drafter 'nope'; choose one of dflash, domino, "),
])
def test_an_unknown_config_choice_is_one_line_listing_the_choices(tmp_path, args, message):
    done = run_command([*args, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"specdec-run: error: {message}")
    assert not (tmp_path / "run").exists()  # refused before Hydra made the run dir


@pytest.mark.integration
def test_the_command_line_names_the_drafter_by_its_config_as_rivals_are_named(tmp_path):
    # ngram_self.yaml builds the ngram factory: "ngram" would not tell the two configs apart
    done = run_command([*SMALL, "drafter=ngram_self", "rivals=[ngram]", "logger=none", f"hydra.run.dir={tmp_path}"], tmp_path)
    assert done.returncode == 0, done.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["drafter"] == "ngram_self" and [r["drafter"] for r in results["rivals"]] == ["ngram"]


@pytest.mark.integration
def test_a_multirun_sweep_makes_one_run_dir_per_point(tmp_path):
    sweep = tmp_path / "sweep"
    args = ["-m", *SMALL, "workload.num_prompts=2", "logger=none", "sampling.temperature=0,1",
            f"hydra.sweep.dir={sweep}"]
    done = run_command(args, tmp_path)
    assert done.returncode == 0, done.stderr
    temperatures = sorted(json.loads((sweep / job / "results.json").read_text())["temperature"] for job in ("0", "1"))
    assert temperatures == [0.0, 1.0]


@pytest.mark.slow
def test_the_default_main_job_on_smollm2(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "experiments.run", "workload.num_prompts=2", "max_new_tokens=16",
         f"hydra.run.dir={tmp_path}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env,
    )
    assert done.returncode == 0, done.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["drafter"] == "union" and results["target"] == "SmolLM2-135M-Instruct"
    assert results["greedy_equal"] is True and results["tau"] >= 1
    prompts = read_jsonl(tmp_path / "prompts.jsonl")
    assert [p["category"] for p in prompts] == ["writing", "writing"] and all(p["text"] for p in prompts)


class _Decoded:
    def __init__(self, outputs: dict[str, list[list[int]]]) -> None:
        self.outputs = outputs

    def decoded(self, side: str):
        return types.SimpleNamespace(outputs=self.outputs[side])


def test_equal_tokens_count_plain_decodings_tokens_up_to_each_first_divergence():
    unit = _Decoded({"spec": [[1, 2, 3, 4], [5, 6], [7, 8, 9]], summary.BASELINE: [[1, 2, 0, 4], [5, 6], [7, 8]]})
    # 2 of 4 before the divergence, 2 of 2, and a speculative answer that runs on: 2 of 2
    assert summary.equal_token_share([unit], "spec") == 6 / 8
