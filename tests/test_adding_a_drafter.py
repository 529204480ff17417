"""docs/adding-a-drafter.md, run as written: its module is imported from a temporary folder, its YAML
found through hydra.searchpath, and its command line runs specdec-run with budget.mode=auto,
drafter_quant and rivals (on a tiny model and a few short prompts instead of SmolLM2 and MT-bench)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import tiny_model

DOC = Path(__file__).resolve().parents[1] / "docs" / "adding-a-drafter.md"
SMALL = ["workload=synthetic", "workload.num_prompts=2", "workload.prompt_length=12", "max_new_tokens=8",
         "logger=none", "warmup_tokens=0", "repeats=1", "budget.max_depth=3", "budget.max_nodes=3",
         "budget.calibration_prompts=1"]


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), flags=re.S)


def specdec_run(args: list[str], folder: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "experiments.run", *args], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.integration  # specdec-run in a subprocess; the fast tier keeps the refusal below
def test_the_recipe_registers_a_drafter_from_a_module_of_its_own_and_runs_it(tmp_path):
    [module], [config], [command] = blocks("python"), blocks("yaml"), blocks("bash")
    (tmp_path / "bigram_drafter.py").write_text(module)
    (tmp_path / "my_configs" / "drafter").mkdir(parents=True)
    (tmp_path / "my_configs" / "drafter" / "bigram.yaml").write_text(config)
    words = shlex.split(command.replace("$PWD", str(tmp_path)).replace("\\\n", " "))
    assert words[0] == "specdec-run"
    tiny_model("llama", sharpness=4.0).save_pretrained(tmp_path / "tiny")
    run_dir = tmp_path / "run"
    done = specdec_run([*words[1:], "target=hf", f"target.path={tmp_path / 'tiny'}", *SMALL,
                        f"hydra.run.dir={run_dir}"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((run_dir / "results.json").read_text())
    assert results["drafter"] == "bigram" and results["greedy_equal"] is True
    assert results["budget"]["mode"] == "auto" and set(results["budget"]["chosen"]) == {"depth"}
    assert results["drafter_quant"]["scheme"] == "int8" and results["drafter_quant"]["tensors"] == 2
    assert [rival["drafter"] for rival in results["rivals"]] == ["ngram", "bigram(depth=1)"]
    assert all(rival["greedy_equal"] is True for rival in results["rivals"])


@pytest.mark.integration  # test_run_cli keeps an unknown choice named in one line
def test_without_its_module_the_drafter_is_one_line_naming_the_choices(tmp_path):
    (tmp_path / "my_configs" / "drafter").mkdir(parents=True)
    (tmp_path / "my_configs" / "drafter" / "bigram.yaml").write_text(blocks("yaml")[0])
    done = specdec_run([f"hydra.searchpath=[file://{tmp_path / 'my_configs'}]", "drafter=bigram",
                        "experiment=synthetic"], tmp_path)
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("specdec-run: error: unknown drafter 'bigram'") and "ngram" in line
