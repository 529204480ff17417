"""experiments.replay_union on the real model: the replayed plain union's tau equals the loop's
on the same prompts (both are deterministic functions of the greedy output), for the EAGLE-3 and
n-gram members of the bundled union_retrieval."""

from __future__ import annotations

import json
import re

import pytest
import torch
import yaml

from drafters.base import build
from experiments import replay_union
from experiments.run import CONFIG_DIR
from specdec import assets
from specdec.decode import SpecDecoder
from specdec.sampling import SamplingParams
from specdec.target import HFTarget
from verifiers.reference import verify

pytestmark = pytest.mark.slow


def test_the_replayed_union_matches_the_loop(tmp_path, capsys):
    torch.set_num_threads(2)
    model, tokenizer = assets.load_smollm2()
    target = HFTarget(model)
    questions = assets.load_mtbench(3)
    prompts = [assets.encode_prompt(tokenizer, q) for q in questions]
    members = yaml.safe_load((CONFIG_DIR / "drafter" / "union_retrieval.yaml").read_text())["members"]
    union = build("union", target, members=[m for m in members if m["name"] != "retrieval"])
    loop = SpecDecoder(target, union, verify).generate(prompts, 24, SamplingParams(0.0))
    rows = [{"id": q.id, "output": out} for q, out in zip(questions, loop.outputs)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    replay_union.main(["--run", str(tmp_path)])
    printed = capsys.readouterr().out
    taus = {line.split(" tau ")[0].strip(): float(re.search(r"tau (\S+)", line).group(1))
            for line in printed.splitlines() if " tau " in line}
    assert len(taus) == 4
    assert taus["union (EAGLE-3 + n-gram, every node)"] == pytest.approx(loop.stats.tau, abs=5e-4)  # printed to 3 decimals
