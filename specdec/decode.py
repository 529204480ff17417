"""The speculative decoding loop: propose -> forward_tree -> verify -> commit.

``SpecDecoder(target, None, verifier)`` is plain autoregressive decoding through the very same loop
(an empty tree each step), which is what every speedup is measured against.

Continuous batching: with ``max_batch`` at most that many requests are in flight; a finished request
leaves the batch (``retain``) and the next queued prompt takes its row (``admit``). Every random
number a request draws comes from its own counter-based stream, so its output does not depend on
its neighbours, on ``max_batch`` or on when it was admitted.

Host syncs: the loop itself waits for the device once per step (which requests are still
generating); targets, drafters and verifiers may add their own (HFTarget's commit reads the
longest accepted path and cache length, in one transfer). The phase clock adds none: on CUDA it
marks phases with events and reads them once, at the end.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor

from specdec.metrics import AcceptanceStats, StatsRecorder, TimeSplit
from specdec.noise import RequestRNG, VerifyNoise
from specdec.protocols import DraftContext, Drafter, Target, Verifier, VerifyResult, emitted_tokens, stack_rows
from specdec.sampling import SamplingParams
from specdec.tree import DraftTree, empty_tree, prune_to_depth

DRAFT_STREAM, VERIFY_STREAM = 1, 2


@dataclass(frozen=True)
class Generation:
    outputs: list[list[int]]  # generated token ids per prompt (prompt excluded)
    stats: AcceptanceStats
    steps: list[dict] = field(default_factory=list)  # per-step records for logs


class SpecDecoder:
    def __init__(self, target: Target, drafter: Drafter | None, verifier: Verifier) -> None:
        self.target = target
        self.drafter = drafter
        self.verifier = verifier

    def generate(
        self,
        prompts: Sequence[Sequence[int] | Tensor],
        max_new_tokens: int,
        sampling: SamplingParams,
        seed: int = 0,
        seeds: Sequence[int] | None = None,  # per request; makes outputs independent of batch order
        eos_token_id: int | None = None,
        max_batch: int | None = None,  # requests in flight; None = every prompt at once
    ) -> Generation:
        prompts = check_prompts(prompts, max_new_tokens, self.target.max_length)
        width = _batch_width(max_batch, len(prompts))
        device = self.target.device
        seeds = torch.as_tensor(
            list(seeds) if seeds is not None else [seed * 1_000_003 + i for i in range(len(prompts))],
            dtype=torch.int64,
            device=device,
        )
        draft_rng, verify_rng = RequestRNG(seeds, DRAFT_STREAM), RequestRNG(seeds, VERIFY_STREAM)
        layers = self.drafter.target_layers if self.drafter else ()
        seqs = _Sequences(prompts, max_new_tokens, eos_token_id, device)
        recorder, clock = StatsRecorder(), _Clock(device)

        with clock("prefill"):
            new_hidden = self.target.prefill(prompts[:width], layers).hidden
        if self.drafter:
            self.drafter.reset(width, seqs.capacity)
        alive = torch.arange(width, device=device)  # batch row -> request index
        num_new, queued = seqs.lengths[alive] - 1, width  # queued: index of the next prompt to admit
        while True:
            keep = seqs.active()[alive].nonzero()[:, 0]  # the step's one host sync
            if len(keep) < len(alive):  # finished requests leave the batch
                alive, num_new, new_hidden = alive[keep], num_new[keep], tuple(h[keep] for h in new_hidden)
                self.target.retain(keep)
                if self.drafter:
                    self.drafter.retain(keep)
            if len(alive) < width and queued < len(prompts):  # queued requests take the free rows
                new = torch.arange(queued, min(queued + width - len(alive), len(prompts)), device=device)
                with clock("prefill"):
                    admitted = self.target.admit(prompts[queued : queued + len(new)], layers).hidden
                if self.drafter:
                    self.drafter.admit(len(new), seqs.capacity)
                alive, num_new = torch.cat([alive, new]), torch.cat([num_new, seqs.lengths[new] - 1])
                new_hidden, queued = stack_rows(new_hidden, admitted), queued + len(new)
            if len(alive) == 0:
                break
            with clock("draft"):
                tokens, lengths = seqs.tokens[alive], seqs.lengths[alive]
                ctx = DraftContext(tokens, lengths, new_hidden, num_new, sampling, draft_rng.select(alive))
                tree = self.drafter.propose(ctx) if self.drafter else empty_tree(len(alive), device)
                if tree.max_nodes:  # never draft past max_new_tokens (an empty tree, plain decoding's, has nothing to cut)
                    tree = prune_to_depth(tree, seqs.remaining()[alive] - 1)
            with clock("target"):
                out = self.target.forward_tree(tree, layers)
            with clock("verify"):
                noise = VerifyNoise.draw(verify_rng.select(alive), tree.max_nodes, greedy=sampling.greedy)
                result = self.verifier(tree, out.logits, sampling, noise)
            self.target.commit(tree, result)
            if self.drafter:
                self.drafter.commit(tree, result)
                self.drafter.observe(tree, out.logits, result)
            recorder.record(alive, tree, result)
            seqs.append(alive, tree, result)
            new_hidden = tuple(_accepted_rows(h, result) for h in out.hidden)
            num_new = result.num_accepted + 1

        outputs = seqs.outputs()
        stats = recorder.finish(len(prompts), sum(len(o) for o in outputs), clock.split())
        return Generation(outputs, stats, recorder.per_step_records())


def _batch_width(max_batch: int | None, num_prompts: int) -> int:
    if max_batch is None:
        return num_prompts
    if not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch must be an integer >= 1, or None for all prompts at once; got {max_batch!r}")
    return min(max_batch, num_prompts)


def check_prompts(
    prompts: Sequence[Sequence[int] | Tensor], max_new_tokens: int, max_length: int
) -> list[Tensor]:
    """The prompts as 1-D int64 tensors, each non-empty and leaving room for max_new_tokens in the
    context window ``max_length``; ValueError naming the first that does not."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1; got {max_new_tokens!r}")
    if len(prompts) == 0:
        raise ValueError("no prompts given; pass at least one prompt (a list of token ids)")
    checked = []
    for i, prompt in enumerate(prompts):
        ids = torch.as_tensor(prompt, dtype=torch.int64).flatten()
        if ids.numel() == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if ids.numel() + max_new_tokens > max_length:
            raise ValueError(
                f"prompt {i} has {ids.numel()} tokens and max_new_tokens={max_new_tokens}, more than "
                f"the target's context window of {max_length}; shorten the prompt or lower max_new_tokens"
            )
        checked.append(ids)
    return checked


def _accepted_rows(hidden: Tensor, result: VerifyResult) -> Tensor:  # [B, N+1, H] -> [B, N+1, H]
    """Rows of the root and the accepted path, root first (the tokens that entered the cache)."""
    root = torch.zeros_like(result.num_accepted)[:, None]
    rows = torch.cat([root, result.accepted_nodes.clamp(min=-1) + 1], dim=1)
    return hidden.gather(1, rows[:, :, None].expand(-1, -1, hidden.shape[-1]))


class _Sequences:
    """Committed tokens per request in one right-padded buffer, and where each must stop."""

    def __init__(self, prompts: list[Tensor], max_new_tokens: int, eos: int | None, device) -> None:
        self.prompt_lengths = torch.tensor([len(p) for p in prompts], device=device)  # [B]
        self.lengths = self.prompt_lengths.clone()  # [B]
        self.stop_lengths = self.prompt_lengths + max_new_tokens  # [B], lowered when EOS is emitted
        self.capacity = int(self.stop_lengths.max())
        # one spare column receives the tokens a step emits past a request's stop, so that writing
        # a step needs no data-dependent indexing (which would wait for the device)
        self._buffer = torch.zeros(len(prompts), self.capacity + 1, dtype=torch.int64, device=device)
        self.tokens = self._buffer[:, : self.capacity]  # [P, capacity] view
        for i, p in enumerate(prompts):
            self.tokens[i, : len(p)] = p.to(device)
        self.eos = eos

    def active(self) -> Tensor:  # [B] bool
        return self.lengths < self.stop_lengths

    def remaining(self) -> Tensor:  # [B] int64, at least 1 for an active request
        return self.stop_lengths - self.lengths

    def append(self, rows: Tensor, tree: DraftTree, result: VerifyResult) -> None:
        """Write accepted tokens + next token for requests ``rows`` [A], cut at max_new_tokens and
        at the first EOS."""
        n = result.accepted_nodes.shape[1]
        emitted = emitted_tokens(tree, result)  # [A, N+1]
        offsets = torch.arange(n + 1, device=emitted.device)
        lengths = self.lengths[rows]
        count = torch.minimum(result.num_accepted + 1, self.stop_lengths[rows] - lengths)  # [A]
        if self.eos is not None:
            is_eos = (offsets < count[:, None]) & (emitted == self.eos)
            first_eos = torch.where(is_eos, offsets, n + 1).min(1).values  # [A]
            count = torch.minimum(count, first_eos + 1)
            self.stop_lengths[rows] = torch.where(is_eos.any(1), lengths + count, self.stop_lengths[rows])
        columns = torch.where(offsets < count[:, None], lengths[:, None] + offsets, self.capacity)  # [A, N+1]
        self._buffer[rows[:, None].expand_as(columns), columns] = emitted
        self.lengths[rows] = lengths + count

    def outputs(self) -> list[list[int]]:
        return [
            self.tokens[b, start:end].tolist()
            for b, (start, end) in enumerate(zip(self.prompt_lengths.tolist(), self.lengths.tolist()))
        ]


class _Clock:
    """Wall time per phase. On CUDA each phase is marked by two events in the stream and charged
    the device's timeline between them: its kernels, and any wait for the host's launches inside
    it. Nothing waits for the device until ``split`` reads the marks, so the host keeps launching
    ahead as it would without a clock (synchronising around every phase stalled it between
    phases, on both sides of a speedup); time between phases on the timeline is the loop's own.
    Past ``HELD`` marks, those the device has already passed are read and dropped (a query, not a
    wait), so a generate call of many steps keeps a bounded number of events."""

    HELD = 256

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._spent = {"prefill": 0.0, "draft": 0.0, "target": 0.0, "verify": 0.0}
        self._marks: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []  # CUDA: read in split
        self._start = time.perf_counter()

    @contextmanager
    def __call__(self, phase: str):
        if self._cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            yield
            end.record()
            self._marks.append((phase, begin, end))
            if len(self._marks) > self.HELD:
                self._read_marks(wait=False)
        else:
            begin = time.perf_counter()
            yield
            self._spent[phase] += time.perf_counter() - begin

    def _read_marks(self, wait: bool) -> None:
        """Charge the marked phases; without ``wait``, only the oldest ones the device has passed."""
        if wait:
            torch.cuda.synchronize()
        done = 0
        while done < len(self._marks) and (wait or self._marks[done][2].query()):
            done += 1
        for phase, begin, end in self._marks[:done]:
            self._spent[phase] += begin.elapsed_time(end) / 1e3  # ms
        del self._marks[:done]

    def split(self) -> TimeSplit:
        if self._cuda:
            self._read_marks(wait=True)
        total = time.perf_counter() - self._start
        other = max(total - sum(self._spent.values()), 0.0)
        return TimeSplit(
            draft_s=self._spent["draft"],
            target_s=self._spent["target"],
            verify_s=self._spent["verify"],
            other_s=other,
            total_s=total,
            prefill_s=self._spent["prefill"],
        )
