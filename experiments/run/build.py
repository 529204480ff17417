"""From checked settings to the objects a run measures: the target, the requests, the verifier, and
one side per way of decoding (the baseline, the drafter, each rival and transformers peer)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from rich.console import Console

from drafters import base as drafter_registry
from experiments.cli import SpecdecUserError, user_errors
from experiments.common.records import BASELINE, SPECULATIVE
from experiments.run import machine_load
from experiments.run.measure import DecoderSide, PeerSide, Plan, Request, Side
from experiments.run.peers import build_peer, load_stock_model
from experiments.run.schema import RunConfig, SamplingConfig, VerifierConfig
from experiments.run.workloads import answer_first_turns, load_texts, make_requests
from specdec.decode import SpecDecoder
from specdec.protocols import Drafter, Target, Verifier
from specdec.sampling import SamplingParams
from specdec.target_loader import TargetHandle, open_target, target_device
from verifiers.select import select_verifier


@dataclass(frozen=True)
class Pieces:
    """What every stage of a run reads: the settings and what was built from them before measuring."""

    settings: RunConfig
    config: dict[str, Any]  # the composed config, resolved (recorded in results.json)
    sampling: SamplingParams
    verifier: Verifier
    handle: TargetHandle
    target: Target
    requests: list[Request]
    console: Console
    # what the machine's other processes took of our cores as the target loaded, and the threads
    # chosen for it: {"cores", "threads", "others_share"}; None where threads were set or not on CPU
    watch: dict[str, Any] | None = None

    def plan(self) -> Plan:
        s = self.settings
        return Plan(s.max_new_tokens, s.batch_size, s.group_size or len(self.requests), s.seed, s.repeats,
                    s.warmup_tokens, self.sampling, self.handle.eos_token_id)


def make_sampling(cfg: SamplingConfig) -> SamplingParams:
    return SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p)  # raises SamplingError (a ValueError) for bad values


def make_verifier(cfg: VerifierConfig, device) -> Verifier:
    """The verifier for a target on ``device`` (the Triton kernel needs CUDA tensors)."""
    options = {k: v for k, v in (("epsilon", cfg.epsilon), ("delta", cfg.delta), ("sample_first", cfg.sample_first))
               if v is not None}
    try:
        return select_verifier(cfg.name, device, **options)
    except (RuntimeError, ValueError) as error:  # triton where it cannot run; options it does not take
        raise SpecdecUserError(str(error)) from error


def load_pieces(settings: RunConfig, config: dict[str, Any], console: Console) -> Pieces:
    """The prompts are checked against the target's context window before its weights load."""
    with user_errors():
        sampling = make_sampling(settings.sampling)
        device = target_device(settings.target)
        if device.type == "cuda":  # Triton launches, and auto checks the kernel, on the current device
            torch.cuda.set_device(device)
        verifier = make_verifier(settings.verifier, device)
        torch.set_num_threads(settings.threads or available_cores())
        workload = settings.workload
        texts = load_texts(workload)
        handle = open_target(settings.target, with_tokenizer=texts is not None)
        # prompts with a follow-up are checked first as the first turns the target will answer
        asks = texts is not None and any(p.follow_up is not None for p in texts)
        requests = make_requests(workload, texts, handle, workload.answer_tokens if asks else settings.max_new_tokens)
        start = machine_load.sample()
        with console.status(f"loading {handle.label}"):
            target = handle.load()
        watch = None
        cores = available_cores()
        if settings.threads is None and target.kind == "model" and device.type == "cpu" and cores > 1:
            threads, share = machine_load.watched_threads(cores, start)
            torch.set_num_threads(threads)
            watch = {"cores": cores, "threads": threads, "others_share": share}
        if asks:
            texts = answer_first_turns(texts, handle, target, verifier, settings.target.dtype, workload.answer_tokens, console)
            requests = make_requests(workload, texts, handle, settings.max_new_tokens)
    return Pieces(settings, config, sampling, verifier, handle, target, requests, console, watch)


def build_drafter(options: dict[str, Any], target: Target) -> Drafter | None:
    """A drafter from its config (``name`` and the factory's options); None for ``name: null``."""
    if options.get("name") is None:
        return None
    factory_options = {key: value for key, value in options.items() if key != "name"}
    try:
        return drafter_registry.build(options["name"], target, **factory_options)
    except (TypeError, ValueError, FileNotFoundError) as error:  # an option the factory does not take, a bad value or file
        raise SpecdecUserError(f"drafter {options['name']!r} with options {factory_options}: {error}") from error


def decoder_sides(pieces: Pieces, drafter: Drafter | None, rivals: dict[str, Drafter]) -> dict[str, Side]:
    """The baseline first, then the run's drafter and its rivals, all through the same loop."""
    sides: dict[str, Side] = {
        BASELINE: DecoderSide(SpecDecoder(pieces.target, None, pieces.verifier)),
        SPECULATIVE: DecoderSide(SpecDecoder(pieces.target, drafter, pieces.verifier)),
    }
    sides.update({label: DecoderSide(SpecDecoder(pieces.target, rival, pieces.verifier)) for label, rival in rivals.items()})
    return sides


def stock_model(pieces: Pieces):
    """A second copy of the target's model with transformers' own modules, for the peers."""
    target = pieces.settings.target
    with pieces.console.status("loading the model again, with transformers' own modules, for the peers"):
        return load_stock_model(target.path or target.name, target.dtype)


def peer_sides(pieces: Pieces, peers: dict[str, tuple[str, dict[str, Any]]], stock=None) -> dict[str, Side]:
    """transformers' own generation on ``stock`` (stock_model; None = load it when a peer needs it)."""
    if not peers:
        return {}
    stock = stock_model(pieces) if stock is None else stock
    return {label: PeerSide(build_peer(name, stock, options)) for label, (name, options) in peers.items()}


def busy_share() -> float:
    """The share of our cores other processes may take before a run's timings are judged busy:
    machine_load.BUSY_SHARE beyond the cores the run's threads leave them."""
    cores = available_cores()
    return machine_load.BUSY_SHARE + max(cores - torch.get_num_threads(), 0) / cores


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
