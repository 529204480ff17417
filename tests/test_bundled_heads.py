"""The bundled heads as artifacts: drafters/checkpoints/MANIFEST.json lists every one with the bytes
and sha256 of its files, a damaged one is refused in one line before a target loads, the int8-rows
storage reads back as the head it was saved as, and the tracked tree stays small enough to travel
whole to a lent GPU machine."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from drafters.bundled import BUNDLED, MANIFEST, file_record, read_manifest, verified
from drafters.head_storage import INT8_ROWS, SCALE_SUFFIX, compact_int8_rows, read_weights, weight_shapes

ROOT = Path(__file__).resolve().parents[1]
ACCEPTANCE = ROOT / "tests" / "data" / "acceptance_tau.json"
TREE_LIMIT = 64 * 2**20  # what one call of the lent GPU machine carries, the working tree included


def test_the_manifest_lists_every_bundled_head_with_its_bytes_and_digest():
    heads = read_manifest()
    folders = {path.parent.name for path in BUNDLED.glob("*/config.json")}
    assert folders == set(heads), "drafters/checkpoints and MANIFEST.json list different heads"
    for name, head in heads.items():
        assert name == f"{head.drafter}-{head.target}"
        assert (ROOT / "configs" / "drafter" / f"{head.drafter}.yaml").is_file(), name
        assert (ROOT / "configs" / "target" / f"{head.target}.yaml").is_file(), name
        assert head.storage in ("saved", INT8_ROWS) and head.command.startswith("specdec-train") and head.commit, name
        for file, record in head.files.items():
            assert file_record(BUNDLED / name / file) == record, f"{name}/{file}"
        assert verified(BUNDLED / name) == BUNDLED / name


def test_each_head_is_held_to_the_tau_the_acceptance_regression_records():
    recorded = json.loads(ACCEPTANCE.read_text())["tau"]
    for name, head in read_manifest().items():
        assert head.tau is not None and head.tau == recorded.get(head.target, {}).get(head.drafter), (
            f"{name}: the manifest's tau {head.tau} is not tests/data/acceptance_tau.json's; run scripts/bundle_head.py again")


def damaged_copy(tmp_path: Path, monkeypatch, name: str) -> Path:
    """drafters/checkpoints as the manifest and ``name`` alone, one byte of its weights flipped, in
    place of the bundled folder."""
    from drafters import bundled, heads

    folder = tmp_path / "checkpoints"
    shutil.copytree(BUNDLED / name, folder / name)
    shutil.copyfile(MANIFEST, folder / MANIFEST.name)
    weights = folder / name / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    monkeypatch.setattr(heads, "BUNDLED", folder)
    monkeypatch.setattr(bundled, "MANIFEST", folder / MANIFEST.name)
    return weights


def test_a_damaged_bundled_head_is_refused_in_one_line_before_the_target_loads(tmp_path, monkeypatch):
    from hydra import compose, initialize_config_dir

    from experiments.cli import SpecdecUserError
    from experiments.run import schema
    from specdec.packaged_models import PACKAGED_MODELS

    weights = damaged_copy(tmp_path, monkeypatch, "eagle3-smollm2")
    converted = tmp_path / "cache" / PACKAGED_MODELS["smollm2"].cache_name  # as converted: only config.json is read
    converted.mkdir(parents=True)
    sizes = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "num_hidden_layers": 30}
    (converted / "config.json").write_text(json.dumps(sizes))
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    with initialize_config_dir(config_dir=str(schema.CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["drafter=eagle3"])
    with pytest.raises(SpecdecUserError) as error:
        schema.checked_settings(cfg)
    assert str(weights) in str(error.value) and "not the bundled file" in str(error.value)
    assert "\n" not in str(error.value)


def test_int8_rows_read_back_as_the_saved_head_within_half_a_step(tmp_path):
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(0)
    saved = {
        "layer.weight": (torch.randn(64, 96, generator=generator) * 0.05).half(),
        "stack.weight": torch.randn(3, 40, 128, generator=generator).half(),
        "norm.weight": torch.rand(96, generator=generator).half(),  # a vector: kept as saved
        "small.weight": torch.randn(4, 8, generator=generator).half(),  # under MIN_ELEMENTS: kept
        "draft_ids": torch.arange(10, dtype=torch.int64),
    }
    saved["layer.weight"][5] = 0  # an all-zero row stays zero
    stored, metadata = compact_int8_rows(saved)
    assert stored["layer.weight"].dtype == torch.int8 and stored["layer.weight" + SCALE_SUFFIX].shape == (64,)
    assert stored["stack.weight" + SCALE_SUFFIX].shape == (3, 40) and "norm.weight" + SCALE_SUFFIX not in stored
    path = tmp_path / "model.safetensors"
    save_file(stored, str(path), metadata=metadata)
    assert path.stat().st_size < 0.6 * sum(t.numel() * t.element_size() for t in saved.values())
    back = read_weights(path)
    assert set(back) == set(saved) and weight_shapes(path) == {k: tuple(v.shape) for k, v in saved.items()}
    for name, tensor in saved.items():
        assert back[name].dtype == tensor.dtype, name
        if name in ("layer.weight", "stack.weight"):
            # half a step of the row's int8 grid, then the rounding back to the saved dtype
            step = tensor.float().abs().amax(-1, keepdim=True) / 127
            bound = step / 2 + back[name].float().abs() * torch.finfo(tensor.dtype).eps + 1e-7
            assert ((back[name].float() - tensor.float()).abs() <= bound).all(), name
        else:
            assert torch.equal(back[name], tensor), name
    assert torch.equal(back["layer.weight"][5], torch.zeros(96, dtype=torch.float16))


def test_a_file_in_a_storage_this_version_does_not_read_is_refused(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(2, 2)}, str(path), metadata={"format": "pt", "specdec_storage": "int3-magic"})
    with pytest.raises(ValueError, match="stored as 'int3-magic', which this specdec does not read"):
        read_weights(path)
    with pytest.raises(ValueError, match="one floating dtype"):
        compact_int8_rows({"a": torch.zeros(64, 64), "b": torch.zeros(64, 64, dtype=torch.float16)})


def test_the_tracked_tree_travels_whole_to_a_gpu_machine():
    """Every call of the lent GPU machine carries the working tree, 64 MiB at most."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    paths = [ROOT / name for name in listed.stdout.decode().split("\0") if name]
    total = sum(path.stat().st_size for path in paths if path.is_file())
    assert total < TREE_LIMIT, f"the tracked tree holds {total / 2**20:.1f} MiB, over the {TREE_LIMIT / 2**20:.0f} MiB a call carries"
