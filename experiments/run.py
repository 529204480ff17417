"""specdec-run: plain and speculative decoding on the same prompts, measured against each other in one run.

    specdec-run                                    # SmolLM2, MT-bench prompts, the union drafter, T=0
    specdec-run experiment=synthetic               # the whole pipeline in seconds, no model
    specdec-run drafter=none workload=jsonl workload.path=prompts.jsonl workload.field=text
    specdec-run -m sampling.temperature=0,1        # a sweep: one run dir per point

Every side (the baseline, the drafter, each rival drafter and transformers peer) decodes the same
prompts, unit by unit (group_size prompts, batch_size in flight, continuous batching within a
unit), after an untimed warm-up pass and for `repeats` timed passes, the sides taking turns
(experiments/measure.py). Speedup = (speculative tokens / speculative wall time) / (baseline
tokens / baseline wall time) over every unit and pass; it and tau come with a 95% paired bootstrap
interval over units (specdec.intervals). `rivals=[...]` adds drafters (a drafter config's name,
or `{drafter: NAME, option: value}`) and transformers' own generation (`hf_generate`,
`hf_prompt_lookup`, `hf_assisted`, `hf_early_exit`, or `{peer: NAME, option: value}`), each also
compared with the run's drafter on the same units. `budget.mode=auto` first chooses the drafter's
depth / tree size from the target's measured T(n) and the drafter's measured acceptance
(specdec.speedup.choose_tree_budget).

Writes into the Hydra run dir: steps.jsonl (one row per speculative decode step), prompts.jsonl
(one row per prompt), units.jsonl (each unit's tokens and seconds per side and pass: what the
intervals come from), per_depth_alpha.png, tau_per_prompt.png and, last, results.json. Each file
is written under a temporary name and renamed, so an interrupted run leaves complete files or none.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import MISSING, DictConfig, OmegaConf
from rich.console import Console

from drafters import base as drafter_registry
from experiments import plots
from experiments.cli import USAGE_ERROR, CommandLineError, check_command_line
from experiments.measure import BASELINE, SPECULATIVE, DecoderSide, PeerSide, Plan, Request, Side, decode, measure
from experiments.peers import PEERS, build_peer, check_peer_options, load_stock_model
from experiments.sinks import CHOICES as LOGGERS
from experiments.quantize import SCHEMES as QUANT_SCHEMES
from experiments.quantize import quantize_drafter
from experiments.sinks import make_sink
from experiments.summary import (
    comparison,
    prompt_rows,
    results_table,
    rivals_table,
    step_rows,
    summarize,
    unit_metrics,
    unit_rows,
    wandb_summary,
)
from specdec import assets
from specdec.decode import SpecDecoder
from specdec.protocols import Drafter, Target
from specdec.sampling import SamplingParams
from specdec.speedup import (
    ForwardProfile,
    choose_tree_budget,
    load_profile,
    measured_alphas,
    profile_forward,
    rank_share,
)
from specdec.synthetic import SyntheticTarget
from specdec.target import HFTarget
from verifiers.base import UnverifiableTreeError
from verifiers.select import select_verifier

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
TARGETS = ("smollm2", "hf", "synthetic")
TEXT_WORKLOADS = ("mtbench", "sharegpt", "jsonl")
WORKLOADS = (*TEXT_WORKLOADS, "synthetic")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BUDGET_MODES = ("fixed", "auto")


# -- the Hydra schema ---------------------------------------------------------------------------
# Not frozen: OmegaConf makes a frozen dataclass read-only, and Hydra merges YAML and overrides into
# these. Defaults here only fill fields a YAML leaves out; the values a run uses live in configs/.


@dataclass
class TargetConfig:
    name: str = MISSING  # smollm2 | hf | synthetic
    path: str | None = None  # hf: a local Hugging Face model folder
    dtype: str = "float32"  # smollm2, hf: float32 | bfloat16 | float16
    max_length: int | None = None  # smollm2, hf: context window; null = max_position_embeddings
    packed_gemm_from: Any = None  # smollm2, hf on CPU: rows from which linears use packed GEMMs, auto or null
    invariant: bool | None = None  # smollm2, hf on CPU: rows computed as if alone (HFTarget); null = in half precision
    vocab_size: int = 32  # synthetic
    order: int = 2  # synthetic: how many previous tokens p(.|context) depends on
    sharpness: float = 2.0  # synthetic: logit scale; higher = lower entropy
    seed: int = 0  # synthetic: which random language model
    forward_ms: float = 0.0  # synthetic: simulated T(1) in ms (0 = as fast as it computes)
    row_cost: float = 0.0  # synthetic: simulated extra cost per tree row, as a fraction of T(1)
    new_shape_ms: float = 0.0  # synthetic: simulated one-off cost of each shape's first forward (kernel creation)


@dataclass
class VerifierConfig:
    name: str = MISSING  # auto | reference | triton | block | typical_lossy
    # typical_lossy only (configs/verifier/typical.yaml): probability floor, entropy scale, and
    # whether the token after the accepted path is sampled (True) or the argmax (False)
    epsilon: float | None = None
    delta: float | None = None
    sample_first: bool | None = None


@dataclass
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off


@dataclass
class WorkloadConfig:
    name: str = MISSING  # mtbench | sharegpt | jsonl | synthetic
    num_prompts: int | None = None  # the first N prompts of the source; null = all (not synthetic)
    path: str | None = None  # jsonl: the prompt file
    field: str = "prompt"  # jsonl: the record field holding the prompt text
    chat: bool = True  # encode each prompt through the chat template as one user turn (false: raw text)
    min_chars: int = 0  # sharegpt: skip shorter first turns
    prompt_length: int = 16  # synthetic: tokens per random prompt
    seed: int = 0  # synthetic: which random prompts


@dataclass
class LoggerConfig:
    name: str = MISSING  # none | stdout | jsonl | wandb
    project: str = "specdec"  # wandb
    mode: str | None = None  # wandb: offline | online | disabled; null = $WANDB_MODE or offline


@dataclass
class BudgetConfig:
    mode: str = "fixed"  # fixed: the drafter's settings as given | auto: chosen from T(n) and acceptance
    profile: str | None = None  # auto: T(n) CSV (experiments.bench_target); null = measure now at batch_size
    acceptance: str | None = None  # auto: results.json of an earlier run of this drafter; null = calibrate
    calibration_prompts: int = 4  # auto: the first N prompts, drafted at the largest budget
    max_depth: int = 8  # auto: the largest depth / num_draft considered (and calibrated)
    max_nodes: int = 32  # auto: the largest total_tokens considered (tree drafters)


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
    repeats: int = MISSING  # timed passes over the prompts (experiments/measure.py)
    drafter_quant: str = "none"  # none | int8 | int4 | fp8: weight-only quantization of the drafter's own weights
    # other drafters measured in the same run, in turn with the baseline and the drafter: a drafter
    # YAML's name (configs/drafter/NAME.yaml), or {drafter: NAME, option: value, ...} to change options
    rivals: list[Any] = field(default_factory=list)


ConfigStore.instance().store(name="run_schema", node=RunConfig)


# -- errors ---------------------------------------------------------------------------------------


class SpecdecUserError(CommandLineError):
    """Bad input: reported as one line without a traceback, exit status 2."""


@contextmanager
def user_errors() -> Iterator[None]:
    """The core and the asset loaders raise these for bad input (with messages meant for users)."""
    try:
        yield
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as error:
        raise SpecdecUserError(str(error)) from error


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise SpecdecUserError(message)


def checked_settings(cfg: DictConfig) -> RunConfig:
    """Everything that can be checked without loading anything; returns the config as dataclasses."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise SpecdecUserError(f"no value for {', '.join(missing)}; set it on the command line: {missing[0]}=...")
    settings: RunConfig = OmegaConf.to_object(cfg)
    target, drafter_name, workload = settings.target, settings.drafter.get("name"), settings.workload
    _require(target.name in TARGETS, f"unknown target {target.name!r}; choose one of {', '.join(TARGETS)}")
    _require(target.name != "hf" or target.path is not None, "target=hf needs a model folder: target.path=DIR")
    _require(target.dtype in DTYPES, f"unknown target.dtype {target.dtype!r}; choose one of {', '.join(DTYPES)}")
    packed = target.packed_gemm_from
    _require(
        packed is None or packed == "auto" or (isinstance(packed, int) and not isinstance(packed, bool) and packed >= 1),
        f"target.packed_gemm_from must be an integer >= 1, auto (timed on this machine) or null (stock kernels); got {packed!r}",
    )
    available = drafter_registry.names()
    _require(
        drafter_name is None or drafter_name in available,
        f"unknown drafter {drafter_name!r}; choose one of none, {', '.join(available)}",
    )
    if drafter_name is not None:
        try:
            drafter_registry.check_options(drafter_name, {k: v for k, v in settings.drafter.items() if k != "name"})
        except ValueError as error:
            raise SpecdecUserError(str(error)) from error
    _require(workload.name in WORKLOADS, f"unknown workload {workload.name!r}; choose one of {', '.join(WORKLOADS)}")
    _require(workload.name != "jsonl" or workload.path is not None, "workload=jsonl needs a prompt file: workload.path=FILE")
    logger = settings.logger.name
    _require(logger in LOGGERS, f"unknown logger {logger!r}; choose one of {', '.join(LOGGERS)}")
    _require(
        not (workload.name in TEXT_WORKLOADS and target.name == "synthetic"),
        f"workload={workload.name} is text and target=synthetic has no tokenizer; use workload=synthetic "
        f"or a real target (target=smollm2, target=hf)",
    )
    _require(settings.max_new_tokens >= 1, f"max_new_tokens must be >= 1; got {settings.max_new_tokens}")
    _require(settings.drafter_quant in QUANT_SCHEMES,
             f"unknown drafter_quant {settings.drafter_quant!r}; choose one of {', '.join(QUANT_SCHEMES)}")
    _require(not settings.rivals or drafter_name is not None,
             "rivals are measured beside a drafter; drafter=none has nothing to compare them with")
    rival_options(settings.rivals, cfg)  # raises for a bad entry before anything loads
    if peer_options(settings.rivals):
        _require(target.name != "synthetic", "transformers peers decode a transformers model; target=synthetic is none")
        _require(settings.batch_size == 1,
                 f"transformers peers decode one prompt at a time (assisted generation takes no batch), so they are "
                 f"compared at batch_size=1; got batch_size={settings.batch_size}")
    _require(settings.batch_size >= 1, f"batch_size must be >= 1; got {settings.batch_size}")
    _require(
        settings.group_size is None or settings.group_size >= settings.batch_size,
        f"group_size={settings.group_size} is smaller than batch_size={settings.batch_size}, so the batch could "
        f"never fill; raise group_size (null = the whole workload as one group)",
    )
    budget = settings.budget
    _require(
        budget.mode in BUDGET_MODES, f"unknown budget.mode {budget.mode!r}; choose one of {', '.join(BUDGET_MODES)}"
    )
    _require(
        budget.max_depth >= 1 and budget.max_nodes >= budget.max_depth and budget.calibration_prompts >= 1,
        f"need budget.max_depth >= 1, budget.max_nodes >= max_depth and budget.calibration_prompts >= 1; got "
        f"{budget.max_depth}, {budget.max_nodes}, {budget.calibration_prompts}",
    )
    _require(settings.threads is None or settings.threads >= 1, f"threads must be >= 1 or null; got {settings.threads}")
    _require(settings.warmup_tokens >= 0, f"warmup_tokens must be >= 0 (0 = no warm-up pass); got {settings.warmup_tokens}")
    _require(settings.repeats >= 1, f"repeats (timed passes) must be >= 1; got {settings.repeats}")
    _require(
        workload.num_prompts is None or workload.num_prompts >= 1,
        f"workload.num_prompts must be >= 1 or null (all); got {workload.num_prompts}",
    )
    if workload.name == "synthetic":
        _require(workload.num_prompts is not None, "workload=synthetic needs a number: workload.num_prompts=N")
        _require(workload.prompt_length >= 1, f"workload.prompt_length must be >= 1; got {workload.prompt_length}")
    return settings


# -- building the pieces ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TargetHandle:
    """What is known about a target before its weights load (enough to check prompts), and the loader."""

    label: str  # for tables and plot titles
    vocab_size: int
    max_length: int | None  # None: the model's config names no context window
    tokenizer: Any  # None when the workload is already token ids
    eos_token_id: int | None
    load: Callable[[], Target]


def make_sampling(cfg: SamplingConfig) -> SamplingParams:
    return SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p)  # raises SamplingError for bad values


def make_verifier(cfg: VerifierConfig):
    options = {k: v for k, v in (("epsilon", cfg.epsilon), ("delta", cfg.delta), ("sample_first", cfg.sample_first))
               if v is not None}
    try:
        return select_verifier(cfg.name, **options)
    except (RuntimeError, ValueError) as error:  # triton where it cannot run; options it does not take
        raise SpecdecUserError(str(error)) from error


def load_texts(cfg: WorkloadConfig) -> list[assets.Prompt] | None:
    """Text prompts of a text workload; None for the synthetic one (token ids, made once the target's
    vocabulary is known)."""
    if cfg.name == "mtbench":
        texts = assets.load_mtbench(cfg.num_prompts)
    elif cfg.name == "sharegpt":
        texts = assets.load_sharegpt(cfg.num_prompts, cfg.min_chars)
    elif cfg.name == "jsonl":
        texts = assets.load_jsonl(cfg.path, cfg.field, cfg.chat, cfg.num_prompts)
    else:
        return None
    return [dataclasses.replace(p, chat=cfg.chat) for p in texts]


def open_target(cfg: TargetConfig, with_tokenizer: bool) -> TargetHandle:
    """Cheap: a synthetic target is built outright; an HF one reads only its config and tokenizer."""
    if cfg.name == "synthetic":
        target = SyntheticTarget(cfg.vocab_size, cfg.order, cfg.sharpness, cfg.seed,
                                 forward_ms=cfg.forward_ms, row_cost=cfg.row_cost, new_shape_ms=cfg.new_shape_ms)
        label = f"synthetic(V={cfg.vocab_size}, sharpness={cfg.sharpness})"
        return TargetHandle(label, target.vocab_size, target.max_length, None, None, lambda: target)
    from transformers import AutoConfig, AutoTokenizer

    if cfg.name == "smollm2":
        path, label = assets.smollm2_path(), "SmolLM2-135M-Instruct"
    else:
        path, label = Path(cfg.path).expanduser(), Path(cfg.path).name
        assets.check_model_folder(path, f"target.path={cfg.path}")
    with assets.model_loading_errors(f"target.path={path}", f"pass {assets.MODEL_FOLDER}"):
        config = AutoConfig.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path) if with_tokenizer else None
    return TargetHandle(
        label=label,
        vocab_size=config.vocab_size,
        max_length=cfg.max_length or getattr(config, "max_position_embeddings", None),
        tokenizer=tokenizer,
        eos_token_id=tokenizer.eos_token_id if tokenizer is not None else None,
        load=lambda: load_hf_target(path, cfg.dtype, cfg.max_length, cfg.packed_gemm_from, cfg.invariant),
    )


def load_hf_target(
    path: Path, dtype: str, max_length: int | None, packed_gemm_from: int | str | None, invariant: bool | None = None
) -> HFTarget:
    from transformers import AutoModelForCausalLM

    with assets.model_loading_errors(f"target.path={path}", f"pass {assets.MODEL_FOLDER}"):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    return HFTarget(model, max_length, packed_gemm_from, invariant)


def make_requests(
    cfg: WorkloadConfig, texts: list[assets.Prompt] | None, target: TargetHandle, max_new_tokens: int
) -> list[Request]:
    if texts is None:
        generator = torch.Generator().manual_seed(cfg.seed)
        ids = torch.randint(target.vocab_size, (cfg.num_prompts, cfg.prompt_length), generator=generator)
        requests = [Request(i, f"synthetic-{i}", "synthetic", row) for i, row in enumerate(ids.tolist())]
    else:
        _require(
            not any(p.chat for p in texts) or getattr(target.tokenizer, "chat_template", None),
            f"workload={cfg.name} encodes its prompts as chat turns, but this target's tokenizer has no chat "
            f"template (a base model?); add workload.chat=false to feed the prompts as raw text",
        )
        requests = [
            Request(i, p.id, p.category, assets.encode_prompt(target.tokenizer, p)) for i, p in enumerate(texts)
        ]
    for request in requests:
        _require(len(request.prompt) > 0, f"prompt {request.id} encodes to no tokens; every prompt needs at least one")
        _require(
            target.max_length is None or len(request.prompt) + max_new_tokens <= target.max_length,
            f"prompt {request.id} has {len(request.prompt)} tokens; with max_new_tokens={max_new_tokens} that "
            f"exceeds the target's context window of {target.max_length} (lower max_new_tokens or drop the prompt)",
        )
    return requests


def build_drafter(cfg: dict[str, Any], target: Target) -> Drafter | None:
    if cfg.get("name") is None:
        return None
    options = {key: value for key, value in cfg.items() if key != "name"}
    try:
        return drafter_registry.build(cfg["name"], target, **options)
    except (TypeError, ValueError) as error:  # an option the factory does not take, or a bad value
        raise SpecdecUserError(f"drafter {cfg['name']!r} with options {options}: {error}") from error


def is_peer(entry: Any) -> bool:
    """A rivals entry naming a transformers peer (experiments.peers): hf_NAME or {peer: hf_NAME, ...}."""
    return (isinstance(entry, dict) and "peer" in entry) or (isinstance(entry, str) and entry in PEERS)


def rival_label(name: str, changed: dict[str, Any]) -> str:
    return name + (f"({', '.join(f'{k}={v}' for k, v in changed.items())})" if changed else "")


def rival_options(entries: list[Any], run_config: DictConfig) -> dict[str, dict[str, Any]]:
    """Each drafter ``rivals`` entry's drafter options, by label: the YAML's name, with any changed
    options. Interpolations in the YAML (``${batch_size}``) take the run's values, as the drafter's own do."""
    known = sorted(path.stem for path in (CONFIG_DIR / "drafter").glob("*.yaml"))
    usage = (f"a rivals entry is a drafter config's name ({', '.join(known)}), {{drafter: NAME, option: value}}, "
             f"a transformers peer ({', '.join(PEERS)}) or {{peer: NAME, option: value}}")
    rivals: dict[str, dict[str, Any]] = {}
    scope = OmegaConf.to_container(run_config, resolve=False)
    for entry in (entry for entry in entries if not is_peer(entry)):
        changed = dict(entry) if isinstance(entry, dict) else {"drafter": entry}
        name = changed.pop("drafter", None)
        _require(name in known, f"rivals entry {entry!r}: {usage}")
        scope["drafter"] = OmegaConf.load(CONFIG_DIR / "drafter" / f"{name}.yaml")
        options = OmegaConf.to_container(OmegaConf.create(scope).drafter, resolve=True)
        _require(options.get("name") is not None, f"rivals entry {entry!r}: the baseline (no drafter) is always measured")
        unknown = sorted(set(changed) - set(options))
        _require(not unknown, f"rivals entry {entry!r}: configs/drafter/{name}.yaml has no option {', '.join(unknown)}")
        options.update(changed)
        try:
            drafter_registry.check_options(options["name"], {k: v for k, v in options.items() if k != "name"})
        except ValueError as error:
            raise SpecdecUserError(f"rivals entry {entry!r}: {error}") from error
        label = rival_label(name, changed)
        _require(label not in rivals, f"rivals entry {entry!r} is listed twice")
        rivals[label] = options
    return rivals


def peer_options(entries: list[Any]) -> dict[str, tuple[str, dict[str, Any]]]:
    """Each peer ``rivals`` entry's (peer name, options), by label; checked before anything loads."""
    peers: dict[str, tuple[str, dict[str, Any]]] = {}
    for entry in (entry for entry in entries if is_peer(entry)):
        options = dict(entry) if isinstance(entry, dict) else {"peer": entry}
        name = options.pop("peer")
        try:
            check_peer_options(name, options)
        except ValueError as error:
            raise SpecdecUserError(f"rivals entry {entry!r}: {error}") from error
        label = rival_label(name, options)
        _require(label not in peers, f"rivals entry {entry!r} is listed twice")
        peers[label] = (name, options)
    return peers


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# -- the tree budget (budget.mode=auto) -------------------------------------------------------------

DEPTH_SETTINGS = ("depth", "num_draft")  # the drafting depth, by the names drafter factories take


@dataclass(frozen=True)
class Acceptance:
    """What the budget chooser needs to know about a drafter."""

    per_depth_alpha: list[float]
    rank_share: list[float]  # fraction of accepted nodes that were their parent's rank-r child
    draft_s_per_depth: float  # drafter time per drafting pass, at the run's batch size
    source: str  # "calibration" or the results.json it came from


def choose_budget(
    settings: RunConfig,
    target: Target,
    requests: list[Request],
    verifier,
    sampling: SamplingParams,
    eos_token_id: int | None,
    console: Console,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The drafter options with depth / num_draft / total_tokens set to maximise predicted tokens/s
    (specdec.speedup.choose_tree_budget), and the record for results.json."""
    cfg, options = settings.budget, dict(settings.drafter)
    depth_key = next((key for key in DEPTH_SETTINGS if key in options), None)
    tree = "total_tokens" in options  # tree drafters; the others are modelled as chains
    _require(
        options.get("name") is not None and (depth_key is not None or tree),
        f"budget.mode=auto sets a drafter's depth, num_draft or total_tokens; drafter {options.get('name')} "
        f"has none of them (use budget.mode=fixed)",
    )

    def sized(depth: int, num_nodes: int) -> dict[str, int]:
        chosen = {depth_key: depth} if depth_key else {}
        return {**chosen, "total_tokens": num_nodes} if tree else chosen

    name, factory_options = options["name"], {k: v for k, v in options.items() if k != "name"}
    profile = load_profile(cfg.profile) if cfg.profile else measure_profile(target, requests, settings, console)
    if cfg.acceptance:
        acceptance = read_acceptance(Path(cfg.acceptance), depth_key, profile)
    else:
        largest = {**options, **sized(cfg.max_depth, cfg.max_nodes)}
        acceptance = calibrate(largest, target, requests, verifier, sampling, eos_token_id, settings, console)
    budget = choose_tree_budget(
        profile,
        acceptance.per_depth_alpha,
        acceptance.draft_s_per_depth,
        acceptance.rank_share if tree else (1.0,),
        cfg.max_depth,
        cfg.max_nodes,
        drafter_registry.tree_shape(name, factory_options),
    )
    chosen = sized(budget.best.depth, budget.best.num_nodes)
    record = {
        "mode": "auto",
        "chosen": chosen,
        "predicted": asdict(budget.best),
        "curve": [asdict(point) for point in budget.curve],
        "profile": {**asdict(profile), "source": cfg.profile or "measured"},
        "acceptance": asdict(acceptance),
    }
    return {**options, **chosen}, record


def measure_profile(target: Target, requests: list[Request], settings: RunConfig, console: Console) -> ForwardProfile:
    """T(n) at the run's batch size, after a context as long as a typical request's mid-generation."""
    _require(
        isinstance(target, HFTarget),
        "budget.mode=auto needs the target's T(n), and only a model target can be timed; pass a measured "
        "profile: budget.profile=CSV",
    )
    largest = settings.budget.max_nodes + 1
    steps = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
    sizes = sorted({n for n in steps if n < largest} | {largest})
    typical = sum(len(r.prompt) for r in requests) // len(requests) + settings.max_new_tokens // 2
    context = max(1, min(typical, target.max_length - largest))
    with console.status(f"measuring T(n) for n <= {largest} at batch {settings.batch_size}"):
        return profile_forward(target, sizes, context, repeats=3, batch_size=settings.batch_size)


def calibrate(
    options: dict[str, Any],
    target: Target,
    requests: list[Request],
    verifier,
    sampling: SamplingParams,
    eos_token_id: int | None,
    settings: RunConfig,
    console: Console,
) -> Acceptance:
    """Acceptance at the largest budget on the first prompts, so every depth the chooser may pick
    has been measured (a depth reached too rarely counts as unmeasured: speedup.measured_alphas)."""
    decoder = SpecDecoder(target, build_drafter(options, target), verifier)
    calibration = requests[: settings.budget.calibration_prompts]
    with console.status(f"calibrating {options['name']} on {len(calibration)} prompts"):
        stats = decode(
            DecoderSide(decoder), calibration, settings.max_new_tokens, sampling, settings.seed, eos_token_id,
            settings.batch_size,
        ).decoded.stats
    _require(
        bool(stats.per_depth_alpha),
        f"the calibration run drafted nothing on {len(calibration)} prompts, so acceptance is unknown; raise "
        f"budget.calibration_prompts or pass budget.acceptance=<an earlier results.json>",
    )
    draft_s_per_step = stats.time.draft_s / max(stats.num_steps, 1)
    return Acceptance(
        measured_alphas(stats.per_depth_alpha, stats.per_depth_attempts),
        rank_share(stats.accepted_rank_histogram),
        draft_s_per_step / settings.budget.max_depth,
        "calibration",
    )


def read_acceptance(path: Path, depth_key: str | None, profile: ForwardProfile) -> Acceptance:
    """Acceptance from an earlier run's results.json; its drafter cost ratio c (per step, in units
    of T(1)) becomes seconds per drafting pass through this profile's T(1)."""
    try:
        previous = json.loads(path.read_text())
        alpha, cost = previous["per_depth_alpha"], previous["drafter_cost_ratio"]
        attempts = previous.get("per_depth_attempts")
        drafter = previous["config"]["drafter"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise SpecdecUserError(
            f"budget.acceptance={path} is not a specdec-run results.json with per_depth_alpha, "
            f"drafter_cost_ratio and config.drafter ({error})"
        ) from error
    _require(alpha, f"budget.acceptance={path}: that run measured no acceptance (no draft was ever tried)")
    passes = drafter.get(depth_key) if depth_key else None
    return Acceptance(
        measured_alphas(alpha, attempts),
        rank_share(previous.get("accepted_rank_histogram", [])),
        cost * profile.time(1) / (passes or len(alpha)),  # the run drafted every depth it measured
        str(path),
    )


# -- output -----------------------------------------------------------------------------------------


def write_file(path: Path, data: bytes) -> None:
    """The file is always absent or complete (specdec.assets.write_atomically)."""
    assets.write_atomically(path, lambda staged: staged.write_bytes(data))


def jsonl_bytes(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


# What a run and its analysis write into a run dir (specdec-analyze adds report.md and its PNGs);
# Hydra's own .hydra/ and log file belong to the run now starting and stay.
RUN_OUTPUTS = (
    "results.json", "prompts.jsonl", "steps.jsonl", "units.jsonl", "metrics.jsonl", "report.md", "wandb", "analysis-wandb",
)


def clear_previous_run(run_dir: Path) -> list[str]:
    """Remove a previous run's outputs from run_dir (a rerun into the same dir), so that the dir never
    holds one run's records beside another's config; returns what was removed."""
    import shutil

    found = [run_dir / name for name in RUN_OUTPUTS if (run_dir / name).exists()]
    found += sorted(run_dir.glob("*.png")) + sorted(run_dir.glob(".*.tmp"))
    for path in found:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return [path.name for path in found]


def write_outputs(run_dir: Path, results: dict, prompts: list[dict], steps: list[dict], units: list[dict]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    title = f"{results['drafter']} on {results['target']}, {results['workload']} (T={results['temperature']:g})"
    write_file(run_dir / "steps.jsonl", jsonl_bytes(steps))
    write_file(run_dir / "prompts.jsonl", jsonl_bytes(prompts))
    write_file(run_dir / "units.jsonl", jsonl_bytes(units))
    alpha, attempts = results["per_depth_alpha"], results["per_depth_attempts"]
    write_file(
        run_dir / "per_depth_alpha.png", plots.per_depth_alpha_png(alpha, attempts, f"Acceptance per depth\n{title}")
    )
    write_file(
        run_dir / "tau_per_prompt.png",
        plots.tau_histogram_png([p["tau"] for p in prompts], results["tau"], f"tau per prompt\n{title}"),
    )
    # last, so that a results.json on disk means the whole run finished
    write_file(run_dir / "results.json", (json.dumps(results, indent=2) + "\n").encode())


# -- the run ----------------------------------------------------------------------------------------


def run(
    cfg: DictConfig,
    run_dir: Path,
    console: Console | None = None,
    drafter_label: str | None = None,
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """One measurement into run_dir; returns what went into results.json. drafter_label names the
    drafter in results and tables (specdec-run passes its drafter config's name, as rivals are
    named; None = the drafter factory's name); overrides (Hydra's, as .hydra/overrides.yaml holds
    them) are recorded so that specdec-analyze can tell the records from another run's config.

    A previous run's outputs in run_dir are removed first. Raises SpecdecUserError for bad input,
    before any model loads where that can be known earlier.
    """
    console = console or Console()
    cleared = clear_previous_run(run_dir) if run_dir.is_dir() else []
    if cleared:
        console.print(f"specdec-run: {run_dir} held a previous run; removed its {', '.join(cleared)}")
    with user_errors():
        settings = checked_settings(cfg)
        sampling = make_sampling(settings.sampling)
        verifier = make_verifier(settings.verifier)
        torch.set_num_threads(settings.threads or available_cores())
        texts = load_texts(settings.workload)
        handle = open_target(settings.target, with_tokenizer=texts is not None)
        requests = make_requests(settings.workload, texts, handle, settings.max_new_tokens)
        with console.status(f"loading {handle.label}"):
            target = handle.load()
        drafter_options, budget = settings.drafter, None
        if settings.budget.mode == "auto":
            drafter_options, budget = choose_budget(
                settings, target, requests, verifier, sampling, handle.eos_token_id, console
            )
        drafter = build_drafter(drafter_options, target)
        quant = quantize_drafter(drafter, target, settings.drafter_quant) if drafter else None
        rival_configs = rival_options(settings.rivals, cfg)
        sides: dict[str, Side] = {
            BASELINE: DecoderSide(SpecDecoder(target, None, verifier)),
            SPECULATIVE: DecoderSide(SpecDecoder(target, drafter, verifier)),
        }
        rivals = {label: build_drafter(options, target) for label, options in rival_configs.items()}
        sides.update({label: DecoderSide(SpecDecoder(target, rival, verifier)) for label, rival in rivals.items()})
        peers = peer_options(settings.rivals)
        if peers:
            with console.status("loading the model again, with transformers' own modules, for the peers"):
                stock = load_stock_model(settings.target.path or settings.target.name, settings.target.dtype)
            sides.update({label: PeerSide(build_peer(name, stock, options)) for label, (name, options) in peers.items()})
        config = OmegaConf.to_container(cfg, resolve=True)
        sink = make_sink(
            settings.logger.name, run_dir, console, config, settings.logger.project, settings.logger.mode, run_dir.name
        )
    plan = Plan(settings.max_new_tokens, settings.batch_size, settings.group_size or len(requests), settings.seed,
                settings.repeats, settings.warmup_tokens)
    try:
        units = measure(requests, sides, plan, sampling, handle.eos_token_id, console,
                        lambda step, unit: sink.log(unit_metrics(unit, sampling), step=step))
        results = summarize(units, SPECULATIVE, settings, sampling, handle.label, config, budget, drafter_label)
        if overrides is not None:
            results["overrides"] = overrides
        if hasattr(target, "packed_gemm_from"):  # the kernels the run's forwards took (auto: timed when loaded)
            results["packed_gemm_from"] = target.packed_gemm_from
        if quant is not None:
            results["drafter_quant"] = asdict(quant)
        if getattr(drafter, "report", None):  # what a drafter measured or decided when built
            results["drafter_report"] = drafter.report
        if rivals:  # each against the same baseline calls; the run's config is in the main results
            results["rivals"] = [
                {**summarize(units, label, settings, sampling, handle.label, {}, None, label),
                 **comparison(units, label, settings.seed), "config": rival_configs[label],
                 **({"drafter_report": rival.report} if getattr(rival, "report", None) else {})}
                for label, rival in rivals.items()
            ]
        if peers:
            results["peers"] = [
                {**summarize(units, label, settings, sampling, handle.label, {}, None, label),
                 **comparison(units, label, settings.seed), "config": {"peer": name, **options}}
                for label, (name, options) in peers.items()
            ]
        write_outputs(run_dir, results, prompt_rows(units, sampling, handle.tokenizer), step_rows(units),
                      unit_rows(units))
        sink.log_summary(wandb_summary(results))
    finally:
        sink.finish()
    console.print(results_table(results, run_dir))
    if results.get("rivals") or results.get("peers"):
        console.print(rivals_table(results))
    return results


def check_config(cfg: DictConfig) -> None:
    """What run() checks before loading anything, for the command line as a whole (experiments.cli)."""
    with user_errors():
        settings = checked_settings(cfg)
        make_sampling(settings.sampling)
        make_verifier(settings.verifier)


def main() -> None:
    check_command_line("specdec-run", CONFIG_DIR, "config", check_config)
    hydra_main()


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="config")
def hydra_main(cfg: DictConfig) -> None:
    try:
        hydra_config = HydraConfig.get()
        choice = hydra_config.runtime.choices.get("drafter")  # union_retrieval, where the factory says union
        run(cfg, Path(hydra_config.runtime.output_dir), drafter_label=choice if cfg.drafter.get("name") else None,
            overrides=list(hydra_config.overrides.task))
    except (SpecdecUserError, UnverifiableTreeError) as error:
        print(f"specdec-run: error: {error}", file=sys.stderr)
        raise SystemExit(USAGE_ERROR) from None
    except KeyboardInterrupt:
        print("specdec-run: interrupted", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
