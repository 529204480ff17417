"""Every entry point reaches a target by its registered name through specdec.target_loader, Gemma 3
included: specdec-run and specdec-train take target=NAME, the argparse scripts --target NAME (or a
model folder; build_datastore's older spelling --generate too). The loader is stopped before anything is read,
so no weights load and no GGUF is converted here."""

from __future__ import annotations

import re

import pytest
from hydra import compose, initialize_config_dir

from specdec.packaged_models import PACKAGED_MODELS
from specdec.target_loader import TargetConfig, target_argument


class Opened(Exception):
    """Raised by the stand-in loader with the TargetConfig the command asked for."""


def stop_at_the_loader(monkeypatch, module) -> None:
    def open_target(cfg: TargetConfig, with_tokenizer: bool):
        raise Opened(cfg)

    monkeypatch.setattr(module, "open_target", open_target)


def opened(call) -> TargetConfig:
    with pytest.raises(Opened) as stopped:
        call()
    return stopped.value.args[0]


@pytest.mark.parametrize("name", sorted(PACKAGED_MODELS))
def test_extract_features_takes_a_packaged_target(name, tmp_path, monkeypatch):
    from experiments import extract_features

    stop_at_the_loader(monkeypatch, extract_features)
    cfg = opened(lambda: extract_features.main(["--target", name, "--out", str(tmp_path / "f"), "--device", "cpu"]))
    assert (cfg.name, cfg.path, cfg.device) == (name, None, "cpu")


@pytest.mark.parametrize("name", sorted(PACKAGED_MODELS))
def test_bench_target_takes_a_packaged_target(name, monkeypatch):
    from benchmarks import bench_target

    stop_at_the_loader(monkeypatch, bench_target)
    cfg = opened(lambda: bench_target.main(["--target", name, "--dtype", "bfloat16", "--invariant", "yes"]))
    assert (cfg.name, cfg.dtype, cfg.invariant) == (name, "bfloat16", True)


@pytest.mark.parametrize("name", sorted(PACKAGED_MODELS))
def test_build_datastore_generates_with_a_packaged_target(name, tmp_path, monkeypatch):
    from experiments import build_datastore

    stop_at_the_loader(monkeypatch, build_datastore)
    cfg = opened(lambda: build_datastore.main(["--target", name, "--out", str(tmp_path / "ds")]))
    assert cfg.name == name
    cfg = opened(lambda: build_datastore.main(["--generate", name, "--out", str(tmp_path / "ds")]))
    assert (cfg.name, cfg.path) == (name, None)


def test_a_model_folder_is_target_hf_and_anything_else_is_refused_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert target_argument("--target", str(tmp_path), dtype="bfloat16") == TargetConfig(name="hf", path=str(tmp_path),
                                                                                        dtype="bfloat16")
    for value in ("hf", "synthetic", str(tmp_path / "none")):  # a registered name that is no model with weights, too
        with pytest.raises(ValueError, match=f"^--target {re.escape(value)}: not a packaged target \\(smollm2, gemma3_270m\\)"):
            target_argument("--target", value)


@pytest.mark.parametrize("target", ["gemma3_270m", "gemma3_270m_bf16", "smollm2", "smollm2_bf16"])
def test_specdec_run_takes_target_by_name_and_its_key_is_the_registered_name(target):
    from experiments.run import schema

    with initialize_config_dir(config_dir=str(schema.CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"target={target}", "drafter=none"])  # no head checked
    name = schema.checked_settings(cfg).target.name
    assert name == target.removesuffix("_bf16") and name in PACKAGED_MODELS  # a bf16 config opens the same model
