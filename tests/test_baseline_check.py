"""Our plain decoding timed against transformers' generate() before the timed passes, and the headline
speedup against generate() where that is the faster plain decoder (experiments/run/baseline_check.py)."""

from __future__ import annotations

import pytest
from test_run_cli import read_jsonl, run_in_process, tiny_model_dir  # noqa: F401 (a fixture)

from experiments.common import records
from experiments.analyze import discover
from experiments.run import baseline_check, command

HF = ["workload=synthetic", "workload.num_prompts=3", "workload.prompt_length=12", "max_new_tokens=8",
      "drafter=ngram", "logger=none", "warmup_tokens=2"]


def test_an_hf_run_times_its_plain_decoding_against_generate_and_records_both_rates(tmp_path, tiny_model_dir):
    results = run_in_process(tmp_path, ["target=hf", f"target.path={tiny_model_dir}", *HF, "baseline_check_tokens=6"])
    check = results["baseline_check"]
    assert check["prompts"] == 3 and check["tokens"] == 6 and check["rounds"] == baseline_check.CHECK_ROUNDS
    assert check["tokens_per_s"] > 0 and check["tokens_per_s_generate"] > 0
    low, high = check["generate_over_ours_interval"]
    assert low <= check["generate_over_ours"] <= high
    sides = set(read_jsonl(tmp_path / "units.jsonl")[0]["seconds"])
    # generate() joins the timed passes exactly when the check found ours slower
    assert ("hf_generate" in sides) == check["ours_slower"]
    assert results["headline"]["against"] in ("baseline", "hf_generate")
    discover.read_run_dir(tmp_path, from_wandb=False)  # every interval, the headline's too, recomputes


def test_when_ours_is_slower_generate_joins_the_timed_passes(tmp_path, tiny_model_dir, monkeypatch):
    real = baseline_check.check_baseline
    monkeypatch.setattr(command, "check_baseline", lambda *args: {**real(*args), "ours_slower": True})
    results = run_in_process(tmp_path, ["target=hf", f"target.path={tiny_model_dir}", *HF, "baseline_check_tokens=32"])
    assert [peer["drafter"] for peer in results["peers"]] == ["hf_generate"]
    # no longer than the answers the prompts were checked for (max_new_tokens=8)
    assert results["baseline_check"]["ours_slower"] is True and results["baseline_check"]["tokens"] == 8


@pytest.mark.integration
def test_no_check_without_a_transformers_model_or_when_turned_off(tmp_path, tiny_model_dir):
    assert "baseline_check" not in run_in_process(tmp_path / "s", ["experiment=synthetic", "logger=none"])
    off = run_in_process(tmp_path / "o", ["target=hf", f"target.path={tiny_model_dir}", *HF, "baseline_check_tokens=0"])
    assert "baseline_check" not in off and off["headline"]["against"] == "baseline"


def unit(index: int, spec: float, base: float, generate: float) -> dict:
    """A units.jsonl row: 10 tokens per side per pass, the given seconds in each of two passes."""
    return {"unit": index, "prompt_ids": [str(index)], "tokens": {"baseline": 10, "speculative": 10, "hf_generate": 10},
            "seconds": {"baseline": [base, base], "speculative": [spec, spec], "hf_generate": [generate, generate]}}


@pytest.mark.parametrize("generate_seconds, against", [(0.8, "hf_generate"), (1.0, "baseline"), (1.2, "baseline")])
def test_the_headline_is_against_generate_only_where_it_was_faster_by_its_interval(generate_seconds, against):
    rows = [unit(i, 0.5 + 0.01 * i, 1.0 + 0.02 * (i % 3), generate_seconds + 0.02 * (i % 2)) for i in range(8)]
    spec_interval = records.speedup_interval(rows, "speculative", "baseline", 0)
    peer_interval = records.speedup_interval(rows, "hf_generate", "baseline", 0)
    ratio = records.speedup_interval(rows, "hf_generate", "speculative", 0)
    results = {"speedup": spec_interval.estimate, "speedup_interval": spec_interval.as_list(),
               "peers": [{"drafter": "hf_generate", "speedup_interval": peer_interval.as_list(),
                          "ratio_to_drafter": ratio.estimate}]}
    top = baseline_check.headline(results, rows, 0)
    assert top["against"] == against
    if against == "hf_generate":
        assert top["speedup"] == pytest.approx(1 / ratio.estimate)
        assert top["speedup"] < results["speedup"]  # generate() is faster than our baseline here
    else:
        assert top["speedup"] == results["speedup"]
