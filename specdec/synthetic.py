"""SyntheticTarget: a language model whose exact sequence distribution can be enumerated.

p(x_t | context) = softmax(sharpness * z(seed, last ``order`` tokens, t)), with z standard normal
noise derived from a hash of its arguments. Context-dependence through both the previous tokens and
the position means that any bug in how the loop feeds context, positions or commits changes the
distribution of sequences, which the statistical tests then detect.

Simulated cost (``forward_ms``, ``row_cost``): each forward then lasts T(n) = forward_ms *
(1 + row_cost * (n - 1)) for its widest tree of n rows (computing the logits included; it sleeps
up to that deadline). A model whose speed is known exactly is how the analytic speedup model is
checked against the real loop, its overheads included, without a GPU (docs/RESULTS.md, study a).
``new_shape_ms`` adds a one-off cost to the first forward of each shape (a prompt length, a batch
and tree width) in the process, as a CPU target pays for kernels created on first use: what a
measurement's warm-up has to keep out of the timed passes (experiments/run/measure.py).
"""

from __future__ import annotations

import math
import time

import torch
from torch import Tensor

from specdec.noise import hash32
from specdec.protocols import TargetOutput, VerifyResult, emitted_tokens
from specdec.sampling import SamplingParams, probabilities
from specdec.tree import DraftTree

NO_TOKEN = -1  # context slot before the start of the sequence


def hashed_normal(seed: int, context: Tensor, position: Tensor, vocab_size: int) -> Tensor:
    """[..., order] int64 context, [...] int64 position -> [..., V] float32 standard normals."""
    # statistical tests repeat a handful of contexts across 10^5 requests: hash each one once
    base = int(context.max()) + 2  # tokens are >= NO_TOKEN = -1
    keys = position.clone()
    for j in range(context.shape[-1]):
        keys = keys * base + (context[..., j] + 1)
    unique, inverse = torch.unique(keys.flatten(), return_inverse=True)
    first = torch.zeros_like(unique).scatter_(0, inverse, torch.arange(inverse.numel(), device=keys.device))
    flat_context = context.reshape(-1, context.shape[-1])
    normals = _hashed_normal(seed, flat_context[first], position.flatten()[first], vocab_size)
    return normals[inverse].reshape(*position.shape, vocab_size)


def _hashed_normal(seed: int, context: Tensor, position: Tensor, vocab_size: int) -> Tensor:
    state = hash32(torch.full_like(position, seed & 0xFFFFFFFF))
    for j in range(context.shape[-1]):
        state = hash32(state ^ ((context[..., j] + 2) & 0xFFFFFFFF))
    state = hash32(state ^ (position & 0xFFFFFFFF))
    lanes = torch.arange(vocab_size, device=context.device)
    first = hash32(state[..., None] ^ (lanes * 2 + 1))
    second = hash32(first ^ 0x5BD1E995)
    u1 = (first.double() + 0.5) / 2**32
    u2 = (second.double() + 0.5) / 2**32
    return (torch.sqrt(-2 * torch.log(u1)) * torch.cos(2 * math.pi * u2)).float()


class SyntheticTarget:
    """A Target (see specdec.protocols) with no weights: logits come from :func:`hashed_normal`."""

    invariant = True  # a row's logits are a hash of its own context, whatever the batch
    kind = "synthetic"
    key = "synthetic"

    def __init__(
        self,
        vocab_size: int = 6,
        order: int = 2,
        sharpness: float = 1.0,
        seed: int = 0,
        max_length: int = 1 << 20,
        device: str | torch.device = "cpu",
        forward_ms: float = 0.0,  # simulated T(1); 0 = as fast as it computes
        row_cost: float = 0.0,  # simulated extra cost per tree row, as a fraction of T(1)
        new_shape_ms: float = 0.0,  # simulated one-off cost of the first forward of each shape
    ) -> None:
        if vocab_size < 2 or order < 1 or sharpness < 0:
            raise ValueError("SyntheticTarget needs vocab_size >= 2, order >= 1 and sharpness >= 0")
        if forward_ms < 0 or row_cost < 0 or new_shape_ms < 0:
            raise ValueError(f"forward_ms, row_cost and new_shape_ms must be >= 0; got {forward_ms}, {row_cost}, {new_shape_ms}")
        self.vocab_size, self.order, self.sharpness, self.seed = vocab_size, order, sharpness, seed
        self.forward_ms, self.row_cost, self.new_shape_ms = forward_ms, row_cost, new_shape_ms
        self._shapes_seen: set[tuple[int, ...]] = set()
        self.max_length = max_length
        self.device = torch.device(device)
        self._history = torch.zeros(0, 0, dtype=torch.int64, device=self.device)  # [B, L] committed tokens incl. root
        self._lengths = torch.zeros(0, dtype=torch.int64, device=self.device)  # [B]

    def logits(self, context: Tensor, position: Tensor) -> Tensor:  # -> [..., V]
        """Next-token logits for a context window [..., order] predicting the token at position."""
        return self.sharpness * hashed_normal(self.seed, context, position, self.vocab_size)

    def prefill(self, prompts: list[Tensor], layers: tuple[int, ...]) -> TargetOutput:
        self._history, self._lengths = self._history[:0], self._lengths[:0]  # an empty batch, then admit
        return self.admit(prompts, layers)

    def admit(self, prompts: list[Tensor], layers: tuple[int, ...]) -> TargetOutput:
        if layers:
            raise ValueError("SyntheticTarget has no hidden states; use a drafter with target_layers=()")
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        width = max(int(lengths.max()), self._history.shape[1])
        history = torch.zeros(len(prompts), width, dtype=torch.int64, device=self.device)
        for i, p in enumerate(prompts):
            history[i, : len(p)] = p.to(self.device)
        old = torch.nn.functional.pad(self._history, (0, width - self._history.shape[1]))
        self._history = torch.cat([old, history])
        self._lengths = torch.cat([self._lengths, lengths])
        empty = torch.zeros(len(prompts), 0, self.vocab_size, device=self.device)
        # a prefill costs one forward
        spend_until(time.perf_counter(), self.forward_ms + self._first_time(0, *map(len, prompts)))
        return TargetOutput(empty, ())

    def forward_tree(self, tree: DraftTree, layers: tuple[int, ...]) -> TargetOutput:
        start = time.perf_counter()
        context = tree_context(tree, self._history, self._lengths, self.order)  # [B, N+1, order]
        positions = tree.positions(self._lengths - 1) + 1  # position of the token each row predicts
        logits = self.logits(context, positions)
        cost = self.forward_ms * (1 + self.row_cost * tree.max_nodes) + self._first_time(1, *tree.tokens.shape)
        spend_until(start, cost)
        return TargetOutput(logits, ())

    def _first_time(self, *shape: int) -> float:
        """new_shape_ms the first time a forward of this shape runs in the process, else 0."""
        if not self.new_shape_ms or shape in self._shapes_seen:
            return 0.0
        self._shapes_seen.add(shape)
        return self.new_shape_ms

    def commit(self, tree: DraftTree, result: VerifyResult) -> None:
        batch, n = result.accepted_nodes.shape
        new = emitted_tokens(tree, result)  # [B, N+1]
        needed = int(self._lengths.max()) + n + 1
        if needed > self._history.shape[1]:
            grow = max(needed - self._history.shape[1], self._history.shape[1])
            self._history = torch.nn.functional.pad(self._history, (0, grow))
        offsets = torch.arange(n + 1, device=new.device)
        keep = offsets < (result.num_accepted + 1)[:, None]
        rows = torch.arange(batch, device=new.device)[:, None].expand_as(keep)
        self._history[rows[keep], (self._lengths[:, None] + offsets)[keep]] = new[keep]
        self._lengths = self._lengths + result.num_accepted + 1

    def retain(self, rows: Tensor) -> None:
        self._history, self._lengths = self._history[rows], self._lengths[rows]

    def sequence_distribution(self, prompt: list[int], length: int, sampling: SamplingParams) -> Tensor:
        """Exact probability of every continuation of ``length`` tokens: [V ** length] float64,
        index = the continuation read as a base-V number (first token most significant)."""
        v = self.vocab_size
        prefix = torch.tensor(prompt, dtype=torch.int64, device=self.device)[None, :]  # [1, P]
        probs = torch.ones(1, dtype=torch.float64, device=self.device)
        tokens = torch.arange(v, device=self.device)  # [V]
        for t in range(length):
            padding = torch.full((prefix.shape[0], self.order), NO_TOKEN, device=self.device)  # [M, order]
            context = torch.cat([padding, prefix], 1)[:, -self.order :]  # [M, order]
            position = torch.full((prefix.shape[0],), prefix.shape[1], dtype=torch.int64, device=self.device)  # [M]
            step = probabilities(self.logits(context, position), sampling).double()  # [M, V]
            probs = (probs[:, None] * step).reshape(-1)
            prefix = torch.cat([prefix.repeat_interleave(v, 0), tokens.repeat(prefix.shape[0])[:, None]], 1)
        return probs


def spend_until(start: float, milliseconds: float) -> None:
    """Sleep until ``milliseconds`` after ``start`` (perf_counter seconds); no-op when 0 or past."""
    remaining = start + milliseconds / 1000 - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)


def tree_context(
    tree: DraftTree,
    history: Tensor,  # [B, L] int64 committed tokens, root at lengths - 1
    lengths: Tensor,  # [B] int64
    order: int,
) -> Tensor:  # [B, N+1, order] int64, last `order` tokens ending at each row (oldest first)
    """Walk up from each row through the tree, then into the committed history."""
    batch, n = tree.tokens.shape
    # row r > 0 is node r-1, row 0 the root, row -k the k-th committed token before the root
    row = torch.arange(n + 1, device=history.device).expand(batch, n + 1)
    node_tokens = torch.cat([torch.zeros(batch, 1, dtype=torch.int64, device=history.device), tree.tokens], 1)
    parent_rows = torch.cat([torch.zeros(batch, 1, dtype=torch.int64, device=history.device), tree.parents + 1], 1)
    collected = []
    for _ in range(order):
        history_index = lengths[:, None] - 1 + row.clamp(max=0)  # [B, N+1]
        from_history = history.gather(1, history_index.clamp(min=0))
        from_history = torch.where(history_index >= 0, from_history, NO_TOKEN)
        collected.append(torch.where(row > 0, node_tokens.gather(1, row.clamp(min=0)), from_history))
        row = torch.where(row > 0, parent_rows.gather(1, row.clamp(min=0)), row - 1)
    return torch.stack(collected[::-1], dim=-1)
