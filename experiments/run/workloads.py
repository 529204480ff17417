"""Workloads by name: where a run's prompts come from.

A workload's loader takes the run's ``workload`` settings and returns text prompts
(specdec.assets.Prompt), or None for a workload of token ids made once the target's vocabulary is
known (``synthetic``). It registers with ``text=True`` when its prompts are text (a target with a
tokenizer is then required). A new workload is one more function here, plus
configs/workload/NAME.yaml.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from experiments.cli import require
from experiments.run.measure import Request
from specdec import assets
from specdec.registry import Registry
from specdec.targets import TargetHandle

if TYPE_CHECKING:
    from experiments.run.schema import WorkloadConfig

WORKLOADS: Registry[Callable[["WorkloadConfig"], list[assets.Prompt] | None]] = Registry("workload")


@WORKLOADS.register("mtbench", text=True)
def mtbench(cfg: WorkloadConfig) -> list[assets.Prompt]:
    return assets.load_mtbench(cfg.num_prompts)


@WORKLOADS.register("sharegpt", text=True)
def sharegpt(cfg: WorkloadConfig) -> list[assets.Prompt]:
    return assets.load_sharegpt(cfg.num_prompts, cfg.min_chars)


@WORKLOADS.register("sharegpt_multiturn", text=True)
def sharegpt_multiturn(cfg: WorkloadConfig) -> list[assets.Prompt]:
    return assets.load_sharegpt_multiturn(cfg.num_prompts, cfg.max_chars)


@WORKLOADS.register("jsonl", text=True, path=True)
def jsonl(cfg: WorkloadConfig) -> list[assets.Prompt]:
    return assets.load_jsonl(cfg.path, cfg.field, cfg.chat, cfg.num_prompts)


@WORKLOADS.register("specbench", text=True, path=True)
def specbench(cfg: WorkloadConfig) -> list[assets.Prompt]:
    return assets.load_spec_bench(cfg.path, cfg.num_prompts)


@WORKLOADS.register("synthetic", text=False)
def synthetic(cfg: WorkloadConfig) -> None:
    return None


def load_texts(cfg: WorkloadConfig) -> list[assets.Prompt] | None:
    """Text prompts of a text workload (each encoded as a chat turn or not, as ``cfg.chat`` says);
    None for token-id workloads. ``cfg.categories`` keeps the first ``num_prompts`` of those
    categories, so the loader reads the whole source first."""
    load = WORKLOADS.get(cfg.name)
    if cfg.categories is None:
        texts = load(cfg)
    else:
        every = load(dataclasses.replace(cfg, num_prompts=None))
        texts = assets.select_categories(every, cfg.categories, cfg.num_prompts, f"workload={cfg.name}")
    return None if texts is None else [dataclasses.replace(p, chat=cfg.chat) for p in texts]


def make_requests(
    cfg: WorkloadConfig, texts: list[assets.Prompt] | None, target: TargetHandle, max_new_tokens: int
) -> list[Request]:
    """The prompts as token ids, each checked against the target's context window."""
    if texts is None:
        generator = torch.Generator().manual_seed(cfg.seed)
        ids = torch.randint(target.vocab_size, (cfg.num_prompts, cfg.prompt_length), generator=generator)
        requests = [Request(i, f"synthetic-{i}", "synthetic", row) for i, row in enumerate(ids.tolist())]
    else:
        require(
            not any(p.chat for p in texts) or getattr(target.tokenizer, "chat_template", None),
            f"workload={cfg.name} encodes its prompts as chat turns, but this target's tokenizer has no chat "
            f"template (a base model?); add workload.chat=false to feed the prompts as raw text",
        )
        requests = [
            Request(i, p.id, p.category, assets.encode_prompt(target.tokenizer, p)) for i, p in enumerate(texts)
        ]
    for request in requests:
        require(len(request.prompt) > 0, f"prompt {request.id} encodes to no tokens; every prompt needs at least one")
        require(
            target.max_length is None or len(request.prompt) + max_new_tokens <= target.max_length,
            f"prompt {request.id} has {len(request.prompt)} tokens; with max_new_tokens={max_new_tokens} that "
            f"exceeds the target's context window of {target.max_length} (lower max_new_tokens or drop the prompt)",
        )
    return requests
