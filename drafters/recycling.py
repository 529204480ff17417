"""Token Recycling (Luo et al., ACL 2025, arXiv 2408.08696): draft from the next-token candidates
the target itself proposed earlier and that decoding would otherwise throw away.

**Matrix.** For every token id t the drafter keeps M[t] = the ``top_k`` tokens the target's logits
ranked highest the last time it read t (an adjacency matrix [V, top_k] of token ids, best first;
-1 = unknown). After every step (``observe``) every row of the step's tree, the root and each
drafted node, accepted or not, replaces the matrix row of its token with the top_k of the target's
logits after it (row 0 is read after the root, row i + 1 after node i). When one token stands at
several rows of a step, one row wins: a row on the accepted path (the root's included) over a
rejected one, then the later row; with ``shared``, then the later batch row. A row is replaced,
not merged, as in the paper: the latest context is the best guess of what follows the token.

**Tree.** A static template of sibling-rank paths (r_1, ..., r_d), d <= ``depth``, r_j < ``top_k``,
is expanded breadth-first from the root (the last committed token): the node at path (..., r_d)
takes token M[t][r_d], t its parent's token, so one gather over the batch fills a depth. An unknown
entry (-1) prunes the node and its subtree, and the kept nodes are compacted (a request whose
root's row is unknown drafts nothing). The template is the ``total_tokens`` paths of highest prior

    prior(r_1, ..., r_d) = prod_j 1 / (2 (r_j + 1))

each depth halving a path's chance and a rank-r candidate being 1 / (r + 1) as likely as the rank-0
one; ties go to the shallower path, then to lower ranks. A child never scores above its parent, so
the template is a tree (every path's prefix is in it). Under the defaults (depth 3, top_k 3,
total_tokens 7): three children of the root, two under the first, one under the second, and the
rank-0 chain three deep. A node's ``confidence`` is its prior (what a budgeted union ranks by).

**Options.**
- ``shared=False``: one matrix per request, empty when it is admitted and dropped when it leaves,
  so a request drafts only from what the target said over its own text (and prompt). ``True``: one
  matrix for every request, kept across requests, batches and calls of the drafter object (the
  paper's hot start). Not the default: a measurement that decodes the same prompts again
  (specdec-run's warm-up and timed passes) would draft later passes from what the target said over
  the very same text, an optimistic tau a stream of new requests never sees; and at T > 0 a
  request's realised sample can then depend on its neighbours and on earlier calls (its
  distribution never does, below).
- ``seed_from_prompt=True``: when a request arrives, every token of its prompt whose matrix row is
  unknown gets the tokens that followed it in the prompt, most recent first (up to top_k distinct):
  a fresh per-request matrix then drafts from the first step (word pieces, names and phrases
  repeated from the prompt) instead of only after the target has been read at the root's token. The
  target's logits replace a seeded row as soon as its token is read; in shared mode rows the
  target already filled are left alone.

**Exactness.** The tree a step verifies is a deterministic function of the committed text (prompt
and accepted tokens), of the tokens drafted in earlier steps and of the target's logits over those
earlier trees, which are themselves functions of text and drafts: never of the coins (``VerifyNoise``) of
the step that verifies it, which are drawn after the tree is fixed. Earlier coins
do shape the matrix (they chose the committed text), as they shape any lookup drafter's context;
in shared mode other requests' past shapes it too, still never this step's coins. Each node is a
point mass (a fixed token), so the tree is ``SiblingMode.DETERMINISTIC`` and the point-mass rule
keeps decoding exact at any temperature, top-k and top-p included.

**Cost.** The update is one top_k over the tree's logits rows, one sort to pick each token's
winning row, and one scatter; the expansion one gather per depth, with one host read (the widest
kept tree, so the target computes no empty rows). Per-request matrices take V * top_k int32 each
(SmolLM2: under 1 MB at top_k 3), on the target's device.
"""

from __future__ import annotations

import heapq

import torch
from torch import Tensor

from drafters.base import BudgetKnobs, DraftContext, DraftTree, DrafterBase, SiblingMode, VerifyResult, register
from specdec.protocols import Target
from specdec.speedup import TreeShape
from specdec.tree import parents_from_paths, sorted_paths

UNKNOWN = -1  # a matrix entry no logits or prompt has filled
RankPath = tuple[int, ...]  # sibling ranks from the root, one per depth


def prior_denominator(path: RankPath) -> int:
    """1 / prior(path): the prior is prod_j 1 / (2 (r_j + 1)) (module docstring), kept as an integer
    so that equal priors compare equal."""
    denominator = 1
    for rank in path:
        denominator *= 2 * (rank + 1)
    return denominator


def template(depth: int, top_k: int, total_tokens: int) -> list[RankPath]:
    """The ``total_tokens`` rank paths of highest prior (fewer when depth and top_k hold fewer), in
    node order: by depth, then by path (specdec.tree.sorted_paths), so parents precede children."""
    frontier = [(prior_denominator((rank,)), 1, (rank,)) for rank in range(top_k)]
    heapq.heapify(frontier)
    chosen: list[RankPath] = []
    while frontier and len(chosen) < total_tokens:
        denominator, length, path = heapq.heappop(frontier)
        chosen.append(path)
        if length < depth:  # children enter only once their parent is in: the result is prefix-closed
            for rank in range(top_k):
                heapq.heappush(frontier, (denominator * 2 * (rank + 1), length + 1, path + (rank,)))
    return sorted_paths(chosen)


def stable_order(*keys: Tensor) -> Tensor:
    """Indices sorting 1-D ``keys`` lexicographically, the first key most significant (stable)."""
    order = torch.arange(keys[0].numel(), device=keys[0].device)
    for key in reversed(keys):
        order = order[torch.sort(key[order], stable=True).indices]
    return order


def last_of_runs(sorted_keys: Tensor) -> Tensor:  # [n] bool
    """Which entries of a sorted key tensor are the last of their run of equal keys."""
    last = torch.ones_like(sorted_keys, dtype=torch.bool)
    last[:-1] = sorted_keys[1:] != sorted_keys[:-1]
    return last


class RecyclingDrafter(DrafterBase):
    def __init__(
        self, target: Target, depth: int, top_k: int, total_tokens: int, shared: bool, seed_from_prompt: bool
    ) -> None:
        self.vocab_size, self.top_k = target.vocab_size, top_k
        self.shared, self.seed_from_prompt = shared, seed_from_prompt
        device = target.device
        self.paths = template(depth, top_k, total_tokens)
        self.parents = torch.tensor(parents_from_paths(self.paths), dtype=torch.int64, device=device)  # [N]
        self.ranks = torch.tensor([path[-1] for path in self.paths], dtype=torch.int64, device=device)  # [N]
        self.prior = torch.tensor([1.0 / prior_denominator(path) for path in self.paths], device=device)  # [N]
        lengths = [len(path) for path in self.paths]
        self.levels = [slice(lengths.index(d), len(lengths) - lengths[::-1].index(d)) for d in range(1, max(lengths) + 1)]
        self.report = {"tree": [list(path) for path in self.paths]}
        # shared: [V, top_k], for the drafter's life; else [B, V, top_k], one matrix per batch row
        shape = (self.vocab_size, top_k) if shared else (0, self.vocab_size, top_k)
        self.matrix = torch.full(shape, UNKNOWN, dtype=torch.int32, device=device)
        self._fresh: list[bool] = []  # per batch row: not yet seeded from its prompt
        self._roots: Tensor | None = None  # [B] the last proposal's root tokens, for observe

    # ----- batch rows -----

    def reset(self, batch_size: int, max_length: int) -> None:
        if not self.shared:
            self.matrix = self._empty(batch_size)
        self._fresh, self._roots = [True] * batch_size, None

    def admit(self, count: int, max_length: int) -> None:
        if not self.shared:
            self.matrix = torch.cat([self.matrix, self._empty(count)])
        self._fresh += [True] * count

    def retain(self, rows: Tensor) -> None:
        if not self.shared:
            self.matrix = self.matrix[rows]
        self._fresh = [self._fresh[row] for row in rows.tolist()]

    def commit(self, tree: DraftTree, result: VerifyResult) -> None:
        pass  # the matrix learns from the logits (observe); the committed text arrives with the next context

    def _empty(self, count: int) -> Tensor:
        return torch.full((count, self.vocab_size, self.top_k), UNKNOWN, dtype=torch.int32, device=self.matrix.device)

    def _rows(self) -> Tensor:  # [B * V or V, top_k], a view: a token's row is slot b * V + t (or t)
        return self.matrix if self.shared else self.matrix.view(-1, self.top_k)

    def _slots(self, tokens: Tensor, batch_rows: Tensor) -> Tensor:
        """Matrix rows of ``tokens`` [B, n] held by batch rows ``batch_rows`` [B]."""
        return tokens if self.shared else batch_rows[:, None] * self.vocab_size + tokens

    # ----- drafting -----

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> DraftTree:
        batch = ctx.tokens.shape[0]
        if len(self._fresh) != batch:
            raise RuntimeError(
                f"the drafter tracks {len(self._fresh)} requests but the context has {batch}; "
                f"call reset/admit/retain as the batch changes"
            )
        if any(self._fresh):
            if self.seed_from_prompt:
                self._seed([b for b, fresh in enumerate(self._fresh) if fresh], ctx)
            self._fresh = [False] * batch
        root = ctx.tokens.gather(1, (ctx.lengths - 1)[:, None])[:, 0]  # [B]
        self._roots = root
        rows, batch_rows = self._rows(), torch.arange(batch, device=root.device)
        tokens = torch.empty(batch, len(self.paths), dtype=torch.int64, device=root.device)
        for level in self.levels:  # breadth-first: a depth's parents are filled before it
            parents = self.parents[level]
            parent_tokens = root[:, None].expand(-1, len(parents)) if level.start == 0 else tokens[:, parents]
            slots = self._slots(parent_tokens.clamp(min=0), batch_rows)
            drafted = rows[slots, self.ranks[level].expand_as(slots)].long()
            tokens[:, level] = torch.where(parent_tokens >= 0, drafted, UNKNOWN)  # an unknown parent prunes
        return self._compact(tokens)

    def _compact(self, tokens: Tensor) -> DraftTree:
        """The template's known nodes, in template order, as a tree as wide as the widest request's."""
        batch, n = tokens.shape
        keep = tokens >= 0  # closed under ancestors: a pruned node's children are pruned
        num_nodes = keep.sum(1)
        width = int(num_nodes.max()) if batch else 0  # the proposal's one host read
        order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, :width]  # kept nodes first
        new_index = keep.cumsum(1) - 1
        parents = self.parents.expand(batch, n).gather(1, order)
        parents = torch.where(parents >= 0, new_index.gather(1, parents.clamp(min=0)), -1)
        valid = torch.arange(width, device=tokens.device) < num_nodes[:, None]
        return DraftTree(
            tokens=torch.where(valid, tokens.gather(1, order), 0),
            parents=torch.where(valid, parents, -1),
            draft_probs=None,
            num_nodes=num_nodes,
            mode=SiblingMode.DETERMINISTIC,
            confidence=self.prior.expand(batch, n).gather(1, order),
        )

    # ----- learning -----

    @torch.no_grad()
    def observe(self, tree: DraftTree, logits: Tensor, result: VerifyResult) -> None:
        """Every row of the tree replaces its token's matrix row with the top_k of its logits."""
        if self._roots is None or self._roots.shape[0] != tree.batch_size:
            raise RuntimeError("observe needs the proposal of the same step (propose first)")
        batch, n = tree.tokens.shape
        device = tree.tokens.device
        row_tokens = torch.cat([self._roots[:, None], tree.tokens], 1).clamp(0, self.vocab_size - 1)  # [B, N+1]
        valid = torch.cat([torch.ones(batch, 1, dtype=torch.bool, device=device), tree.node_valid()], 1)
        on_path = torch.zeros(batch, n + 1, dtype=torch.bool, device=device)
        on_path[:, 0] = True
        on_path.scatter_(1, result.accepted_nodes + 1, True)  # padding (-1) marks row 0 again
        batch_rows = torch.arange(batch, device=device)
        # priority among rows holding one token: accepted over rejected, later over earlier; padding last
        priority = torch.arange(n + 1, device=device) + (n + 1) * on_path.long()
        if self.shared:  # then the later request
            priority = priority * batch + batch_rows[:, None]
        priority = torch.where(valid, priority, -1).flatten()
        slots = self._slots(row_tokens, batch_rows).flatten()
        rows = self._rows()
        candidates = logits[..., : self.vocab_size].topk(self.top_k, dim=-1).indices.to(torch.int32)  # [B, N+1, k]
        # a padding row writes back what its slot holds: a no-op unless a valid row of that slot wins
        candidates = torch.where(valid[..., None], candidates, rows[slots].view_as(candidates)).view(-1, self.top_k)
        order = stable_order(slots, priority)
        winners = order[last_of_runs(slots[order])]  # the highest priority row of each slot
        rows[slots[winners]] = candidates[winners]

    def _seed(self, fresh: list[int], ctx: DraftContext) -> None:
        """Rows of prompt tokens the matrix knows nothing about get the tokens that followed them in
        the prompt (rows ``fresh`` of ctx), most recent first, distinct, at most top_k."""
        batch_rows = torch.tensor(fresh, dtype=torch.int64, device=ctx.tokens.device)
        tokens, lengths = ctx.tokens[batch_rows], ctx.lengths[batch_rows]  # [F, L], [F]
        if tokens.shape[1] < 2:
            return
        positions = torch.arange(tokens.shape[1] - 1, device=tokens.device).expand(len(fresh), -1)
        pair = positions + 1 < lengths[:, None]  # (tokens[p], tokens[p + 1]) lies in the prompt
        slots = self._slots(tokens[:, :-1], batch_rows)[pair]
        following, positions = tokens[:, 1:][pair], positions[pair]
        order = stable_order(slots, following, positions)  # each distinct pair's latest position last
        slots, following, positions = slots[order], following[order], positions[order]
        last = last_of_runs(slots * self.vocab_size + following)
        slots, following, positions = slots[last], following[last], positions[last]
        order = stable_order(slots, -positions)  # per slot, most recent first
        slots, following = slots[order], following[order]
        if not len(slots):
            return
        index = torch.arange(len(slots), device=slots.device)
        first = torch.ones_like(slots, dtype=torch.bool)
        first[1:] = slots[1:] != slots[:-1]
        rank = index - torch.where(first, index, 0).cummax(0).values  # place within its slot's run
        rows = self._rows()
        write = (rank < self.top_k) & (rows[slots, 0] == UNKNOWN)  # rows the target filled stay
        rows[slots[write], rank[write]] = following[write].to(torch.int32)


def recycling_shape(top_k: int, **_) -> TreeShape:
    """Every node has at most top_k children (the candidates a matrix row holds)."""
    return TreeShape(children=top_k)


@register("recycling", shape=recycling_shape, budget=BudgetKnobs(depth="depth", nodes="total_tokens"))
def recycling(
    target: Target,
    depth: int = 3,
    top_k: int = 3,
    total_tokens: int = 7,
    shared: bool = False,
    seed_from_prompt: bool = True,
) -> RecyclingDrafter:
    """Token Recycling (module docstring): a static tree of ``total_tokens`` nodes, ``depth`` deep,
    filled from each token's ``top_k`` recycled candidates; ``shared`` = one matrix for every request
    (the paper's hot start), ``seed_from_prompt`` = prompt bigrams fill rows the target has not."""
    if depth < 1 or top_k < 1 or total_tokens < 1:
        raise ValueError(f"recycling needs depth, top_k and total_tokens >= 1; got {depth}, {top_k}, {total_tokens}")
    if top_k > target.vocab_size:
        raise ValueError(f"recycling: top_k={top_k} exceeds the target's vocabulary of {target.vocab_size} tokens")
    return RecyclingDrafter(target, depth, top_k, total_tokens, shared, seed_from_prompt)
