"""Where specdec-train's text and cached features come from: ShareGPT (as written, or answered by
the target itself) or a file of sequences tokenised beforehand (data.sequences), and the feature
cache extracted once from them and shared by every run on the target."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from rich.console import Console

from drafters.training.data import answered_sequences, chat_sequences
from drafters.training.features import META, CacheMeta, FeatureCache, default_layers, extract_features
from drafters.training.online import TokenSequences
from experiments.cli import require
from experiments.common.answers import opening_prompts, regenerated_answers
from specdec import assets, packaged_models
from specdec.sampling import SamplingParams
from specdec.target import HFTarget
from specdec.target_loader import TargetConfig, TargetHandle, open_target

if TYPE_CHECKING:  # the schema imports Hydra, which this module does not need
    from experiments.train.schema import DataConfig, TrainRunConfig


def write_sequences(path: Path, sequences: list[list[int]], prompts: list[list[int]], vocab_size: int) -> None:
    """A data.sequences file: training sequences and opening prompts (for the target's own answers,
    schedule.generate_s), as token ids; uint16 where the vocabulary allows (half the bytes to carry)."""
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.int32
    arrays = {}
    for name, rows in (("tokens", sequences), ("prompts", prompts)):
        arrays[name] = np.array([token for row in rows for token in row], dtype=dtype)
        arrays[f"{name}_offsets"] = np.cumsum([0] + [len(row) for row in rows], dtype=np.int64)
    with open(path, "wb") as file:
        np.savez(file, **arrays)


def read_sequences(path: Path, name: str) -> list[list[int]]:
    """The ``name`` rows (tokens or prompts) of a data.sequences file (write_sequences)."""
    with np.load(path) as arrays:
        tokens, offsets = arrays[name].astype(np.int64).tolist(), arrays[f"{name}_offsets"].tolist()
    return [tokens[start:end] for start, end in zip(offsets[:-1], offsets[1:])]


def token_sequences(sequences: list[list[int]]) -> TokenSequences:
    """Whole token sequences, every token trained on (as a feature cache labels them)."""
    tokens = torch.tensor([token for sequence in sequences for token in sequence], dtype=torch.int64)
    offsets = torch.tensor([0] + [len(sequence) for sequence in sequences], dtype=torch.int64).cumsum(0)
    return TokenSequences(tokens, offsets, torch.ones(len(tokens), dtype=torch.bool))


def open_chat_target(cfg: TargetConfig) -> TargetHandle:
    """The target with its tokenizer read and its weights not yet loaded (``handle.load()``), refused
    when it is taken for a chat model (target.chat) and its tokenizer has no chat template: the
    ShareGPT conversations (and specdec-train's MT-bench evaluation prompts) are then rendered
    through one. A base model (target.chat=false) reads them as plain text."""
    handle = open_target(cfg, with_tokenizer=True)
    if cfg.chat and not getattr(handle.tokenizer, "chat_template", None):
        setting = f"target.path={cfg.path}" if cfg.path else f"target={cfg.name}"
        raise ValueError(f"{setting}: its tokenizer has no chat template (a base model?); the ShareGPT conversations "
                         f"are rendered through one for a chat model: pass target.chat=false to train a base model "
                         f"on them as plain text")
    return handle


def opened_target(settings: TrainRunConfig) -> TargetHandle:
    """open_chat_target (a model folder, its config and tokenizer read, the weights not loaded), and
    the feature cache that data.extract=false trains on checked; before Hydra makes a run dir too
    (check_config)."""
    handle = open_chat_target(settings.target)
    if not settings.data.extract and settings.features == "cached":
        cache = features_dir(settings, handle.cache_name)
        require((cache / META).is_file(), f"data.extract=false trains on the cached features, and {cache} holds none; "
                                          f"extract them first (data.extract=true; loop.steps=0 extracts only)")
    return handle


def data_source(data: DataConfig, chat: bool) -> str:
    """Names the training text: ShareGPT as written, or with answers the target regenerated; through
    the chat template, or as plain text (``-plain``)."""
    source = f"sharegpt-regen{data.regenerate_tokens}-T{data.regenerate_temperature:g}" if data.regenerate else "sharegpt"
    if data.sequences:
        source = f"sequences-{Path(data.sequences).stem}"
    return source if chat else f"{source}-plain"


def regeneration_cache(label: str, data: DataConfig, chat: bool) -> Path:
    """Where the target ``label``'s regenerated answers are kept (resumable; build_datastore --generate
    shares the file)."""
    return packaged_models.cache_dir() / "regenerated" / f"{label}-{data_source(data, chat)}.jsonl"


def features_dir(cfg: TrainRunConfig, label: str) -> Path:
    return Path(cfg.data.features_dir or packaged_models.cache_dir() / "features" / f"{label}-{data_source(cfg.data, cfg.target.chat)}")


def training_sequences(cfg: TrainRunConfig, target: HFTarget, tokenizer, label: str, console: Console) -> list[list[int]]:
    if cfg.data.sequences:
        return [ids[: cfg.data.max_length] for ids in read_sequences(Path(cfg.data.sequences), "tokens")]
    conversations = assets.load_sharegpt_conversations(cfg.data.conversations)
    if not cfg.data.regenerate:
        return chat_sequences(tokenizer, conversations, cfg.data.max_length, chat=cfg.target.chat)
    d = cfg.data
    cache_file = regeneration_cache(label, d, cfg.target.chat)
    console.print(f"regenerating answers with the target -> {cache_file} (resumes where it stopped)")
    pairs = regenerated_answers(target, tokenizer, conversations, d.max_length, cache_file, d.regenerate_tokens,
                                SamplingParams(d.regenerate_temperature), d.regenerate_batch,
                                progress=lambda done, total: console.print(f"  {done}/{total} answers", end="\r"),
                                chat=cfg.target.chat)
    return answered_sequences(pairs, d.max_length)


def opening_prompts_for(cfg: TrainRunConfig, tokenizer) -> list[tuple[int, str, list[int]]]:
    """What the target answers itself for schedule.generate_s (experiments.common.answers.opening_prompts):
    the data.sequences file's prompts, or the opening turns of the ShareGPT conversations."""
    if cfg.data.sequences:
        prompts = read_sequences(Path(cfg.data.sequences), "prompts")
        return [(place, f"prompt-{place}", ids) for place, ids in enumerate(prompts) if len(ids) < cfg.data.max_length]
    conversations = assets.load_sharegpt_conversations(cfg.data.conversations)
    return opening_prompts(tokenizer, conversations, cfg.data.max_length, cfg.target.chat)


def prepare_features(cfg: TrainRunConfig, target: HFTarget, tokenizer, label: str, layers: tuple[int, ...], console: Console,
                     rank: int = 0, world: int = 1) -> FeatureCache:
    """The feature cache, with what it lacks extracted first (``data.extract``). Under torchrun every
    process extracts its own share of the shards into the one folder (``extract_features``,
    distributed) and all return once the whole cache is on disk; answers regenerated by the target
    are one shared file, so process 0 writes it first and the others then read it whole."""
    directory = features_dir(cfg, label)
    if cfg.data.extract:
        shared_sequences(cfg, target, tokenizer, label, console, rank, world)
        # an existing cache keeps its layers; another run's meta.json is written atomically, and a
        # process that finds none computes the default its writer did
        stored = default_layers(target.num_layers, layers)
        if (directory / META).exists():
            stored = tuple(json.loads((directory / META).read_text())["layers"])
        sequences = training_sequences(cfg, target, tokenizer, label, console)
        meta = CacheMeta(str(label), target.hidden_size, target.num_layers, target.vocab_size, stored, cfg.data.max_length, cfg.data.per_shard)
        console.print(f"features: {len(sequences)} sequences -> {directory} (resumes where it stopped)")
        extract_features(target, sequences, directory, meta, distributed=world > 1,
                         progress=(lambda done, total, rate: console.print(f"  {done}/{total} tokens, {rate:.0f} tokens/s", end="\r"))
                         if rank == 0 else None)
        console.print()
    return FeatureCache(directory)


def shared_sequences(cfg: TrainRunConfig, target: HFTarget, tokenizer, label: str, console: Console, rank: int,
                     world: int) -> None:
    """Under torchrun, the regenerated answers (one shared file) written by process 0 before any
    other process reads them."""
    if cfg.data.regenerate and world > 1:
        if rank == 0:
            training_sequences(cfg, target, tokenizer, label, console)
        torch.distributed.barrier()
