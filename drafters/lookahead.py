"""Lookahead decoding (Fu et al., ICML 2024, "Break the Sequential Dependency of LLM Inference Using
Lookahead Decoding"): the target drafts for itself by Jacobi iteration, with no draft model.

**Per request** the drafter keeps a 2D *lookahead window* of guessed future tokens, ``ngram - 1``
levels by ``window`` columns (W columns, N-gram size N), and an *n-gram pool* keyed by first token.
Write x for the committed text, the root x[n] its last token, L_0 the first level (W - 1 tokens; its
column 0 is the root itself) and L_1 .. L_{N-2} the later ones (W tokens each). Column i's
*trajectory* is the chain

    root, L_0[1], ..., L_0[i], L_1[i], L_2[i], ..., L_{N-2}[i]     (positions n, n+1, ..., n+i+N-2)

and one Jacobi step predicts, after its last token, the token at position n + i + N - 1: new[i].
Each step then

1. collects column i's n-gram (L_0[i], L_1[i], ..., L_{N-2}[i], new[i]) into the pool under its
   first token (``L_0[0]`` = the root): at most ``guesses`` continuations per key, least recently
   seen evicted first (the paper's per-key pool, GUESS_SET_SIZE);
2. slides the window one level: L_0 <- L_1 without its column 0, L_j <- L_{j+1}, L_{N-2} <- new.

The *verification branch* drafts the pool's continuations (N - 1 tokens each) of the root, most
recently seen first, at most ``guesses`` of them.

**One forward per step, as the paper does.** The paper's attention mask (its Figure 3, and
``j_make_causal_mask_multilevel`` in hao-ai-lab/LookaheadDecoding) lets the first block (the root
and L_0) attend causally, and a token of level j >= 1 in column i attend to the first block's
columns 0..i and to levels 1..j-1 of its own column: exactly column i's trajectory above, with
positions n + i + j. Every window token thus sees its ancestors and only them in a tree that is a
comb: the spine root -> L_0[1] -> ... -> L_0[W-1] and, hanging from the spine's column i, the tail
L_1[i] -> ... -> L_{N-2}[i]. ``Target.forward_tree`` (ancestors-only attention, position = committed
length + depth) computes exactly the paper's window rows when that comb is part of the drafted tree.
So the drafter proposes one tree: the pool's guesses and every window trajectory as token paths
from the root, merged into a trie (drafts that share a prefix share its nodes; siblings in order:
guesses, then the window's columns). After the step, ``observe`` gets the target's logits over that
tree; it finds the last node of each column's trajectory by its token path (in a union the tree is
the union's trie; the logits of a node are a function of its token path alone) and takes the argmax
after it as new[i]. One forward per step, as in the paper; what differs:

- the window's rows are verified like any draft (the verifiers treat every node as a candidate):
  they are deterministic drafts, so this is exact, and once a trajectory has converged to the text
  its tokens are accepted (plain Jacobi decoding's gain, on top of the guesses);
- the merged trie verifies a prefix shared by several guesses, or by a guess and a window trajectory
  (the pool's continuation of the root is often column 0's trajectory itself), once; the paper
  verifies G disjoint n-grams beside the window;
- the window is filled at once from the prompt (tokens at fixed pseudo-random positions of the
  prompt, a deterministic function of it) instead of level by level over N - 2 warm-up steps;
  n-grams are collected from the (N - 1)-th step on, when every token after their key came out of
  a Jacobi step, as after the paper's warm-up. Guesses are drafted whenever the pool has some;
- when the step's tree lacks a column's trajectory (``prune_to_depth`` near max_new_tokens, or a
  budgeted union that dropped low-confidence nodes), that column keeps its last token and yields
  no n-gram;
- the window slides one level per step whatever the step accepted, as the paper's default
  (ALWAYS_FWD_ONE) does; batches of requests each keep their own window and pool.

**Cost, in tree rows.** The window costs (W - 1) + W (N - 2) rows every step, the guesses at most
G (N - 1) more (fewer when they share prefixes with each other or with the window), plus the root:
with the defaults (W, N, G) = (3, 3, 3), at most 5 + 6 nodes. The paper sizes the window for a GPU,
where rows are nearly free (W = 15, N = 5, G = 15 for 7B models); on a CPU the forward's time
climbs with its rows, which is why configs/drafter/lookahead.yaml keeps the window small.

**Exactness.** Every draft is a deterministic function of the request's history: the window and
pool are built from the prompt, the committed tokens and the target's logits over earlier steps'
trees (themselves functions of that history), never from the coins of the step that verifies the
draft. So the tree is DETERMINISTIC (a point-mass q per node) and the point-mass rule verifies it
exactly at any temperature: each step's output has the target's distribution given the committed
text, whichever candidates it was offered (tests/test_exactness.py checks it at T = 1 through the
whole loop). The Jacobi updates use the argmax of the logits at every temperature (as the paper's
guesses do), the logits being those of the sampling-free target.

**Budget.** It registers no ``budget.mode=auto`` knobs: the chooser prices a drafter as a chain or
tree of candidates with a per-depth acceptance, but a lookahead tree's window rows are a fixed
price paid for later steps' guesses, and N sets at once the window's levels, its depth (W + N - 3)
and the guesses' length. No depth or node count of that model maps onto W, N or G.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor

from drafters.base import (
    BudgetKnobs,
    DraftContext,
    DrafterBase,
    DraftTree,
    SiblingMode,
    VerifyResult,
    register,
)
from specdec.protocols import Target

INIT_SEED = 0  # the fixed pattern of prompt positions the window starts from (any fixed pattern is exact)


class LookaheadDrafter(DrafterBase):
    def __init__(self, target: Target | None = None, window: int = 3, ngram: int = 3, guesses: int = 3) -> None:
        if window < 1 or ngram < 2 or guesses < 0:
            raise ValueError(f"lookahead needs window >= 1, ngram >= 2 and guesses >= 0; got {window}, {ngram}, {guesses}")
        self.window, self.ngram, self.guesses = window, ngram, guesses
        w, levels = window, ngram - 1
        # the comb's slots (level, column, parent slot; -1 = the root), column by column as a token
        # trie of the columns' paths orders them: column i's spine node L_0[i] (i >= 1), then its
        # tail L_1[i] .. L_{N-2}[i]
        comb: list[tuple[int, int, int]] = []
        spine = -1
        for i in range(w):
            if i >= 1:
                comb.append((0, i, spine))
                spine = len(comb) - 1
            parent = spine
            for j in range(1, levels):
                comb.append((j, i, parent))
                parent = len(comb) - 1
        self._slot_level = [level for level, _, _ in comb]
        self._slot_column = [column for _, column, _ in comb]
        self._slot_parent = [parent for _, _, parent in comb]
        # column i's trajectory after the root: L_0[1..i], then L_1[i] .. L_{N-2}[i] (length i + N - 2)
        self._depth = w + ngram - 3  # the longest trajectory (column W - 1)
        # host tables until the first proposal meets the data's device (target may be None)
        level = torch.zeros(w, max(self._depth, 1), dtype=torch.int64, device="cpu")
        column = torch.zeros_like(level)
        for i in range(w):
            for k in range(i + ngram - 2):
                level[i, k], column[i, k] = (0, k + 1) if k < i else (k - i + 1, i)
        self._path_level, self._path_column = level, column
        self._path_length = torch.arange(w, device="cpu") + ngram - 2  # [W]
        # per request: the window (level 0's column 0 unused: the root stands there), Jacobi steps
        # taken, whether it still needs filling from the prompt, and the pool key -> continuations
        self._levels = torch.zeros(0, levels, w, dtype=torch.int64, device="cpu")
        self._age = torch.zeros(0, dtype=torch.int64, device="cpu")
        self._fresh: list[bool] = []  # host-side: whether the window still needs filling from the prompt
        self._pools: list[dict[int, list[tuple[int, ...]]]] = []
        self._roots: Tensor | None = None  # [B] the roots of the last proposal

    # -- batch rows ------------------------------------------------------------------------------

    def reset(self, batch_size: int, max_length: int) -> None:
        self._levels = torch.zeros(0, self.ngram - 1, self.window, dtype=torch.int64, device=self._levels.device)
        self._age, self._fresh = self._age[:0], []
        self._pools, self._roots = [], None
        self.admit(batch_size, max_length)

    def admit(self, count: int, max_length: int) -> None:
        device = self._levels.device
        self._levels = torch.cat([self._levels, torch.zeros(count, *self._levels.shape[1:], dtype=torch.int64, device=device)])
        self._age = torch.cat([self._age, torch.zeros(count, dtype=torch.int64, device=device)])
        self._fresh += [True] * count
        self._pools += [{} for _ in range(count)]

    def retain(self, rows: Tensor) -> None:
        rows = rows.to(self._levels.device)
        self._levels, self._age = self._levels[rows], self._age[rows]
        kept = rows.tolist()
        self._pools, self._fresh = [self._pools[row] for row in kept], [self._fresh[row] for row in kept]
        self._roots = None

    def commit(self, tree: DraftTree, result: VerifyResult) -> None:
        pass  # the window moves in observe, from the target's logits; the text reaches propose

    # -- drafting --------------------------------------------------------------------------------

    def propose(self, ctx: DraftContext) -> DraftTree:
        batch, device = ctx.tokens.shape[0], ctx.tokens.device
        if len(self._pools) != batch:
            raise RuntimeError(
                f"the drafter tracks {len(self._pools)} requests but the context has {batch}; "
                f"call reset/admit/retain as the batch changes"
            )
        if self._levels.device != device:
            self._levels, self._age = self._levels.to(device), self._age.to(device)
        if any(self._fresh):
            self._fill(ctx.tokens, ctx.lengths)
        roots = ctx.tokens.gather(1, (ctx.lengths - 1)[:, None])[:, 0]  # [B]
        self._roots = roots
        guesses, counts = self._guesses(roots.tolist(), device)  # [B, G', N-1], [B]
        # slots: the guesses' chains (G' x (N - 1)), then the window's comb
        n = self.ngram - 1
        g = guesses.shape[1]
        guess_parent = [slot - 1 if slot % n else -1 for slot in range(g * n)]
        comb_parent = [p + g * n if p >= 0 else -1 for p in self._slot_parent]
        comb = self._levels[:, self._slot_level, self._slot_column]  # [B, comb slots]
        tokens = torch.cat([guesses.reshape(batch, g * n), comb], 1)
        guess_valid = (torch.arange(g, device=device) < counts[:, None]).repeat_interleave(n, 1)  # [B, G' (N-1)]
        valid = torch.cat([guess_valid, torch.ones_like(comb, dtype=torch.bool)], 1)
        confidence = torch.cat([_shares(guesses, counts).reshape(batch, g * n), torch.zeros_like(comb, dtype=torch.float32)], 1)
        return merge_slots(tokens, valid, guess_parent + comb_parent, confidence)

    def _fill(self, tokens: Tensor, lengths: Tensor) -> None:
        """The window of each fresh request, from its prompt: tokens at a fixed pseudo-random
        pattern of prompt positions (the paper copies random prompt tokens)."""
        fresh = torch.tensor([row for row, new in enumerate(self._fresh) if new], dtype=torch.int64, device=tokens.device)
        shape = self._levels.shape[1:]
        generator = torch.Generator().manual_seed(INIT_SEED)
        fraction = torch.rand(shape, generator=generator, dtype=torch.float64, device="cpu")  # [N-1, W]
        fraction = fraction.to(tokens.device)
        position = (fraction[None] * lengths[fresh, None, None]).long()  # [F, N-1, W], < the prompt's length
        self._levels[fresh] = tokens[fresh].gather(1, position.flatten(1)).view(-1, *shape)
        self._age[fresh] = 0
        self._fresh = [False] * len(self._fresh)

    def _guesses(self, roots: list[int], device: torch.device) -> tuple[Tensor, Tensor]:
        """The pool's continuations of each root, most recently seen first: [B, G', N-1] (G' the
        most any request has, zero-padded) and their counts [B]."""
        n = self.ngram - 1
        found = [pool.get(root, ())[::-1] for pool, root in zip(self._pools, roots)]
        width = max((len(f) for f in found), default=0)
        counts = torch.tensor([len(f) for f in found], dtype=torch.int64, device=device)
        if width == 0:
            return torch.zeros(len(roots), 0, n, dtype=torch.int64, device=device), counts
        pad = (0,) * n
        flat = [list(f) + [pad] * (width - len(f)) for f in found]
        return torch.tensor(flat, dtype=torch.int64, device=device), counts

    # -- the Jacobi step -------------------------------------------------------------------------

    def observe(self, tree: DraftTree, logits: Tensor, result: VerifyResult) -> None:
        if self._roots is None:
            return  # no proposal since the batch changed: nothing of ours was verified
        batch, levels = self._levels.shape[0], self.ngram - 1
        rows, found = self.trajectory_rows(tree)  # [B, W]
        batch_index = torch.arange(batch, device=logits.device)[:, None]
        new = logits[batch_index, rows.to(logits.device)].argmax(-1).to(self._levels.device)  # [B, W]
        block = self._levels[:, 0].clone()
        block[:, 0] = self._roots  # the first level with the root in column 0
        top = self._levels[:, -1] if levels > 1 else block  # each column's last token
        new = torch.where(found, new, top)
        if self.guesses:
            ngrams = torch.cat([block[:, None], self._levels[:, 1:], new[:, None]], 1).transpose(1, 2)  # [B, W, N]
            keep = found & (self._age >= levels - 1)[:, None]
            self._collect(torch.where(keep[:, :, None], ngrams, -1).tolist())
        self._levels = torch.cat([self._levels[:, 1:], new[:, None]], 1)  # slide one level
        self._age = self._age + 1
        self._roots = None

    def trajectory_rows(self, tree: DraftTree) -> tuple[Tensor, Tensor]:
        """The row (0 = root, i + 1 = node i) of the last node of each column's trajectory in
        ``tree``, found by its token path, and whether the tree has it: [B, W] each."""
        device = tree.tokens.device
        batch, w = self._levels.shape[0], self.window
        node = torch.full((batch, w), -1, dtype=torch.int64, device=device)
        found = torch.ones(batch, w, dtype=torch.bool, device=device)
        if self._depth > 0:
            levels = self._levels.to(device)
            paths = levels[:, self._path_level.to(device), self._path_column.to(device)]  # [B, W, D]
            length = self._path_length.to(device)
            valid = tree.node_valid()[:, None, :]  # [B, 1, N]
            for k in range(self._depth):
                active = k < length  # [W]
                child = valid & (tree.parents[:, None, :] == node[:, :, None]) & (tree.tokens[:, None, :] == paths[:, :, k, None])
                has = child.any(-1)
                step = torch.where(has, child.to(torch.int8).argmax(-1), node)
                node = torch.where(active, step, node)
                found &= ~active | has
        return (node + 1).to(self._levels.device), found.to(self._levels.device)

    def _collect(self, ngrams: list[list[list[int]]]) -> None:
        """Each request's n-grams (key first; key -1 = none) into its pool, least recently seen
        evicted past ``guesses`` per key."""
        limit = self.guesses
        for pool, request in zip(self._pools, ngrams):
            for key, *continuation in request:
                if key < 0:
                    continue
                entry = tuple(continuation)
                seen = pool.setdefault(key, [])
                if entry in seen:
                    seen.remove(entry)
                elif len(seen) == limit:
                    del seen[0]
                seen.append(entry)

    def pool(self, row: int) -> dict[int, list[tuple[int, ...]]]:
        """Request ``row``'s n-gram pool: first token -> continuations, least recently seen first."""
        return self._pools[row]

    def levels(self) -> Tensor:
        """The window [B, N-1, W]: level 0's column 0 is unused (the root stands there)."""
        return self._levels


def _shares(guesses: Tensor, counts: Tensor) -> Tensor:  # [B, G, N-1] float32
    """Each guess token's confidence: the share of the request's drafted guesses through it."""
    g = guesses.shape[1]
    valid = torch.arange(g, device=guesses.device) < counts[:, None]  # [B, G]
    same = (guesses[:, :, None, :] == guesses[:, None, :, :]).to(torch.int64).cumprod(-1).bool()  # [B, G, G, N-1]
    support = (same & valid[:, None, :, None]).sum(2)  # [B, G, N-1]
    return (support / counts.clamp(min=1)[:, None, None]).float()


def merge_slots(tokens: Tensor, valid: Tensor, parents: list[int], confidence: Tensor) -> DraftTree:
    """A DETERMINISTIC tree from drafted slots [B, S] whose topology ``parents`` (a slot's parent
    slot, -1 = the root, always an earlier slot) is shared by the batch: valid slots with the same
    token path from the root become one node (as token_trie merges drafts), nodes in the order of
    their first slot; a node's confidence is its slots' highest. Width: the most nodes any request
    keeps."""
    batch, slots = tokens.shape
    device = tokens.device
    if slots == 0:
        none = torch.zeros(batch, 1, dtype=torch.int64, device=device)
        return DraftTree(none, none - 1, None, none[:, 0], SiblingMode.DETERMINISTIC, confidence=none.float())
    own = torch.arange(slots, device=device)
    ancestry, up = (torch.tensor(x, dtype=torch.int64, device=device) for x in _ancestry(tuple(parents)))
    # each slot's token path from the root, padded with -1 (tokens are >= 0): equal paths, equal depths
    padded = torch.cat([torch.where(valid, tokens, -1), torch.full((batch, 1), -1, dtype=torch.int64, device=device)], 1)
    paths = padded[:, ancestry]  # [B, S, D]
    same = (paths[:, :, None, :] == paths[:, None, :, :]).all(-1) & valid[:, :, None] & valid[:, None, :]  # [B, S, S]
    canon = torch.where(valid, same.to(torch.int8).argmax(-1), own)  # the first slot with its path
    kept = valid & (canon == own)
    index = kept.cumsum(1) - 1  # [B, S] a kept slot's node index
    num_nodes = kept.sum(1)
    width = max(int(num_nodes.max()) if batch else 0, 1)
    order = torch.argsort((~kept).to(torch.int8), dim=1, stable=True)[:, :width]  # kept slots first, in order
    node_valid = own[:width] < num_nodes[:, None]
    node_tokens = torch.where(node_valid, tokens.gather(1, order), 0)
    parent_slot = up[order]  # [B, width] the parent slot (-1 = root) of each kept slot
    parent_node = index.gather(1, canon.gather(1, parent_slot.clamp(min=0)))
    node_parents = torch.where(node_valid & (parent_slot >= 0), parent_node, -1)
    best = torch.zeros(batch, slots, dtype=torch.float32, device=device).scatter_reduce(
        1, canon, torch.where(valid, confidence, 0.0), "amax")
    node_confidence = torch.where(node_valid, best.gather(1, order), 0.0)
    return DraftTree(node_tokens, node_parents, None, num_nodes, SiblingMode.DETERMINISTIC, confidence=node_confidence)


@lru_cache(maxsize=64)
def _ancestry(parents: tuple[int, ...]) -> tuple[list[list[int]], list[int]]:
    """Per slot, the slots on its path from the root (itself last), padded to the deepest with S
    (a column of -1 in merge_slots); and the parents as a list."""
    paths: list[list[int]] = []
    for slot, parent in enumerate(parents):
        if not -1 <= parent < slot:
            raise ValueError(f"slot {slot} has parent {parent}; a parent is -1 (the root) or an earlier slot")
        paths.append((paths[parent] if parent >= 0 else []) + [slot])
    depth = max((len(p) for p in paths), default=1)
    return [p + [len(parents)] * (depth - len(p)) for p in paths], list(parents)


# No budget.mode=auto knobs: its chooser prices candidates with a per-depth acceptance, not a
# window of rows paid for later steps' guesses (module docstring, "Budget")
@register("lookahead", budget=BudgetKnobs())
def lookahead(target: Target, window: int = 3, ngram: int = 3, guesses: int = 3) -> LookaheadDrafter:
    return LookaheadDrafter(target, window, ngram, guesses)
