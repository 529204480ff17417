"""Sides measured against each other on the same requests: warmed, interleaved, repeated.

Terms, as results.json and docs/MEASURING.md use them:
  side     one way of decoding the requests: "baseline" (plain decoding through the same loop),
           "speculative" (the run's drafter), each rival drafter and each transformers peer.
  unit     group_size consecutive prompts, decoded by one call of a side with batch_size requests
           in flight. Intervals resample units (specdec.intervals): at batch 1 a unit is a prompt.
  pass     every unit decoded once by every side, unit after unit; within a unit the sides take
           turns, the first rotating with the unit and the pass, so a drift of a shared machine
           falls on every side alike and no side is always the one that meets something first.
  warm-up  one untimed pass before the timed ones, each prompt decoded to warmup_tokens tokens:
           every side meets the prompt lengths and tree widths it will meet (oneDNN creates a
           kernel the first time it meets a GEMM shape in a process; buffers are touched the first
           time) before anything is timed.

Every pass decodes the same requests with the same per-request seeds, so every pass gives the same
outputs and acceptance (checked: `reproducible` is false for a side whose outputs changed between
passes); the passes add timing samples.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from experiments.run import machine_load
from specdec.decode import SpecDecoder
from specdec.metrics import AcceptanceStats, TimeSplit
from specdec.sampling import SamplingParams

SEED_STRIDE = 1_000_003  # request seed = seed * SEED_STRIDE + prompt index: distinct across both


@dataclass(frozen=True)
class Request:
    index: int  # position in the workload; with the run seed it fixes the request's sampling seed
    id: str
    category: str
    prompt: list[int]  # token ids


@dataclass(frozen=True)
class Decoded:
    outputs: list[list[int]]  # generated token ids per request (prompt excluded)
    stats: AcceptanceStats | None  # None: a side that reports no acceptance (a transformers peer)
    steps: list[dict]  # per decode step, as SpecDecoder records them ([] without acceptance)


class Side(Protocol):
    def decode(
        self, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingParams, seeds: list[int],
        eos_token_id: int | None, max_batch: int,
    ) -> Decoded: ...


class DecoderSide:
    """Our decoding loop as a side: plain decoding (no drafter) or speculative."""

    def __init__(self, decoder: SpecDecoder) -> None:
        self.decoder = decoder

    def decode(self, prompts, max_new_tokens, sampling, seeds, eos_token_id, max_batch) -> Decoded:
        generation = self.decoder.generate(
            prompts, max_new_tokens, sampling, seeds=seeds, eos_token_id=eos_token_id, max_batch=max_batch
        )
        return Decoded(generation.outputs, generation.stats, generation.steps)


class PeerSide:
    """A transformers peer (experiments.run.peers) as a side: it decodes one request at a time and
    reports outputs only."""

    def __init__(self, peer) -> None:
        self.peer = peer

    def decode(self, prompts, max_new_tokens, sampling, seeds, eos_token_id, max_batch) -> Decoded:
        return Decoded(self.peer.generate(prompts, max_new_tokens, sampling, seeds, eos_token_id).outputs, None, [])


@dataclass(frozen=True)
class Timed:
    decoded: Decoded
    wall_s: float  # around the whole call, prefill included
    cpu_s: float  # this process's CPU time in the call, every thread
    others_share: float | None  # share of our cores other processes took in the call (machine_load)
    load_average: float | None  # the machine's one-minute load average after the call


@dataclass(frozen=True)
class Plan:
    max_new_tokens: int
    batch_size: int  # requests in flight within a unit
    group_size: int  # prompts per unit
    seed: int
    repeats: int  # timed passes
    warmup_tokens: int  # per prompt in the untimed warm-up pass; 0 = no warm-up pass
    sampling: SamplingParams
    eos_token_id: int | None


@dataclass(frozen=True)
class UnitRun:
    """One unit's timed passes, by side."""

    index: int
    requests: list[Request]
    passes: tuple[dict[str, Timed], ...]  # per timed pass: side -> its call

    def decoded(self, side: str) -> Decoded:
        return self.passes[0][side].decoded  # every pass decodes the same (module docstring)

    def seconds(self, side: str) -> float:
        return sum(timed[side].wall_s for timed in self.passes)

    def tokens(self, side: str) -> int:
        return sum(sum(len(o) for o in timed[side].decoded.outputs) for timed in self.passes)

    def reproducible(self, side: str) -> bool:
        return all(timed[side].decoded.outputs == self.decoded(side).outputs for timed in self.passes)


def decode(side: Side, requests: Sequence[Request], plan: Plan, max_new_tokens: int | None = None) -> Timed:
    """One call of a side over ``requests``, timed; max_new_tokens None = the plan's."""
    # seeds per request, not per batch position: a prompt samples the same way at any batch_size
    seeds = [plan.seed * SEED_STRIDE + r.index for r in requests]
    start = machine_load.sample()
    decoded = side.decode([r.prompt for r in requests], max_new_tokens or plan.max_new_tokens, plan.sampling, seeds,
                          plan.eos_token_id, plan.batch_size)
    end = machine_load.sample()
    return Timed(decoded, end.wall_s - start.wall_s, end.own_cpu_s - start.own_cpu_s,
                 machine_load.others_share(start, end), machine_load.load_average())


def units_of(requests: list[Request], group_size: int) -> list[list[Request]]:
    return [requests[i : i + group_size] for i in range(0, len(requests), group_size)]


def turns(names: list[str], unit: int, repeat: int) -> list[str]:
    """The order of the sides in a unit of a pass: each side goes first in turn."""
    first = (unit + repeat) % len(names)
    return names[first:] + names[:first]


def measure(
    requests: list[Request],
    sides: dict[str, Side],  # baseline first
    plan: Plan,
    console: Console,
    on_unit: Callable[[int, UnitRun], None] = lambda step, unit: None,  # after each unit of each pass
) -> list[UnitRun]:
    groups = units_of(requests, plan.group_size)
    names = list(sides)
    warm = 1 if plan.warmup_tokens else 0
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    timed: list[list[dict[str, Timed]]] = [[] for _ in groups]  # unit -> passes
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("warm-up", total=(warm + plan.repeats) * len(groups) * len(names))
        for repeat in range(-warm, plan.repeats):
            tokens = min(plan.warmup_tokens, plan.max_new_tokens) if repeat < 0 else plan.max_new_tokens
            for index, group in enumerate(groups):
                calls = {}
                for name in turns(names, index, repeat):
                    label = "warm-up" if repeat < 0 else f"pass {repeat + 1}/{plan.repeats}"
                    progress.update(task, description=f"{label} unit {index + 1}/{len(groups)} {name}")
                    calls[name] = decode(sides[name], group, plan, tokens)
                    progress.advance(task)
                if repeat >= 0:
                    timed[index].append({name: calls[name] for name in names})
                    on_unit(repeat * len(groups) + index, UnitRun(index, group, (calls,)))
    return [UnitRun(index, group, tuple(passes)) for index, (group, passes) in enumerate(zip(groups, timed))]


def pool(units: list[UnitRun], side: str) -> AcceptanceStats:
    """A side's acceptance over the units (every pass accepts the same, so the first pass's counts),
    with the mean time split of its passes."""
    repeats = len(units[0].passes)
    times = [timed[side].decoded.stats.time for unit in units for timed in unit.passes]
    return AcceptanceStats.merged([unit.decoded(side).stats for unit in units], TimeSplit.sum(times, 1 / repeats))
