"""Targets by name, for every entry point: ``smollm2`` and ``gemma3_270m`` (packaged offline,
specdec.packaged_models), ``hf`` (any local Hugging Face causal-LM folder) and ``synthetic`` (a
weightless language model with a known distribution).

``open_target`` is cheap: it checks the settings and reads a model's config and tokenizer, so that
prompts can be checked against the context window before the weights load (``TargetHandle.load``).
A new kind of target registers an opener in ``TARGETS``, declaring its ``kind`` (``Target.kind``:
"model" for a transformers model, which text workloads, transformers' peers and head drafters need)
and, where it can tell them without loading weights, its ``sizes`` (TargetConfig -> TargetSizes,
the drafters' checkpoint checks) and a ``check`` of its settings.

A target's key (Target.key, TargetHandle.key) is the name it is registered under here, whichever
config selected it (configs/target/gemma3_270m_bf16.yaml opens gemma3_270m). A user's model folder
has the key ``hf``: no head is bundled for it, its name (TargetSizes.name, as checkpoints record it)
is its absolute folder, and the folder's name keeps its caches apart (TargetHandle.cache_name). Argparse scripts name a target the same way:
``--target NAME`` (``target_argument``).
"""

from __future__ import annotations

from collections.abc import Callable
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdec import assets, packaged_models
from specdec.packaged_models import PACKAGED_MODELS, converted_path
from specdec.protocols import Target, TargetSizes
from specdec.registry import Registry
from specdec.synthetic import SyntheticTarget

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# Not frozen: it is also a Hydra schema node, which Hydra merges YAML and overrides into.
@dataclass
class TargetConfig:
    name: str = "smollm2"  # a TARGETS name: smollm2 | gemma3_270m | hf | synthetic
    device: str = "auto"  # auto (CUDA where torch sees a device, else the CPU) | cpu | cuda | cuda:N
    path: str | None = None  # hf: a local Hugging Face model folder
    # model targets: whether the model is a chat model (a chat template in its tokenizer); text workloads
    # encode their prompts as chat turns by default when it is (workload.chat follows it), as raw text when
    # not, and specdec-train renders its conversations through the template, or as plain text
    chat: bool = True
    dtype: str = "float32"  # model targets (smollm2, gemma3_270m, hf): float32 | bfloat16 | float16
    max_length: int | None = None  # model targets: context window; null = max_position_embeddings
    packed_gemm_from: Any = None  # model targets on CPU: rows from which linears use packed GEMMs, auto or null
    invariant: bool | None = None  # model targets on CPU: rows computed as if alone (HFTarget); null = in half precision
    vocab_size: int = 32  # synthetic
    order: int = 2  # synthetic: how many previous tokens p(.|context) depends on
    sharpness: float = 2.0  # synthetic: logit scale; higher = lower entropy
    seed: int = 0  # synthetic: which random language model
    forward_ms: float = 0.0  # synthetic: simulated T(1) in ms (0 = as fast as it computes)
    row_cost: float = 0.0  # synthetic: simulated extra cost per tree row, as a fraction of T(1)
    new_shape_ms: float = 0.0  # synthetic: simulated one-off cost of each shape's first forward (kernel creation)


@dataclass(frozen=True)
class TargetHandle:
    """What is known about a target before its weights load (enough to check prompts), and the loader."""

    label: str  # for tables and plot titles
    key: str  # the registered name, Target.key: smollm2, gemma3_270m, hf (any model folder), synthetic
    # short and stable, for cache and file names: the key, or a model folder's name (each folder its own caches)
    cache_name: str
    vocab_size: int
    max_length: int | None  # None: the model's config names no context window
    tokenizer: Any  # None when the workload is already token ids
    eos_token_id: int | None
    load: Callable[[], Target]


TARGETS: Registry[Callable[[TargetConfig, bool], TargetHandle]] = Registry("target")


def check_target_config(cfg: TargetConfig) -> None:
    """What can be checked without reading anything (ValueError with a one-line message)."""
    TARGETS.check(cfg.name)
    device = target_device(cfg)
    if device.type == "cuda" and cfg.invariant:
        raise ValueError(f"target.invariant=true computes rows on oneDNN's CPU kernels, and target.device={cfg.device} "
                         f"is {device}; use target.device=cpu, or target.invariant=null on the GPU (the logits contract)")
    check = TARGETS.trait(cfg.name, "check")
    if check is not None:
        check(cfg)
    if cfg.dtype not in DTYPES:
        raise ValueError(f"unknown target.dtype {cfg.dtype!r}; choose one of {', '.join(DTYPES)}")
    packed = cfg.packed_gemm_from
    if not (packed is None or packed == "auto" or (isinstance(packed, int) and not isinstance(packed, bool) and packed >= 1)):
        raise ValueError(
            f"target.packed_gemm_from must be an integer >= 1, auto (timed on this machine) or null (stock kernels); got {packed!r}"
        )


def target_device(cfg: TargetConfig) -> torch.device:
    """Where the target computes: ``target.device``, with auto = torch's current CUDA device where
    it sees one, else the CPU. ValueError (one line) for a device this machine does not have."""
    if cfg.device == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(cfg.device)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"target.device={cfg.device!r} is not a device; choose auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"target.device={cfg.device}: torch sees no CUDA device on this machine; use target.device=cpu "
                         f"(or auto)")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"target.device={cfg.device}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                         f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return device


def open_target(cfg: TargetConfig, with_tokenizer: bool) -> TargetHandle:
    check_target_config(cfg)
    return TARGETS.get(cfg.name)(cfg, with_tokenizer)


def target_argument(flag: str, value: str, **settings: Any) -> TargetConfig:
    """What an argparse script's ``flag VALUE`` names: a packaged target (smollm2, gemma3_270m), else
    a Hugging Face model folder (target=hf); ``settings`` are the TargetConfig's other fields.
    ValueError (one line) for anything else: the scripts need a model with weights."""
    if value in PACKAGED_MODELS:
        return TargetConfig(name=value, **settings)
    if not (Path(value).expanduser() / "config.json").is_file():
        raise ValueError(f"{flag} {value}: not a packaged target ({', '.join(PACKAGED_MODELS)}) and not a Hugging Face "
                         f"model folder (no config.json); name one, or pass {assets.MODEL_FOLDER}")
    return TargetConfig(name="hf", path=value, **settings)


def target_sizes(cfg: TargetConfig) -> TargetSizes | None:
    """The target's sizes, read without loading its weights, for the drafters' checks; None for a
    target that declares no ``sizes`` or cannot tell them yet: its drafters are checked when built."""
    sizes = TARGETS.trait(cfg.name, "sizes")
    return sizes(cfg) if sizes is not None else None


def _synthetic_sizes(cfg: TargetConfig) -> TargetSizes:
    return TargetSizes(cfg.name, cfg.vocab_size, None, None, kind="synthetic")


@TARGETS.register("synthetic", kind="synthetic", sizes=_synthetic_sizes)
def _synthetic(cfg: TargetConfig, with_tokenizer: bool) -> TargetHandle:
    target = SyntheticTarget(cfg.vocab_size, cfg.order, cfg.sharpness, cfg.seed, device=target_device(cfg),
                             forward_ms=cfg.forward_ms, row_cost=cfg.row_cost, new_shape_ms=cfg.new_shape_ms)
    label = f"synthetic(V={cfg.vocab_size}, sharpness={cfg.sharpness})"
    return TargetHandle(label, target.key, target.key, target.vocab_size, target.max_length, None, None, lambda: target)


def _packaged(name: str) -> Callable[[TargetConfig, bool], TargetHandle]:
    def open_packaged(cfg: TargetConfig, with_tokenizer: bool) -> TargetHandle:
        path = converted_path(name)  # converted on first use
        return _hf_handle(path, PACKAGED_MODELS[name].label, name, f"target={name} ({path})", cfg, with_tokenizer,
                          "delete that folder, and the next run converts the package again")

    return open_packaged


def _packaged_sizes(cfg: TargetConfig) -> TargetSizes | None:
    """The converted folder's config.json, or before the first conversion the GGUF's header where
    the package declares one that names the sizes (None otherwise)."""
    model = PACKAGED_MODELS[cfg.name]
    folder = packaged_models.cache_dir() / model.cache_name
    if folder.is_dir():
        return folder_sizes(folder, cfg.name)
    return gguf_sizes(model.header(), cfg.name, model.requirements) if model.header is not None else None


for _name in PACKAGED_MODELS:
    TARGETS.register(_name, kind="model", sizes=_packaged_sizes)(_packaged(_name))


def _hf_check(cfg: TargetConfig) -> None:
    if cfg.path is None:
        raise ValueError("target=hf needs a model folder: target.path=DIR")


def _hf_sizes(cfg: TargetConfig) -> TargetSizes:
    folder = Path(cfg.path).expanduser()
    assets.check_model_folder(folder, f"target.path={cfg.path}")
    return folder_sizes(folder, str(folder.resolve()))


@TARGETS.register("hf", kind="model", sizes=_hf_sizes, check=_hf_check)
def _hf(cfg: TargetConfig, with_tokenizer: bool) -> TargetHandle:
    path = Path(cfg.path).expanduser()
    assets.check_model_folder(path, f"target.path={cfg.path}")
    return _hf_handle(path, path.name, path.name, f"target.path={cfg.path}", cfg, with_tokenizer)


def _hf_handle(path: Path, label: str, cache_name: str, setting: str, cfg: TargetConfig, with_tokenizer: bool,
               remedy: str = f"pass {assets.MODEL_FOLDER}") -> TargetHandle:
    from transformers import AutoConfig, AutoTokenizer  # transformers: ~16 s cold; a synthetic target needs none

    with assets.model_loading_errors(setting, remedy):
        config = AutoConfig.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path) if with_tokenizer else None
    return TargetHandle(
        label=label,
        key=cfg.name,
        cache_name=cache_name,
        vocab_size=config.vocab_size,
        max_length=cfg.max_length or getattr(config, "max_position_embeddings", None),
        tokenizer=tokenizer,
        eos_token_id=tokenizer.eos_token_id if tokenizer is not None else None,
        load=lambda: load_hf_target(path, setting, cfg, remedy),
    )


def load_hf_target(path: Path, setting: str, cfg: TargetConfig, remedy: str = f"pass {assets.MODEL_FOLDER}"):
    # transformers (and specdec.target, which imports it): ~16 s cold; a synthetic target needs none
    from transformers import AutoModelForCausalLM

    from specdec.target import HFTarget

    with assets.model_loading_errors(setting, remedy):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[cfg.dtype])
    return HFTarget(model.to(target_device(cfg)), cfg.max_length, cfg.packed_gemm_from, cfg.invariant, cfg.name,
                    path.resolve())


def folder_sizes(folder: Path, name: str) -> TargetSizes:
    """Target ``name``'s sizes from its model folder's config.json (checked by check_model_folder),
    under the names the families use (a multimodal config keeps them in text_config)."""
    config = json.loads((folder / "config.json").read_text())
    config = {**config, **(config.get("text_config") or {})}

    def first(*names: str) -> int | None:
        return next((int(config[n]) for n in names if isinstance(config.get(n), int)), None)

    vocab = first("vocab_size")
    if vocab is None:
        raise ValueError(f"{folder}/config.json names no vocab_size; pass {assets.MODEL_FOLDER}")
    return TargetSizes(name, vocab, first("hidden_size", "n_embd", "d_model"), first("num_hidden_layers", "n_layer"))


GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}  # type -> struct


def gguf_sizes(path: Path, name: str, requirements: str) -> TargetSizes:
    """Target ``name``'s sizes from a GGUF file's key-value header (read until the sizes are found; no tensor is read)."""
    with path.open("rb") as file:
        def read(fmt: str):
            return struct.unpack("<" + fmt, file.read(struct.calcsize(fmt)))[0]

        def value(kind: int):
            if kind in GGUF_SCALARS:
                return read(GGUF_SCALARS[kind])
            if kind == 8:
                return file.read(read("Q")).decode("utf-8", "replace")
            if kind == 9:
                item, count = read("I"), read("Q")
                return [value(item) for _ in range(count)]
            raise ValueError(f"{path}: unknown GGUF value type {kind}")

        if file.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file; reinstall {requirements}")
        read("I"), read("Q")  # version, tensor count
        values: dict[str, Any] = {}
        for _ in range(read("Q")):
            key = value(8)
            values[key] = value(read("I"))
            arch = values.get("general.architecture")
            if arch and all(f"{arch}.{k}" in values for k in ("embedding_length", "block_count", "vocab_size")):
                return TargetSizes(name, values[f"{arch}.vocab_size"], values[f"{arch}.embedding_length"],
                                   values[f"{arch}.block_count"])
    raise ValueError(f"{path} names no embedding length, block count or vocabulary size; reinstall {requirements}")
