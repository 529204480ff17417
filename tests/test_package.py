"""specdec as an installed package: the configs are found inside it, its top-level names are checked
to be its own, and (integration) a wheel built from the checkout carries configs, heads and manifest."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_a_checkout_reads_its_configs_from_the_top_level_folder():
    from experiments.common.config_dir import CONFIG_DIR

    assert CONFIG_DIR == ROOT / "configs" and (CONFIG_DIR / "config.yaml").is_file()


def test_another_distributions_drafters_package_is_named_in_one_line(tmp_path):
    (tmp_path / "drafters").mkdir()
    (tmp_path / "drafters" / "__init__.py").write_text("")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", "import experiments"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert "the package 'drafters' here is not specdec's" in last and str(tmp_path / "drafters") in last


@pytest.mark.integration
def test_the_wheel_carries_the_configs_under_experiments_and_the_heads_with_their_manifest(tmp_path):
    """Built from a clone of HEAD, as a user's pip would: no top-level configs/, every config and
    every file the manifest lists."""
    from drafters.bundled import read_manifest

    clone = tmp_path / "src"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(clone)],
                   check=True)
    names = set(zipfile.ZipFile(next((tmp_path / "dist").glob("specdec-*.whl"))).namelist())
    configs = {f"experiments/configs/{p.relative_to(clone / 'configs')}" for p in (clone / "configs").rglob("*.yaml")}
    assert configs and configs <= names
    assert not [name for name in names if name.startswith("configs/")]
    heads = {f"drafters/checkpoints/{head}/{file}" for head, entry in read_manifest().items() for file in entry.files}
    assert heads <= names and "drafters/checkpoints/MANIFEST.json" in names
