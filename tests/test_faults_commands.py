"""The commands' promises under bad input and concurrency (issue 44): drafter checkpoints checked
from their configs and headers before the target loads, one run per run dir even when two start
at once, nothing of a refused run left behind, output locations that cannot take the output named
in one line, and specdec-export held to the same rules as specdec-run."""

from __future__ import annotations

import errno
import io
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from faults import files_of
from hydra import compose, initialize_config_dir
from rich.console import Console
from safetensors.torch import save_file
from tiny_models import tiny_model

from drafters.eagle import EagleConfig
from drafters.eagle_published import PublishedEagleHead
from drafters.heads import save_head
from drafters.medusa import MedusaConfig, MedusaHeads, save_heads, with_tree
from experiments import cli
from experiments.cli import LOCK_FILE, SpecdecUserError, exit_codes, hold_lock
from experiments.export import main as specdec_export
from experiments.run import build, command, schema
from specdec import target_loader
from specdec.target import HFTarget

SMALL = ["experiment=synthetic", "workload.num_prompts=3", "max_new_tokens=12", "logger=none"]


def run_in_process(run_dir: Path, overrides: list[str]) -> dict:
    with initialize_config_dir(config_dir=str(schema.CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    return command.run(cfg, run_dir, Console(file=io.StringIO()))


def specdec_run(args: list[str], cwd: Path, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "experiments.run", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


def finished(process: subprocess.Popen) -> tuple[int, str]:
    _, err = process.communicate(timeout=300)
    return process.returncode, err


def one_line(err: str, program: str = "specdec-run") -> str:
    lines = [line for line in err.strip().splitlines() if not line.startswith("Generating train split")]
    assert len(lines) == 1 and lines[0].startswith(f"{program}: error: "), err
    return lines[0]


def forbid_loading(monkeypatch) -> None:
    """Any model load, or the target's opening, fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model loaded before the bad input was reported")

    monkeypatch.setattr(target_loader, "load_hf_target", refuse)
    monkeypatch.setattr(build, "open_target", refuse)


# -- 1, 2: drafter checkpoints, checked before the target loads -------------------------------------


@pytest.fixture(scope="module")
def tiny() -> HFTarget:
    return HFTarget(tiny_model("llama"))  # hidden 64, vocabulary 128, 2 layers


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, tiny) -> Path:
    folder = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    tiny.model.save_pretrained(folder)
    return folder


def medusa_heads(target: HFTarget) -> MedusaHeads:
    return with_tree(MedusaHeads(MedusaConfig.for_target(target, 3, 40), torch.arange(40)), [[0.5], [0.2], [0.1]],
                     [(0,), (0, 0)])


class Payload:
    """A pickle that would write ``marker`` if it were ever unpickled without weights_only."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "executed"))


def damaged(kind: str, folder: Path, target: HFTarget) -> tuple[list[str], str]:
    """A checkpoint folder damaged as ``kind``: the drafter overrides that use it and the message expected."""
    if kind == "empty folder":
        folder.mkdir()
        return ["drafter=medusa"], "holds no Medusa checkpoint"
    if kind in ("cut short", "corrupt config", "more heads than weights"):
        save_heads(medusa_heads(target), folder)
        if kind == "cut short":
            weights = folder / "model.safetensors"
            weights.write_bytes(weights.read_bytes()[:-1000])
            return ["drafter=medusa"], "Medusa checkpoint .* is corrupt or incomplete: .* is cut short"
        config = json.loads((folder / "config.json").read_text())
        if kind == "corrupt config":
            (folder / "config.json").write_text(json.dumps(config)[:-5])
            return ["drafter=medusa"], "Medusa checkpoint .* is corrupt or incomplete"
        config["medusa"]["num_heads"] = 4
        (folder / "config.json").write_text(json.dumps(config))
        return ["drafter=medusa"], r"does not match its config: weight is \[3, 64, 64\], the config's \[4, 64, 64\]"
    if kind == "another target":
        save_heads(medusa_heads(HFTarget(tiny_model("llama", vocab_size=100))), folder)
        return ["drafter=medusa"], "trained for another target .*vocabulary: checkpoint 100, target 128"
    if kind == "pickled code":
        folder.mkdir()
        torch.save({"0.0.linear.weight": Payload(folder.parent / "executed")}, folder / "medusa_lm_head.pt")
        (folder / "config.json").write_text(json.dumps({"medusa_num_heads": 1, "medusa_num_layers": 1}))
        return ["drafter=medusa"], "is not a plain state dict of tensors"
    folder.mkdir()
    if kind == "eagle pickled code":
        torch.save({"fc.weight": Payload(folder.parent / "executed")}, folder / "pytorch_model.bin")
        (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
        return ["drafter=eagle3"], "not a plain state dict"
    head = PublishedEagleHead(EagleConfig.for_target(target, (0, 1, 1), 48, "eagle3"), torch.arange(48))
    save_file({f"midlayer.{k}": v.contiguous() for k, v in head.state_dict().items()}, str(folder / "model.safetensors"))
    if kind == "eagle3 without config":
        return ["drafter=eagle3", "drafter.format=eagle3"], "holds no published EAGLE or EAGLE-3 head"
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"], ')
    return ["drafter=eagle3", "drafter.format=eagle3"], "config.json is not valid JSON"


KINDS = ["empty folder", "cut short", "corrupt config", "more heads than weights", "another target", "pickled code",
         "eagle pickled code", "eagle3 without config", "eagle3 corrupt config"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_checkpoint_is_refused_before_the_target_loads(tmp_path, monkeypatch, tiny, tiny_folder, kind):
    overrides, message = damaged(kind, tmp_path / "head", tiny)
    forbid_loading(monkeypatch)
    with pytest.raises(SpecdecUserError, match=message):
        run_in_process(tmp_path / "run", ["target=hf", f"target.path={tiny_folder}", "workload=synthetic", *overrides,
                                          f"drafter.checkpoint={tmp_path / 'head'}"])
    assert not (tmp_path / "run").exists() and not (tmp_path / "executed").exists()


def test_the_same_checks_pass_a_sound_checkpoint_and_refuse_a_drafter_the_target_cannot_run(tmp_path, tiny, tiny_folder):
    save_heads(medusa_heads(tiny), tmp_path / "head")
    sizes = target_loader.target_sizes(target_loader.TargetConfig(name="hf", path=str(tiny_folder)))
    assert (sizes.vocab_size, sizes.hidden_size, sizes.num_layers) == (128, 64, 2)
    from drafters.base import check_options

    check_options("medusa", {"checkpoint": str(tmp_path / "head")}, sizes)  # the control: nothing to refuse
    with pytest.raises(ValueError, match="needs target=synthetic"):
        check_options("synthetic", {}, sizes)
    with pytest.raises(ValueError, match="needs a model target, a HeadTarget"):
        check_options("medusa", {"checkpoint": str(tmp_path / "head")},
                      target_loader.target_sizes(target_loader.TargetConfig(name="synthetic")))


@pytest.mark.parametrize("drafter, head_for, message", [
    ("dflash", "another target", "made for another target .*vocabulary: head 100, target 128"),
    ("domino", "dflash", "holds a DFlash head, not a Domino one; use drafter=dflash"),
    ("dflash", None, "no dflash head is bundled for .*specdec-train train=dflash"),
])
def test_a_block_head_that_cannot_run_is_refused_before_the_target_loads(tmp_path, monkeypatch, tiny, tiny_folder,
                                                                          drafter, head_for, message):
    from drafters.dflash import DFlashConfig, DFlashHead
    from drafters.formats.load import save_dflash

    checkpoint = []
    if head_for is not None:
        on = HFTarget(tiny_model("llama", vocab_size=100)) if head_for == "another target" else tiny
        save_dflash(DFlashHead(DFlashConfig.for_target(on, (1, 3), block_size=4, num_layers=1)), tmp_path / "head")
        checkpoint = [f"drafter.checkpoint={tmp_path / 'head'}"]
    forbid_loading(monkeypatch)
    with pytest.raises(SpecdecUserError, match=message):
        run_in_process(tmp_path / "run", ["target=hf", f"target.path={tiny_folder}", "workload=synthetic",
                                          "workload.num_prompts=2", f"drafter={drafter}", *checkpoint])
    assert not (tmp_path / "run").exists()


def test_smollm2s_sizes_come_from_its_packaged_gguf_without_a_conversion(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))  # no converted folder there
    sizes = target_loader.target_sizes(target_loader.TargetConfig(name="smollm2"))
    assert (sizes.vocab_size, sizes.hidden_size, sizes.num_layers) == (49152, 576, 30)
    assert not any(tmp_path.iterdir())


def test_an_empty_checkpoint_folder_on_the_command_line_is_one_line_and_no_run_dir(tmp_path, tiny_folder):
    (tmp_path / "empty").mkdir()
    rc, err = finished(specdec_run(["target=hf", f"target.path={tiny_folder}", "workload=synthetic", "drafter=medusa",
                                    f"drafter.checkpoint={tmp_path / 'empty'}", f"hydra.run.dir={tmp_path / 'run'}"],
                                   tmp_path))
    assert rc == 2 and "holds no Medusa checkpoint" in one_line(err)
    assert not (tmp_path / "run").exists()


# -- 3: one run per dir -------------------------------------------------------------------------------


def test_a_held_lock_refuses_a_second_holder_naming_the_first(tmp_path):
    lock = tmp_path / "run" / LOCK_FILE
    with hold_lock(lock, "the run dir", "wait"):
        assert lock.read_text() == f"process {os.getpid()}"
        with pytest.raises(SpecdecUserError, match=f"the run dir is in use by process {os.getpid()}; wait"):
            with hold_lock(lock, "the run dir", "wait"):
                pass
    assert not lock.exists()
    with hold_lock(lock, "the run dir", "wait"):  # free again once released
        pass


def test_a_lock_taken_but_not_yet_signed_names_its_holder_once_written(tmp_path):
    # a holder writes its pid just after taking the lock: a second process arriving in between
    # waits for the name rather than calling it "another process"
    import fcntl
    import threading

    lock = tmp_path / LOCK_FILE
    holder = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(holder, fcntl.LOCK_EX)
    signer = threading.Timer(0.05, lambda: os.pwrite(holder, b"process 4242", 0))
    signer.start()
    try:
        with pytest.raises(SpecdecUserError, match="the run dir is in use by process 4242; wait"):
            with hold_lock(lock, "the run dir", "wait"):
                pass
    finally:
        signer.join()
        os.close(holder)


@pytest.mark.integration  # a subprocess, as the two below; the fast tier keeps the empty checkpoint folder
def test_a_run_into_a_dir_in_use_is_refused_before_hydra_writes_anything(tmp_path):
    run_dir = tmp_path / "run"
    with hold_lock(run_dir / LOCK_FILE, "held by this test", "-"):
        rc, err = finished(specdec_run([*SMALL, f"hydra.run.dir={run_dir}"], tmp_path))
        assert rc == 2 and f"the run dir {run_dir} is in use by process {os.getpid()}" in one_line(err)
        assert [p.name for p in run_dir.iterdir()] == [LOCK_FILE]  # no .hydra/, no log


@pytest.mark.slow  # two real specdec-run processes
def test_two_runs_started_together_into_one_dir_leave_one_run(tmp_path):
    run_dir = tmp_path / "run"
    # each forward takes 40 ms of simulated time, so each run outlasts the other's start
    first, second = ([*SMALL, "target.forward_ms=40", f"seed={seed}", f"hydra.run.dir={run_dir}"] for seed in (0, 1))
    processes = [specdec_run(first, tmp_path), specdec_run(second, tmp_path)]
    (rc0, err0), (rc1, err1) = finished(processes[0]), finished(processes[1])
    assert sorted([rc0, rc1]) == [0, 2], (err0, err1)
    assert "is in use by process" in one_line(err1 if rc1 else err0)  # the holder's pid, read once written
    winner = 0 if rc0 == 0 else 1
    results = json.loads((run_dir / "results.json").read_text())
    assert results["seed"] == winner
    overrides = (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert f"seed={winner}" in overrides and f"seed={1 - winner}" not in overrides
    assert not (run_dir / LOCK_FILE).exists()


@pytest.mark.integration
def test_a_run_refused_after_hydra_started_leaves_no_run_dir(tmp_path):
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "   "}\n')
    rc, err = finished(specdec_run(["workload=jsonl", f"workload.path={tmp_path / 'prompts.jsonl'}", "drafter=ngram",
                                    f"hydra.run.dir={tmp_path / 'run'}"], tmp_path))
    assert rc == 2 and "'prompt' is empty" in one_line(err)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # two specdec-run processes
def test_a_refused_rerun_leaves_the_previous_run_whole(tmp_path):
    run_dir = tmp_path / "run"
    assert finished(specdec_run([*SMALL, f"hydra.run.dir={run_dir}"], tmp_path))[0] == 0
    before = files_of(run_dir) | {f".hydra/{p.name}": p.read_bytes() for p in (run_dir / ".hydra").iterdir()}
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "   "}\n')
    rc, err = finished(specdec_run(["workload=jsonl", f"workload.path={tmp_path / 'prompts.jsonl'}", "drafter=ngram",
                                    f"hydra.run.dir={run_dir}"], tmp_path))
    assert rc == 2 and "'prompt' is empty" in one_line(err)
    assert files_of(run_dir) | {f".hydra/{p.name}": p.read_bytes() for p in (run_dir / ".hydra").iterdir()} == before


# -- output locations ---------------------------------------------------------------------------------


READ_ONLY = Path("/proc/sys/specdec-test")  # a read-only file system on Linux, even for root


@pytest.mark.integration
def test_a_read_only_run_dir_is_one_line_before_anything_runs(tmp_path):
    rc, err = finished(specdec_run([*SMALL, f"hydra.run.dir={READ_ONLY}"], tmp_path))
    assert rc == 2 and f"the run dir {READ_ONLY}: cannot write there" in one_line(err)


def test_a_full_disk_or_read_only_file_is_one_line_with_exit_status_2(capsys):
    for number in (errno.ENOSPC, errno.EROFS):
        with pytest.raises(SystemExit) as exit:
            with exit_codes("specdec-run"):
                raise OSError(number, os.strerror(number), "/data/run/results.json")
        assert exit.value.code == 2
        assert one_line(capsys.readouterr().err).startswith("specdec-run: error: cannot write /data/run/results.json")
    with pytest.raises(OSError):  # any other OSError is a fault of the program: its traceback stays
        with exit_codes("specdec-run"):
            raise OSError(errno.EBADF, "Bad file descriptor")


# -- specdec-export -------------------------------------------------------------------------------------


def export_refused(args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit:
        specdec_export(args)
    assert exit.value.code == 2
    return one_line(capsys.readouterr().err, "specdec-export")


@pytest.fixture()
def eagle3_head(tmp_path, tiny) -> Path:
    save_head(PublishedEagleHead(EagleConfig.for_target(tiny, (0, 1, 1), 48, "eagle3"), torch.arange(48)), tmp_path / "head")
    return tmp_path / "head"


def test_export_bad_input_is_one_line_first_with_exit_status_2(tmp_path, capsys, eagle3_head):
    line = export_refused([str(eagle3_head), str(tmp_path / "out")], capsys)  # argparse: the line, no usage block
    assert "the following arguments are required: --engine" in line
    assert "invalid choice: 'tgi'" in export_refused([str(eagle3_head), str(tmp_path / "out"), "--engine", "tgi"], capsys)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.txt").write_text("mine")
    assert "holds more than an earlier export" in export_refused([str(eagle3_head), str(tmp_path / "notes"), "--engine",
                                                                  "vllm"], capsys)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{")
    assert "is not valid JSON" in export_refused([str(tmp_path / "broken"), str(tmp_path / "out"), "--engine", "vllm"], capsys)
    assert "not a writable folder" in export_refused([str(eagle3_head), str(READ_ONLY / "out"), "--engine", "vllm"], capsys)
    assert not (tmp_path / "out").exists()


def test_export_checks_the_head_against_its_config_before_loading(tmp_path, monkeypatch, capsys, tiny, eagle3_head):
    import safetensors

    # every reader of head weights opens them through drafters.head_storage.read_weights, with safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: pytest.fail("the weights were loaded"))
    weights = eagle3_head / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    assert "is cut short" in export_refused([str(eagle3_head), str(tmp_path / "out"), "--engine", "vllm"], capsys)
    save_heads(medusa_heads(tiny), tmp_path / "medusa")
    config = json.loads((tmp_path / "medusa" / "config.json").read_text())
    config["medusa"]["hidden_size"] = 4096  # over weights of hidden size 64
    (tmp_path / "medusa" / "config.json").write_text(json.dumps(config))
    line = export_refused([str(tmp_path / "medusa"), str(tmp_path / "out"), "--engine", "vllm"], capsys)
    assert r"does not match its config: weight is [3, 64, 64], the config's [3, 4096, 4096]" in line
    assert not (tmp_path / "out").exists()


def test_a_killed_exports_half_written_folder_is_removed_and_named_by_the_next(tmp_path, capsys, eagle3_head):
    left = tmp_path / ".out.k1ll3d.tmp" / "new"  # what replace_folder leaves when its writer is killed
    left.mkdir(parents=True)
    (left / "model.safetensors").write_bytes(b"\0" * 4096)
    specdec_export([str(eagle3_head), str(tmp_path / "out"), "--engine", "vllm"])
    assert f"removed {tmp_path / '.out.k1ll3d.tmp'}" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head", "out"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]


def test_an_export_that_would_fill_the_disk_is_refused_before_writing(tmp_path, monkeypatch, capsys, eagle3_head):
    from drafters import heads

    monkeypatch.setattr(heads.shutil, "disk_usage", lambda path: types.SimpleNamespace(free=1000))
    line = export_refused([str(eagle3_head), str(tmp_path / "out"), "--engine", "vllm"], capsys)
    assert f"cannot write {tmp_path / 'out'}: No space left" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head"]


def test_an_export_into_a_folder_another_export_is_writing_is_refused(tmp_path, capsys, eagle3_head):
    with hold_lock(tmp_path / ".out.lock", "held by this test", "-"):
        line = export_refused([str(eagle3_head), str(tmp_path / "out"), "--engine", "vllm"], capsys)
    assert f"the output folder {tmp_path / 'out'} is in use by process {os.getpid()}" in line
    assert not (tmp_path / "out").exists()


def test_pinning_the_run_dir_quotes_it_for_hydra():
    argv = ["prog", "seed=1", "hydra.run.dir=old"]
    cli.pin_output_dir(argv, Path("/tmp/it's here"))
    assert argv == ["prog", "seed=1", "hydra.run.dir='/tmp/it\\'s here'"]
    argv = ["prog", "-m", "seed=1,2"]
    cli.pin_output_dir(argv, Path("multirun/x"))
    assert argv[-1] == "hydra.sweep.dir='multirun/x'"

