"""Sweeps on a cluster launcher: configs/hydra/launcher/slurm.yaml composes against the submitit
plugin's schema, and configs/hydra/launcher/local.yaml runs a synthetic sweep through submitit's
local executor, the SLURM launcher's own path (each point pickled, run in a process of its own, its
result collected) without a cluster. Skipped without the `slurm` extra (pip install -e ".[slurm]")."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from experiments.run import schema

pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="needs the slurm extra: pip install -e '.[slurm]'")


def launcher(name: str, *overrides: str):
    with initialize_config_dir(config_dir=str(schema.CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"hydra/launcher={name}", *overrides], return_hydra_config=True)
    return cfg.hydra


def test_the_slurm_launcher_is_submitit_with_one_job_per_point():
    hydra_cfg = launcher("slurm", "hydra.launcher.partition=cpu")
    slurm = hydra_cfg.launcher
    assert slurm._target_.endswith("submitit_launcher.SlurmLauncher")
    assert (slurm.nodes, slurm.tasks_per_node, slurm.cpus_per_task, slurm.partition) == (1, 1, 8, "cpu")
    assert slurm.submitit_folder.startswith(str(hydra_cfg.sweep.dir))  # job logs beside the sweep's run dirs


def test_a_misspelt_launcher_option_fails_at_compose_time():
    with pytest.raises(ConfigCompositionException, match="gpus_per_nod"):
        launcher("slurm", "hydra.launcher.gpus_per_nod=2")


@pytest.mark.slow  # heavy: CI runs it after the default suite
def test_a_sweep_runs_as_submitit_jobs_and_each_point_writes_its_results(tmp_path):
    sweep = tmp_path / "sweep"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "experiments.run", "-m", "experiment=synthetic", "workload.num_prompts=2",
         "max_new_tokens=6", "logger=none", "threads=1", "sampling.temperature=0,1", "hydra/launcher=local",
         f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # one submitit job per point, each its own process: its own log and its pickled result
    jobs = sorted(p for p in (sweep / ".submitit").iterdir() if p.name.isdigit())
    assert len(jobs) == 2 and all(list(job.glob("*_result.pkl")) and list(job.glob("*_log.out")) for job in jobs)
    for job_num, temperature in enumerate([0.0, 1.0]):
        run_dir = sweep / str(job_num)
        results = json.loads((run_dir / "results.json").read_text())
        assert results["overrides"] == yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text())
        assert f"sampling.temperature={temperature:g}" in results["overrides"]
        assert (results["temperature"], results["num_prompts"], results["max_new_tokens"]) == (temperature, 2, 6)
        assert results["tau"] >= 1 and results["generated_tokens"] == 12
        assert results["greedy_equal"] is (True if temperature == 0 else None)  # None: sampled, not comparable


def test_without_the_plugin_the_launcher_option_is_one_line_naming_the_extra(monkeypatch):
    import importlib.util

    from experiments import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "hydra_plugins.hydra_submitit_launcher" else real(name, *a))
    for name in ("slurm", "local"):
        with pytest.raises(cli.CommandLineError, match=rf"hydra/launcher={name} needs the submitit launcher plugin.*"
                                                       r"pip install -e '\.\[slurm\]'"):
            cli.check_overrides(["drafter=ngram", f"hydra/launcher={name}"], schema.CONFIG_DIR, "config")
    cli.check_overrides(["drafter=ngram", "hydra/launcher=parallel"], schema.CONFIG_DIR, "config")  # joblib: installed
