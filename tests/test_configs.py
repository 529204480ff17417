"""Every option of every config group composes against the structured schema and builds its objects
(lightning-hydra-template style); typos and unknown options fail at compose time.

target=smollm2 is composed and checked but not loaded by default; options that only fit the real
model (bundled EAGLE heads) are built in the slow suite.
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException
from rich.console import Console
from tiny_models import tiny_model

from drafters import base as drafter_registry
from drafters.base import DRAFTERS
from experiments.common import sinks
from experiments.common.sinks import SINKS, MetricSink
from experiments.run import build, schema, workloads
from experiments.run.workloads import WORKLOADS
from specdec import target_loader
from specdec.packaged_models import PACKAGED_MODELS
from specdec.sampling import SamplingParams
from specdec.synthetic import SyntheticTarget
from specdec.target import HFTarget
from specdec.target_loader import TARGETS
from verifiers.select import VERIFIERS

CONFIG_DIR = schema.CONFIG_DIR
PACKAGED = tuple(PACKAGED_MODELS)  # target=NAME and NAME_VARIANT, whose real weights load only in slow tests
# the groups of specdec-run's defaults list (configs/ also holds other entry points' groups)
GROUPS = [
    next(iter(entry))
    for entry in yaml.safe_load((CONFIG_DIR / "config.yaml").read_text())["defaults"]
    if isinstance(entry, dict)
]
OPTIONS = [(group, option.stem) for group in GROUPS for option in sorted((CONFIG_DIR / group).glob("*.yaml"))]


def needs_smollm2(group: str, option: str) -> bool:
    """Drafter configs whose bundled weights fit only the real target: built in the slow suite."""
    if group != "drafter":
        return False
    options = yaml.safe_load((CONFIG_DIR / group / f"{option}.yaml").read_text())
    return options["name"] is not None and drafter_registry.bundled_weights(options)


def compose_run(overrides: list[str], config_dir: Path = CONFIG_DIR, **kwargs):
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        return compose(config_name="config", overrides=overrides, **kwargs)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama", sharpness=4.0).save_pretrained(path)
    return path


def random_dflash_head(tiny: Path, tmp_path: Path) -> Path:
    """drafter=dflash bundles no head: a random one for the tiny target."""
    from transformers import AutoModelForCausalLM

    from drafters.dflash import DFlashConfig, DFlashHead

    from drafters.formats.load import save_dflash

    save_dflash(DFlashHead(DFlashConfig.for_target(HFTarget(AutoModelForCausalLM.from_pretrained(tiny)), block_size=4)),
                tmp_path / "dflash")
    return tmp_path / "dflash"


def companions(group: str, option: str, tiny: Path, tmp_path: Path) -> list[str]:
    """Overrides an option needs to be buildable in isolation (paths, a matching target)."""
    hf = ["target=hf", f"target.path={tiny}", "workload=synthetic"]
    if group == "target" and option == "hf":  # as shipped: its kernels timed when it loads
        return [*hf, "drafter=ngram"]  # the default drafter's bundled heads fit SmolLM2 only (refused before loading)
    hf.append("target.packed_gemm_from=null")  # a drafter's build needs no kernel timing of the tiny target
    if group == "target" and option.startswith(PACKAGED):
        return []
    if group == "drafter" and option == "draft_model":
        return [*hf, f"drafter.model_path={tiny}"]
    if group == "drafter" and option == "dflash":
        return [*hf, f"drafter.checkpoint={random_dflash_head(tiny, tmp_path)}"]
    if needs_smollm2(group, option):
        return []  # the default target
    if group == "drafter" and option != "synthetic":
        return hf  # drafters for real models
    if group == "workload" and option == "jsonl":
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text('{"prompt": "Say hello."}\n{"prompt": "Count to three."}\n')
        return [f"workload.path={prompts}"]
    if group == "workload" and option == "specbench":
        questions = tmp_path / "question.jsonl"
        questions.write_text('{"question_id": 1, "category": "qa", "turns": ["Say hello.", "Again."]}\n')
        return [f"workload.path={questions}"]
    return ["experiment=synthetic"] if group not in ("experiment", "workload") else []


def test_every_group_has_options_and_the_defaults_exist():
    assert {"target", "drafter", "verifier", "sampling", "workload", "logger", "experiment"} <= set(GROUPS)
    cfg = compose_run([])
    settings = schema.checked_settings(cfg)
    assert (settings.target.name, settings.drafter["name"], settings.workload.name) == ("smollm2", "union", "mtbench")
    assert (settings.max_new_tokens, settings.workload.num_prompts, settings.sampling.temperature) == (64, 8, 0.0)
    assert settings.logger.name == "jsonl" and settings.batch_size == 1


@pytest.mark.parametrize(
    "group,option",
    [
        pytest.param(group, option, id=f"{group}={option}",
                     marks=[pytest.mark.slow] if needs_smollm2(group, option) else [])
        for group, option in OPTIONS
    ],
)
def test_every_option_composes_and_builds(group, option, tiny_model_dir, tmp_path):
    cfg = compose_run([f"{group}={option}", *companions(group, option, tiny_model_dir, tmp_path)])
    settings = schema.checked_settings(cfg)
    if group == "target":
        if option.startswith(PACKAGED):  # loading the real model is the slow tests' job
            assert settings.target.name == option.removesuffix("_bf16")
            assert (settings.target.dtype, settings.target.invariant) == (
                ("bfloat16", True) if option.endswith("_bf16") else ("float32", None))
            return
        target = target_loader.open_target(settings.target, with_tokenizer=False).load()
        assert isinstance(target, (HFTarget, SyntheticTarget)) and target.vocab_size > 0
    elif group == "drafter":
        target = target_loader.open_target(settings.target, with_tokenizer=False).load()
        drafter = build.build_drafter(settings.drafter, target)
        assert (drafter is None) == (option == "none")
        if drafter is not None:
            assert callable(drafter.propose) and callable(drafter.commit)
    elif group == "verifier":
        assert callable(build.make_verifier(settings.verifier, target_loader.target_device(settings.target)))
    elif group == "sampling":
        assert isinstance(build.make_sampling(settings.sampling), SamplingParams)
    elif group == "workload":
        texts = workloads.load_texts(settings.workload)
        if texts is None:  # synthetic: token ids for whatever target
            handle = target_loader.open_target(compose_run(["target=synthetic"]).target, with_tokenizer=False)
            requests = workloads.make_requests(settings.workload, None, handle, settings.max_new_tokens)
            assert len(requests) == settings.workload.num_prompts
        else:
            assert texts and all(p.text.strip() for p in texts)
    elif group == "logger":
        sink = sinks.make_sink(
            settings.logger.name, tmp_path, Console(file=io.StringIO()), {"test": True},
            settings.logger.project, settings.logger.mode,
        )
        assert isinstance(sink, MetricSink)
        sink.log({"tau": 1.5}, step=0)
        sink.log_summary({"tau": 1.5})
        sink.finish()
    elif group == "experiment":
        assert settings.max_new_tokens >= 1
    else:
        pytest.fail(f"config group {group!r} has no build check here; add one")


def test_the_synthetic_experiment_selects_synthetic_everything():
    settings = schema.checked_settings(compose_run(["experiment=synthetic"]))
    assert settings.target.name == settings.workload.name == settings.drafter["name"] == "synthetic"


def test_a_typo_in_an_override_fails_at_compose_time():
    for typo in ["target.vocab_sise=3", "workload.num_promts=3", "sampling.temprature=1", "max_new_token=5",
                 "drafter.num_drat=3"]:
        with pytest.raises(ConfigCompositionException, match="Could not override"):
            compose_run([typo])


def test_a_wrong_type_fails_at_compose_time():
    with pytest.raises(ConfigCompositionException):
        compose_run(["max_new_tokens=many"])
    with pytest.raises(ConfigCompositionException):
        compose_run(["sampling.top_k=1.5"])


def test_a_typo_in_a_yaml_file_fails_at_compose_time(tmp_path):
    config_dir = tmp_path / "configs"
    shutil.copytree(CONFIG_DIR, config_dir)
    (config_dir / "workload" / "typo.yaml").write_text("name: synthetic\nnum_promts: 3\n")
    with pytest.raises(ConfigCompositionException, match="num_promts"):
        compose_run(["workload=typo"], config_dir)


@pytest.mark.parametrize("group,known", [("drafter", "ngram"), ("workload", "mtbench"), ("target", "smollm2")])
def test_an_unknown_option_fails_and_lists_the_choices(group, known):
    with pytest.raises(MissingConfigException, match=f"(?s)Could not find '{group}/nope'.*{known}"):
        compose_run([f"{group}=nope"])


def test_the_joblib_launcher_composes():
    cfg = compose_run(["hydra/launcher=joblib"], return_hydra_config=True)
    assert "JoblibLauncher" in cfg.hydra.launcher._target_



REGISTRIES = {"target": TARGETS, "drafter": DRAFTERS, "verifier": VERIFIERS, "workload": WORKLOADS, "logger": SINKS}


@pytest.mark.parametrize("group", sorted(REGISTRIES))
def test_every_config_is_named_after_what_it_builds(group):
    """configs/GROUP/NAME.yaml builds the registered NAME, or is a variant NAME_VARIANT.yaml of it:
    the name on the command line is the name in the code and in results."""
    registry = REGISTRIES[group]
    for path in sorted((CONFIG_DIR / group).glob("*.yaml")):
        name = yaml.safe_load(path.read_text())["name"]
        if name is None:
            assert path.stem == "none", path
            continue
        assert name in registry.names(), path
        assert path.stem == name or path.stem.startswith(f"{name}_"), path


def test_target_device_resolves_auto_and_refuses_what_the_machine_lacks(monkeypatch):
    from specdec.target_loader import TargetConfig, check_target_config, target_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert target_device(TargetConfig(device="auto")) == torch.device("cpu")
    assert target_device(TargetConfig(device="cpu")) == torch.device("cpu")
    with pytest.raises(ValueError, match="target.device=cuda: torch sees no CUDA device on this machine; use target.device=cpu"):
        target_device(TargetConfig(device="cuda"))
    with pytest.raises(ValueError, match="target.device='cuda:x' is not a device; choose auto, cpu, cuda or cuda:N"):
        target_device(TargetConfig(device="cuda:x"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert target_device(TargetConfig(device="auto")) == torch.device("cuda", 1)
    assert target_device(TargetConfig(device="cuda:1")) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="has 2 CUDA device\\(s\\), cuda:0 to cuda:1"):
        target_device(TargetConfig(device="cuda:2"))
    with pytest.raises(ValueError, match="target.invariant=true computes rows on oneDNN's CPU kernels"):
        check_target_config(TargetConfig(device="auto", invariant=True))
    check_target_config(TargetConfig(name="smollm2", dtype="bfloat16", invariant=True, device="cpu"))
