"""The measurement (experiments/run/measure.py): the order of the sides, the warm-up pass, and A/A
comparisons (a drafter against an identical copy of itself) that must come out even, in the first
unit as in later ones, once every side is warmed."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console
from test_run_cli import SMALL, forbid_model_loading, read_jsonl, run_in_process, tiny_model_dir  # noqa: F401 (a fixture)

from experiments import cli
from experiments.run.measure import Decoded, Plan, Request, measure
from specdec.sampling import SamplingParams


class Recorder:
    """A side that records who decoded, how far, and returns one token per prompt."""

    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls

    def decode(self, prompts, max_new_tokens, sampling, seeds, eos_token_id, max_batch) -> Decoded:
        self.calls.append((self.name, max_new_tokens))
        return Decoded([[0]] * len(prompts), None, [])


def test_the_sides_take_turns_after_a_warm_up_pass_of_every_unit():
    calls: list = []
    sides = {name: Recorder(name, calls) for name in "bsr"}
    requests = [Request(i, f"p{i}", "c", [1, 2]) for i in range(4)]
    plan = Plan(max_new_tokens=8, batch_size=1, group_size=1, seed=0, repeats=2, warmup_tokens=3,
                sampling=SamplingParams(), eos_token_id=None)
    units = measure(requests, sides, plan, Console(file=io.StringIO()))
    warm_up, timed = calls[:12], calls[12:]
    assert all(tokens == 3 for _, tokens in warm_up) and all(tokens == 8 for _, tokens in timed)
    order = "".join(name for name, _ in timed)
    # the side going first rotates with the unit and with the pass
    assert order == "bsr" "srb" "rbs" "bsr" + "srb" "rbs" "bsr" "srb"
    assert [len(unit.passes) for unit in units] == [2] * 4 and units[2].tokens("r") == 2


def test_without_warm_up_and_repeats_each_side_is_timed_once():
    calls: list = []
    sides = {name: Recorder(name, calls) for name in "bs"}
    plan = Plan(max_new_tokens=5, batch_size=1, group_size=2, seed=0, repeats=1, warmup_tokens=0,
                sampling=SamplingParams(), eos_token_id=None)
    units = measure([Request(i, f"p{i}", "c", [1]) for i in range(3)], sides, plan,
                    Console(file=io.StringIO()))
    assert calls == [("b", 5), ("s", 5), ("s", 5), ("b", 5)] and [len(u.requests) for u in units] == [2, 1]


# A synthetic target whose forwards cost a known time, plus a one-off cost the first time each shape
# runs (as kernel creation costs a CPU target); the drafter's rival is an identical copy of it.
A_A = [*SMALL, "workload.num_prompts=6", "max_new_tokens=10", "target.forward_ms=20", "target.new_shape_ms=300",
       "rivals=[synthetic]", "repeats=1", "logger=none"]


def unit_ratios(run_dir) -> list[float]:
    """Per unit: the rival's tokens/s over the drafter's (an A/A ratio)."""
    return [(row["tokens"]["synthetic"] / sum(row["seconds"]["synthetic"]))
            / (row["tokens"]["speculative"] / sum(row["seconds"]["speculative"]))
            for row in read_jsonl(run_dir / "units.jsonl")]


@pytest.mark.integration
def test_an_unwarmed_side_pays_for_the_shapes_it_meets_first(tmp_path):
    run_in_process(tmp_path, [*A_A, "warmup_tokens=0"])
    first, *rest = unit_ratios(tmp_path)
    assert first > 1.8  # the drafter met its tree shapes first in unit 1, its identical rival none
    assert max(rest) < 1.6


@pytest.mark.integration
def test_a_warmed_a_a_comparison_is_even_in_every_unit(tmp_path):
    results = run_in_process(tmp_path, [*A_A, "warmup_tokens=4"])
    assert all(0.6 < ratio < 1.6 for ratio in unit_ratios(tmp_path))  # timing noise only, the first unit too
    [rival] = results["rivals"]
    assert rival["ratio_to_drafter"] == pytest.approx(1.0, abs=0.15)
    assert json.loads((tmp_path / "results.json").read_text())["rivals"][0]["ratio_to_drafter_interval"]


@pytest.mark.integration
def test_transformers_peers_run_beside_the_drafters_on_the_same_units(tmp_path, tiny_model_dir):
    results = run_in_process(tmp_path, [
        "target=hf", f"target.path={tiny_model_dir}", "workload=synthetic", "workload.num_prompts=3",
        "workload.prompt_length=12", "max_new_tokens=8", "drafter=ngram", "logger=none", "warmup_tokens=2",
        "rivals=[hf_generate,hf_prompt_lookup,{peer: hf_early_exit, layers: 1}]",
    ])
    peers = {peer["drafter"]: peer for peer in results["peers"]}
    assert list(peers) == ["hf_generate", "hf_prompt_lookup", "hf_early_exit(layers=1)"]
    for peer in peers.values():
        assert peer["greedy_equal"] is True and peer["reproducible"] is True and "tau" not in peer
        assert peer["tokens_per_s"] > 0 and len(peer["speedup_interval"]) == 2
        low, high = peer["ratio_to_drafter_interval"]
        assert low <= peer["ratio_to_drafter"] <= high
    assert set(read_jsonl(tmp_path / "units.jsonl")[0]["seconds"]) == {"baseline", "speculative", *peers}


@pytest.mark.parametrize("overrides, message", [
    (["batch_size=2", "rivals=[hf_generate]"], "one prompt at a time .* batch_size=1; got batch_size=2"),
    (["rivals=[{peer: hf_prompt_lookup, tokens: 3}]"], "tokens"),
    (["rivals=[{peer: hf_nope}]"], "hf_nope"),
])
def test_bad_peer_entries_are_refused_before_loading(tmp_path, monkeypatch, tiny_model_dir, overrides, message):
    forbid_model_loading(monkeypatch)
    with pytest.raises(cli.SpecdecUserError, match=message):
        run_in_process(tmp_path, ["target=hf", f"target.path={tiny_model_dir}", "workload=synthetic", "drafter=ngram",
                                  *overrides])
