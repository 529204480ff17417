"""Acceptance cannot regress silently: every bundled drafter's tau at T = 0 on the real packaged
targets, on a fixed small prompt set, against the value recorded in tests/data/acceptance_tau.json.

At T = 0 tau is deterministic (greedy drafts, greedy verification, no noise), so a drafter whose
acceptance drops (a head loaded wrongly, a tree built differently, a contract broken in a way that
stays lossless) shows here even when every exactness test passes. Each drafter runs as specdec-run
would build it (its configs/drafter/NAME.yaml, composed by Hydra with the target), and its output
must also be plain greedy decoding, token for token.

On SmolLM2 every config in configs/drafter/ is tried but ``none`` (no drafter) and the synthetic
target's drafter. One that does not build with nothing of the user's (draft_model's model_path, a
head not bundled for SmolLM2) is skipped, unless a tau is recorded for it: a recorded drafter that
stops building fails. On Gemma 3 270M the drafters of its bundled heads (drafters/checkpoints/MANIFEST.json)
are tried, and the unions that draft with its EAGLE-3 head. A new drafter that builds fails until
its tau is recorded:

    SPECDEC_RECORD_TAU=1 .venv/bin/python -m pytest -m slow tests/test_acceptance_regression.py -k NAME

Recording rewrites the drafter's entry in the data file (run without -k to re-record all); commit
the file with the reason the tau moved.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from test_configs import CONFIG_DIR, compose_run

from drafters.bundled import read_manifest
from experiments.cli import SpecdecUserError
from experiments.common.prompt_sets import encode_prompt, load_mtbench, packaged_target_chat
from experiments.run.build import build_drafter
from specdec.decode import SpecDecoder
from specdec.files import write_atomically
from specdec.packaged_models import converted_path, load_packaged
from specdec.sampling import SamplingParams
from specdec.target import HFTarget
from verifiers import reference

pytestmark = pytest.mark.slow

DATA = Path(__file__).parent / "data" / "acceptance_tau.json"
RECORD = "SPECDEC_RECORD_TAU"
RERECORD = f"{RECORD}=1 .venv/bin/python -m pytest -m slow tests/test_acceptance_regression.py -k NAME"
# the first MT-bench questions (raw text on a base model), greedy, one batch; the file records the
# setting its taus belong to
SETTING = {"dtype": "float32", "prompts": 3, "max_new_tokens": 32, "temperature": 0.0}
TARGETS = ("smollm2", "gemma3_270m")
# a tau is tokens per step over ~50-90 steps here: one acceptance more or fewer moves it by ~0.01-0.02.
# T = 0 makes it deterministic on one machine; the margin covers a CPU whose kernels round differently
# enough to flip a near-tie once or twice, and nothing a real regression does
TOLERANCE = 0.05
# the budgeted unions time T(n) when they are built, which would make their trees (and tau) depend
# on the machine's load: a T(n) measured once stands in for it
TN = Path(__file__).parents[1] / "docs" / "data" / "tn"
FIXED_COSTS = {"smollm2": TN / "tn-smollm2-cpu.csv", "gemma3_270m": TN / "tn-gemma3_270m-cpu.csv"}
SYNTHETIC_ONLY = {"synthetic"}  # drafters for the synthetic target
GEMMA_UNIONS = ("union", "union_adaptive")  # they draft with its bundled EAGLE-3 head


def drafter_configs(target: str) -> list[str]:
    if target == "gemma3_270m":
        heads = {head.drafter for head in read_manifest().values() if head.target == target}
        return sorted(heads | set(GEMMA_UNIONS))
    names = []
    for path in sorted((CONFIG_DIR / "drafter").glob("*.yaml")):
        if OmegaConf.load(path).get("name") is not None and path.stem not in SYNTHETIC_ONLY:
            names.append(path.stem)
    return names


def drafter_options(target: str, name: str) -> dict:
    """The drafter's options as specdec-run composes them on ``target`` (budgeted unions with fixed costs)."""
    overrides = [f"target={target}", f"drafter={name}"]
    if compose_run(overrides).drafter.get("costs") == "measure":
        overrides.append(f"drafter.costs={FIXED_COSTS[target]}")
    return OmegaConf.to_container(compose_run(overrides).drafter, resolve=True)


def read_records() -> dict:
    return json.loads(DATA.read_text()) if DATA.is_file() else {"setting": SETTING, "tau": {}}


@functools.cache
def plain_decoding(target_name: str):
    """The target (stock kernels: no timing decides anything here), its tokenizer, the prompts and
    plain decoding's outputs on them; loaded once per target for every drafter."""
    model, tokenizer = load_packaged(target_name)
    target = HFTarget(model, key=target_name, folder=converted_path(target_name))
    chat = packaged_target_chat(target_name)
    prompts = [encode_prompt(tokenizer, dataclasses.replace(p, chat=chat)) for p in load_mtbench(SETTING["prompts"])]
    plain = SpecDecoder(target, None, reference.verify).generate(
        prompts, SETTING["max_new_tokens"], SamplingParams(0.0), eos_token_id=tokenizer.eos_token_id
    )
    return target, tokenizer, prompts, plain


@pytest.mark.parametrize("target_name,name", [(t, n) for t in TARGETS for n in drafter_configs(t)])
def test_tau_at_temperature_zero_is_the_recorded_one(target_name, name):
    target, tokenizer, prompts, plain = plain_decoding(target_name)
    records = read_records()
    recording = bool(os.environ.get(RECORD))
    recorded = records["tau"].get(target_name, {}).get(name)
    options = drafter_options(target_name, name)
    mandatory = [key for key, value in options.items() if value == "???"]  # OmegaConf's missing value
    if mandatory and recorded is None:
        pytest.skip(f"drafter={name} needs {', '.join(mandatory)} of the user's")
    try:
        drafter = build_drafter(options, target)
    except SpecdecUserError as error:
        if recorded is None:
            pytest.skip(f"drafter={name} does not run on {target_name} with bundled weights alone: {error}")
        raise
    out = SpecDecoder(target, drafter, reference.verify).generate(
        prompts, SETTING["max_new_tokens"], SamplingParams(0.0), eos_token_id=tokenizer.eos_token_id
    )
    assert out.outputs == plain.outputs, f"drafter={name}: greedy output differs from plain decoding on {target_name}"
    tau = round(out.stats.tau, 4)
    if recording:
        if records["setting"] != SETTING:  # taus of another setting would be compared with these
            records = {"setting": SETTING, "tau": {}}
        records["tau"].setdefault(target_name, {})[name] = tau
        write_atomically(DATA, lambda path: path.write_text(json.dumps(records, indent=2, sort_keys=True) + "\n"))
        pytest.skip(f"recorded tau {tau} for drafter={name} on {target_name} in {DATA}")
    assert records["setting"] == SETTING, (
        f"{DATA} holds taus for {records['setting']}, this test measures {SETTING}: re-record them all: {RERECORD}"
    )
    assert recorded is not None, f"no tau recorded for drafter={name} on {target_name} (measured {tau}); record it: {RERECORD}"
    assert abs(tau - recorded) <= TOLERANCE, (
        f"drafter={name} on {target_name}: tau {tau} at T = 0 moved from the recorded {recorded} by more than "
        f"{TOLERANCE}. If the change is deliberate, re-record it ({RERECORD}) and commit {DATA.name} saying why"
    )


def test_every_recorded_tau_names_a_drafter_config():
    """A drafter removed from configs/drafter/ takes its record with it (else the file holds a tau no test checks)."""
    stale = sorted(f"{target}: {name}" for target, taus in read_records()["tau"].items()
                   for name in set(taus) - set(drafter_configs(target)))
    assert not stale, f"{DATA} records taus for drafters with no config: {', '.join(stale)}; remove them"
