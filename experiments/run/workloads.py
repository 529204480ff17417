"""Workloads by name: where a run's prompts come from.

A workload's loader takes the run's ``workload`` settings and returns text prompts
(experiments.common.prompt_sets.Prompt), or None for a workload of token ids made once the target's vocabulary is
known (``synthetic``). It registers with ``text=True`` when its prompts are text (a target with a
tokenizer is then required), ``path=True`` when it reads a prompt file (workload.path), and with
``check=`` a function that refuses its own settings before anything loads. A new workload is one
more function here, plus configs/workload/NAME.yaml.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable

import torch
from omegaconf import MISSING
from rich.console import Console

from experiments.cli import require
from experiments.common import prompt_sets
from experiments.common.long_context import load_long_context
from experiments.run.measure import Request
from specdec import packaged_models
from specdec.decode import SpecDecoder
from specdec.files import write_atomically
from specdec.protocols import Target, Verifier
from specdec.registry import Registry
from specdec.sampling import SamplingParams
from specdec.target_loader import TargetHandle


@dataclasses.dataclass
class WorkloadConfig:
    # a WORKLOADS name: mtbench | mtbench_turn2 | sharegpt | sharegpt_multiturn | long_context | jsonl | specbench | synthetic
    name: str = MISSING
    num_prompts: int | None = None  # the first N prompts of the source; null = all (not synthetic)
    categories: list[str] | None = None  # text workloads: only prompts of these categories; null = all
    per_category: int | None = None  # text workloads: the first N prompts of each category (then num_prompts); null = all
    path: str | None = None  # jsonl, specbench: the prompt file
    field: str = "prompt"  # jsonl: the record field holding the prompt text
    chat: bool = True  # encode each prompt through the chat template as a user turn after its history (false: raw text)
    min_chars: int = 0  # sharegpt: skip shorter first turns; long_context: the shortest document
    max_chars: int | None = None  # sharegpt_multiturn: the most characters of a prompt's turns (null = no limit); long_context: the longest document
    answer_tokens: int = 256  # mtbench_turn2: the most tokens of the target's own (greedy, cached) answer to the first turn
    prompt_length: int = 16  # synthetic: tokens per random prompt
    seed: int = 0  # synthetic: which random prompts


WORKLOADS: Registry[Callable[[WorkloadConfig], list[prompt_sets.Prompt] | None]] = Registry("workload")


@WORKLOADS.register("mtbench", text=True)
def mtbench(cfg: WorkloadConfig) -> list[prompt_sets.Prompt]:
    return prompt_sets.load_mtbench(cfg.num_prompts)


@WORKLOADS.register("mtbench_turn2", text=True)
def mtbench_turn2(cfg: WorkloadConfig) -> list[prompt_sets.Prompt]:
    return prompt_sets.load_mtbench(cfg.num_prompts, second_turns=True)


def check_document_lengths(cfg: WorkloadConfig) -> None:
    require(cfg.max_chars is not None and 0 < cfg.min_chars <= cfg.max_chars,
            f"workload={cfg.name} takes documents of min_chars to max_chars characters, 0 < min_chars <= "
            f"max_chars; got {cfg.min_chars} and {cfg.max_chars}")


@WORKLOADS.register("long_context", text=True, check=check_document_lengths)
def long_context(cfg: WorkloadConfig) -> list[prompt_sets.Prompt]:
    return load_long_context(cfg.num_prompts, cfg.min_chars, cfg.max_chars)


@WORKLOADS.register("sharegpt", text=True)
def sharegpt(cfg: WorkloadConfig) -> list[prompt_sets.Prompt]:
    return prompt_sets.load_sharegpt(cfg.num_prompts, cfg.min_chars)


@WORKLOADS.register("sharegpt_multiturn", text=True)
def sharegpt_multiturn(cfg: WorkloadConfig) -> list[prompt_sets.Prompt]:
    return prompt_sets.load_sharegpt_multiturn(cfg.num_prompts, cfg.max_chars)


@WORKLOADS.register("jsonl", text=True, path=True)
def jsonl(cfg: WorkloadConfig) -> list[prompt_sets.Prompt]:
    return prompt_sets.load_jsonl(cfg.path, cfg.field, cfg.chat, cfg.num_prompts)


@WORKLOADS.register("specbench", text=True, path=True)
def specbench(cfg: WorkloadConfig) -> list[prompt_sets.Prompt]:
    return prompt_sets.load_spec_bench(cfg.path, cfg.num_prompts)


def check_synthetic(cfg: WorkloadConfig) -> None:
    require(cfg.num_prompts is not None, f"workload={cfg.name} needs a number: workload.num_prompts=N")
    require(cfg.prompt_length >= 1, f"workload.prompt_length must be >= 1; got {cfg.prompt_length}")


@WORKLOADS.register("synthetic", text=False, check=check_synthetic)
def synthetic(cfg: WorkloadConfig) -> None:
    return None


def load_texts(cfg: WorkloadConfig) -> list[prompt_sets.Prompt] | None:
    """Text prompts of a text workload (each encoded as a chat turn or not, as ``cfg.chat`` says);
    None for token-id workloads. ``cfg.categories`` keeps those categories and ``cfg.per_category``
    the first prompts of each, before ``num_prompts`` takes the first of what is left, so the loader
    reads the whole source first."""
    load = WORKLOADS.get(cfg.name)
    if cfg.categories is None and cfg.per_category is None:
        texts = load(cfg)
    else:
        texts = load(dataclasses.replace(cfg, num_prompts=None))
        if texts is not None and cfg.per_category is not None:
            texts = prompt_sets.first_of_each_category(texts, cfg.per_category)
        texts = prompt_sets.select_categories(texts, cfg.categories or [], cfg.num_prompts, f"workload={cfg.name}")
    return None if texts is None else [dataclasses.replace(p, chat=cfg.chat) for p in texts]


def answer_first_turns(
    texts: list[prompt_sets.Prompt], handle: TargetHandle, target: Target, verifier: Verifier, dtype: str, answer_tokens: int,
    console: Console,
) -> list[prompt_sets.Prompt]:
    """Each prompt with a follow-up becomes that follow-up, the target's own greedy answer to the first
    turn (at most answer_tokens tokens) in its context, as Spec-Bench asks MT-bench's second turns.

    The answers are plain greedy decoding, untimed, the same at every temperature so that every run
    on these prompts sees the same conversations; they are kept in the cache
    (specdec.packaged_models.cache_dir()/answers) per target, dtype and answer length, and made only once.
    """
    asking = [p for p in texts if p.follow_up is not None]
    if not asking:
        return texts
    key = json.dumps([handle.label, handle.key, handle.vocab_size, dtype, answer_tokens])
    path = packaged_models.cache_dir() / "answers" / f"{handle.key}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.json"
    answers = json.loads(path.read_text()) if path.is_file() else {}
    missing = [p for p in asking if p.id not in answers]
    if missing:
        decoder = SpecDecoder(target, None, verifier)
        with console.status(f"answering {len(missing)} first turns with {handle.label} (once; cached in {path})"):
            outputs = decoder.generate(
                [prompt_sets.encode_prompt(handle.tokenizer, p) for p in missing], answer_tokens, SamplingParams(0.0),
                eos_token_id=handle.eos_token_id, max_batch=1,
            ).outputs
        answers.update({p.id: handle.tokenizer.decode(ids, skip_special_tokens=True).strip() for p, ids in zip(missing, outputs)})
        write_atomically(path, lambda staged: staged.write_text(json.dumps(answers, indent=1)))
    return [prompt_sets.followed_up(p, answers[p.id]) if p.follow_up is not None else p for p in texts]


def make_requests(
    cfg: WorkloadConfig, texts: list[prompt_sets.Prompt] | None, target: TargetHandle, max_new_tokens: int
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
            Request(i, p.id, p.category, prompt_sets.encode_prompt(target.tokenizer, p)) for i, p in enumerate(texts)
        ]
    for request in requests:
        require(len(request.prompt) > 0, f"prompt {request.id} encodes to no tokens; every prompt needs at least one")
        require(
            target.max_length is None or len(request.prompt) + max_new_tokens <= target.max_length,
            f"prompt {request.id} has {len(request.prompt)} tokens; with max_new_tokens={max_new_tokens} that "
            f"exceeds the target's context window of {target.max_length} (lower max_new_tokens or drop the prompt)",
        )
    return requests
