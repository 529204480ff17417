"""specdec-run's settings: the Hydra schema, and every check that needs nothing loaded.

Not frozen: OmegaConf makes a frozen dataclass read-only, and Hydra merges YAML and overrides into
these. Defaults here only fill fields a YAML leaves out; the values a run uses live in configs/.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from drafters import base as drafter_registry
from drafters.quantize import SCHEMES as QUANT_SCHEMES
from experiments.cli import require, user_errors
from experiments.common.config_dir import CONFIG_DIR
from experiments.common.sinks import SINKS, LoggerConfig
from experiments.run.rivals import peer_options, rival_options
from experiments.run.workloads import WORKLOADS, WorkloadConfig
from specdec.registry import import_modules
from specdec.target_loader import TARGETS, TargetConfig, check_target_config, target_sizes

BUDGET_MODES = ("fixed", "auto")


@dataclass
class VerifierConfig:
    name: str = MISSING  # a verifiers.select.VERIFIERS name: auto | reference | triton | block | traversal | typical_lossy
    # typical_lossy only: probability floor, entropy scale, and whether the token after the accepted
    # path is sampled (True) or the argmax (False)
    epsilon: float | None = None
    delta: float | None = None
    sample_first: bool | None = None


@dataclass
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off


@dataclass
class BudgetConfig:
    mode: str = "fixed"  # fixed: the drafter's settings as given | auto: chosen from T(n) and acceptance
    profile: str | None = None  # auto: T(n) CSV (benchmarks.bench_target); null = measure now at batch_size
    acceptance: str | None = None  # auto: results.json of an earlier run of this drafter; null = calibrate
    calibration_prompts: int = 4  # auto: the first N prompts, drafted at the largest budget
    max_depth: int = 8  # auto: the largest depth considered (and calibrated)
    max_nodes: int = 32  # auto: the largest tree considered (tree drafters)


@dataclass
class RunConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    # `name` (registered in drafters/, null = no drafter on either side) and the factory's keyword
    # arguments. A dict, not a schema, because adding a drafter must need only a YAML; an override
    # of a key the YAML lacks still fails at compose time, and the factory checks the rest.
    drafter: dict[str, Any] = field(default_factory=dict)
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    max_new_tokens: int = MISSING
    batch_size: int = MISSING  # requests in flight (continuous batching within each group)
    group_size: int | None = MISSING  # prompts per interleaved group; null = the whole workload
    seed: int = MISSING
    threads: int | None = MISSING
    warmup_tokens: int = MISSING  # per prompt, in one untimed pass of every side before the timed ones
    repeats: int = MISSING  # timed passes over the prompts (experiments/run/measure.py)
    # HF targets at batch 1: our plain decoding against transformers' generate() on the first prompts,
    # this many tokens each, before the timed passes (experiments/run/baseline_check.py); 0 = no check
    baseline_check_tokens: int = 32
    drafter_quant: str = "none"  # none | int8 | int4 | fp8 (weights rounded) | int8_kernels (real int8 GEMMs)
    # other drafters measured in the same run, in turn with the baseline and the drafter: a drafter
    # YAML's name (configs/drafter/NAME.yaml), or {drafter: NAME, option: value, ...} to change options
    rivals: list[Any] = field(default_factory=list)
    # modules imported first, so that the drafters, workloads, verifiers or targets they register
    # can be named (docs/adding-a-drafter.md)
    imports: list[str] = field(default_factory=list)


ConfigStore.instance().store(name="run_schema", node=RunConfig)


def checked_settings(cfg: DictConfig) -> RunConfig:
    """Everything that can be checked without loading anything; returns the config as dataclasses."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    require(not missing, f"no value for {', '.join(missing)}; set it on the command line: {missing[0] if missing else ''}=...")
    settings: RunConfig = OmegaConf.to_object(cfg)
    target, drafter_name, workload = settings.target, settings.drafter.get("name"), settings.workload
    with user_errors():
        import_modules(settings.imports)
        check_target_config(target)
        WORKLOADS.check(workload.name)
        SINKS.check(settings.logger.name)
        if drafter_name is not None:
            require(drafter_name in drafter_registry.DRAFTERS,
                    f"unknown drafter {drafter_name!r}; choose one of none, {', '.join(drafter_registry.names())}")
            drafter_registry.check_options(drafter_name, {k: v for k, v in settings.drafter.items() if k != "name"})
    require(not WORKLOADS.trait(workload.name, "path") or workload.path is not None,
            f"workload={workload.name} needs a prompt file: workload.path=FILE")
    require(
        not WORKLOADS.trait(workload.name, "text") or TARGETS.trait(target.name, "kind") == "model",
        f"workload={workload.name} is text and target=synthetic has no tokenizer; use workload=synthetic "
        f"or a real target (target=smollm2, target=hf)",
    )
    require(settings.max_new_tokens >= 1, f"max_new_tokens must be >= 1; got {settings.max_new_tokens}")
    require(settings.drafter_quant in QUANT_SCHEMES,
            f"unknown drafter_quant {settings.drafter_quant!r}; choose one of {', '.join(QUANT_SCHEMES)}")
    require(not settings.rivals or drafter_name is not None,
            "rivals are measured beside a drafter; drafter=none has nothing to compare them with")
    rivals = rival_options(settings.rivals, cfg)  # raises for a bad entry before anything loads
    drafters = ([settings.drafter] if drafter_name is not None else []) + list(rivals.values())
    with user_errors():  # checkpoints against the target's config, before the target loads
        sizes = target_sizes(target) if drafters else None
        for options in drafters if sizes is not None else []:
            drafter_registry.check_options(options["name"], {k: v for k, v in options.items() if k != "name"}, sizes)
    if peer_options(settings.rivals):
        require(TARGETS.trait(target.name, "kind") == "model",
                f"transformers peers decode a transformers model; target={target.name} is none")
        require(settings.batch_size == 1,
                f"transformers peers decode one prompt at a time (assisted generation takes no batch), so they are "
                f"compared at batch_size=1; got batch_size={settings.batch_size}")
    require(settings.batch_size >= 1, f"batch_size must be >= 1; got {settings.batch_size}")
    require(
        settings.group_size is None or settings.group_size >= settings.batch_size,
        f"group_size={settings.group_size} is smaller than batch_size={settings.batch_size}, so the batch could "
        f"never fill; raise group_size (null = the whole workload as one group)",
    )
    budget = settings.budget
    require(budget.mode in BUDGET_MODES, f"unknown budget.mode {budget.mode!r}; choose one of {', '.join(BUDGET_MODES)}")
    require(
        budget.max_depth >= 1 and budget.max_nodes >= budget.max_depth and budget.calibration_prompts >= 1,
        f"need budget.max_depth >= 1, budget.max_nodes >= max_depth and budget.calibration_prompts >= 1; got "
        f"{budget.max_depth}, {budget.max_nodes}, {budget.calibration_prompts}",
    )
    require(settings.threads is None or settings.threads >= 1, f"threads must be >= 1 or null; got {settings.threads}")
    require(settings.warmup_tokens >= 0, f"warmup_tokens must be >= 0 (0 = no warm-up pass); got {settings.warmup_tokens}")
    require(settings.repeats >= 1, f"repeats (timed passes) must be >= 1; got {settings.repeats}")
    require(settings.baseline_check_tokens >= 0,
            f"baseline_check_tokens must be >= 0 (0 = no check against generate()); got {settings.baseline_check_tokens}")
    require(
        workload.num_prompts is None or workload.num_prompts >= 1,
        f"workload.num_prompts must be >= 1 or null (all); got {workload.num_prompts}",
    )
    require(workload.categories != [], "workload.categories=[] selects no prompt; name at least one, or null for all")
    require(workload.categories is None or WORKLOADS.trait(workload.name, "text"),
            f"workload={workload.name} has no categories to select (its prompts are token ids); drop workload.categories")
    require(workload.per_category is None or (workload.per_category >= 1 and WORKLOADS.trait(workload.name, "text")),
            f"workload.per_category takes the first N >= 1 prompts of each category of a text workload; got "
            f"{workload.per_category} for workload={workload.name}")
    require(workload.max_chars is None or workload.max_chars >= 1,
            f"workload.max_chars must be >= 1 or null (no limit); got {workload.max_chars}")
    require(workload.answer_tokens >= 1, f"workload.answer_tokens must be >= 1; got {workload.answer_tokens}")
    check_workload = WORKLOADS.trait(workload.name, "check")
    if check_workload is not None:
        check_workload(workload)
    return settings
