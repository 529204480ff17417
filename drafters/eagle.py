"""EAGLE drafters: a one-layer head that extrapolates the target's features.

Terms. f_t is the target feature after reading token x_t (a stored target layer; EAGLE-1 uses the
final-norm output, the LM head's input). The head reads row t = (f_t, x_{t+1}), i.e. the feature
and the NEXT token's embedding, fused by ``fc``, runs one causal transformer block over rows, and
outputs h_t, its estimate of f_{t+1}; the target's frozen LM head turns h_t into draft logits for
x_{t+2}. Drafting feeds h back in place of the feature it estimates.

- ``eagle`` (EAGLE-1): a chain, the argmax (T = 0) or the top-1 at any temperature.
- ``eagle2`` (EAGLE-2 dynamic tree): at every depth expand the top_k children of the top_k best
  nodes by cumulative draft log-probability; keep the ``total_tokens`` best nodes of the pool.

By default both trees are DETERMINISTIC (top-k candidates), verified exactly by the point-mass rule
at any temperature. ``sampling=sampled_iid|sampled_wor`` instead draws each expanded node's top_k
children from the head's processed distribution q (i.i.d. or without replacement) and carries q
for the p/q test (T > 0; greedy stays deterministic). A sampled sibling group is exact only as a
whole draw in its drawn order, so those trees keep or drop whole groups: the root's, then the
groups under the best-scoring parents, up to total_tokens. ``shape=static`` (sampled trees) picks
by draw position instead of score: at every depth the first-drawn child of each frontier node is
expanded, and groups are kept in pool order, so no branch's shape depends on what another branch
drew, which traversal verification (verifier=traversal) needs. Which drafts accept more at T = 1:
docs/RESULTS.md. Committed rows come from the target's true features; draft rows live in the head's
own static KV cache past each request's committed length and are overwritten by the next commit.

Heads. The config's ``arch`` picks the function: ``native`` (EagleHead, every bundled head) or a
published architecture computed exactly as its reference code computes it (PublishedEagleHead:
``eagle1``, ``eagle3``), which drafters.formats.eagle reads from EAGLE, EAGLE-3 and SpecForge
checkpoints and specdec-export writes for vLLM and SGLang. ``checkpoint=DIR`` takes a head saved
here or a published one (``format=auto`` tells them apart by their files).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from drafters.base import DraftContext, DrafterBase, DraftTree, SiblingMode, VerifyResult
from drafters.eagle_config import EagleConfig
from drafters.eagle_published import PublishedEagleHead
from drafters.heads import (
    DecoderBlock,
    RMSNorm,
    catch_up_runs,
    causal_rows,
    draft_lm_head,
    load_checkpoint,
    register_draft_ids,
    token_embedding,
    use_target_kernels,
)
from specdec.protocols import HeadTarget
from specdec.sampling import probabilities


class EagleHead(DecoderBlock):
    """fc(cat(features..., embedding)) -> one pre-norm transformer block -> h (a feature estimate).

    ``draft_ids`` [K] are the target token ids the head drafts from: the frozen LM head's rows are
    taken only for them, which on a 49152-token vocabulary cuts the drafting cost several-fold
    (the candidates stay a deterministic top-k, so verification stays exact)."""

    def __init__(self, config: EagleConfig, draft_ids: Tensor | None = None) -> None:
        super().__init__()
        self.config = config
        register_draft_ids(self, draft_ids, config.draft_vocab_size)
        h = config.hidden_size
        # EAGLE-3 fuses several target layers into one feature; the head's own estimate h (drafting,
        # training-time test) enters after this fusion, in place of the fused feature
        layers = len(config.feature_layers)
        self.feature_fuse = nn.Linear(h * layers, h, bias=False) if layers > 1 else None
        self.feature_norm = RMSNorm(h, config.rms_eps) if config.feature_norm else None
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.add_block(h, config.num_heads, config.intermediate_size, config.rope_theta, config.rms_eps)

    def fuse(self, features: Tensor, embeddings: Tensor) -> Tensor:
        """features [B, R, n*H] (target layers) or [B, R, H] (an estimate h); embeddings [B, R, H]."""
        if self.feature_fuse is not None and features.shape[-1] != embeddings.shape[-1]:
            features = self.feature_fuse(features)
        if self.feature_norm is not None:
            features = self.feature_norm(features)
        return self.fc(torch.cat([features, embeddings], -1))

    def rows(self, features: Tensor, embeddings: Tensor, positions: Tensor, keys: Tensor | None, values: Tensor | None,
             mask: Tensor, write: Tensor | None = None) -> Tensor:  # [B, R, H]
        """The head over rows (features [B, R, n*H or H], embeddings [B, R, H]) at ``positions`` [B, R],
        attending to the cache as DecoderBlock.block does."""
        return self.block(self.fuse(features, embeddings), positions, keys, values, mask, write)

    def forward_sequence(self, features: Tensor, embeddings: Tensor) -> Tensor:
        """Training: causal over rows t = 0..T-1 at positions t. [B, T, n*H or H], [B, T, H] -> h [B, T, H]."""
        return self.rows(features, embeddings, *causal_rows(features))

    def logits_module(self, target: HeadTarget) -> nn.Module:
        """h [..., H] -> draft logits [..., K]: the target's frozen LM head rows for draft_ids."""
        return draft_lm_head(target, self.draft_ids)


def build_head(config: EagleConfig, draft_ids: Tensor | None = None) -> EagleHead | PublishedEagleHead:
    """The head class that computes ``config.arch``."""
    return EagleHead(config, draft_ids) if config.arch == "native" else PublishedEagleHead(config, draft_ids)


def load_head(directory: str | Path, target: HeadTarget) -> EagleHead | PublishedEagleHead:
    """Load a head and check it fits ``target``; clear errors for a foreign or corrupt checkpoint."""
    return load_checkpoint(directory, target, "eagle", parse_eagle_config, build_head)


def parse_eagle_config(raw: dict) -> EagleConfig:
    return EagleConfig(**{**raw, "feature_layers": tuple(raw["feature_layers"])})


class EagleDrafter(DrafterBase):
    """EAGLE-1 chains (top_k = 1) and EAGLE-2 dynamic trees over an EagleHead or a PublishedEagleHead."""

    def __init__(self, target: HeadTarget, head: EagleHead | PublishedEagleHead, depth: int = 4, top_k: int = 1,
                 total_tokens: int | None = None, sampling: str = "deterministic", shape: str = "dynamic") -> None:
        if depth < 1 or top_k < 1:
            raise ValueError(f"depth and top_k must be >= 1; got {depth}, {top_k}")
        modes = [m.value for m in SiblingMode]
        if sampling not in modes:
            raise ValueError(f"sampling={sampling!r}: choose one of {', '.join(modes)}")
        if shape not in ("dynamic", "static"):
            raise ValueError(f"shape={shape!r}: choose dynamic (expand by score) or static (by draw position)")
        if shape == "static" and sampling == "deterministic":
            raise ValueError(
                "shape=static is for sampled trees (sampling=sampled_iid or sampled_wor, for verifier=traversal); "
                "deterministic trees are exact under every verifier with their dynamic shape"
            )
        self.mode = SiblingMode(sampling)
        self.static = shape == "static"
        self.vocab_size = target.vocab_size
        self.head = use_target_kernels(head, target)
        self.embed = head.embed_tokens if head.config.own_embedding else token_embedding(target)
        self.draft_lm_head = self.head.logits_module(target)  # [..., H] -> [..., K], built from the packed head
        self.target_layers = head.config.feature_layers
        self.depth, self.top_k = depth, top_k
        self.total_tokens = total_tokens or depth * top_k
        self.device = target.device

    def quantizable(self) -> list[nn.Module]:
        return [self.head]  # the embeddings and LM head rows are the target's

    def reset(self, batch_size: int, max_length: int) -> None:
        c = self.head.config
        heads, width = c.kv_heads, c.width
        dtype = next(self.head.parameters()).dtype
        # committed rows, one proposal's draft rows past them, and a last slot for padding rows
        slots = max_length + self.depth * self.top_k + 2
        self.keys = torch.zeros(batch_size, heads, slots, width, dtype=dtype, device=self.device)
        self.values = torch.zeros_like(self.keys)
        self.length = torch.zeros(batch_size, dtype=torch.int64, device=self.device)  # committed rows

    def admit(self, count: int, max_length: int) -> None:
        keys, values, length = self.keys, self.values, self.length
        self.reset(count, max_length)  # fresh rows for the new requests, appended below
        slots = max(keys.shape[2], self.keys.shape[2])
        # a wider cache moves the padding slot; the old one holds junk but is overwritten before it is read
        pad = lambda t: F.pad(t, (0, 0, 0, slots - t.shape[2]))
        self.keys, self.values = torch.cat([pad(keys), pad(self.keys)]), torch.cat([pad(values), pad(self.values)])
        self.length = torch.cat([length, self.length])

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> DraftTree:
        last = self._commit_rows(ctx)  # [B, H] h of the last committed row: estimates the root's feature
        batch, rows = ctx.tokens.shape[0], torch.arange(ctx.tokens.shape[0], device=self.device)
        sampled = self.mode is not SiblingMode.DETERMINISTIC and not ctx.sampling.greedy
        scores, tokens, q = self._children(last[:, None], ctx, sampled)  # depth-1 pool: the token after the root
        scores, tokens = scores[:, 0], tokens[:, 0]
        pool_q = [q.expand(-1, self.top_k, -1)] if sampled else []  # q each node was drawn from
        pool_tokens, pool_parents, pool_scores = [tokens], [torch.full_like(tokens, -1)], [scores]
        pool_depths = [torch.ones_like(tokens)]
        frontier = torch.arange(self.top_k, device=self.device).expand(batch, -1)  # pool indices
        frontier_source = last[:, None, :].expand(-1, self.top_k, -1)  # [B, F, H] h feeding each node
        ancestors = torch.zeros(batch, 0, 0, dtype=torch.bool, device=self.device)  # draft rows' visibility
        frontier_rows = torch.full((batch, self.top_k), -1, device=self.device)  # draft row of each node's parent
        num_rows, size = 0, self.top_k
        flat_tokens, flat_scores = tokens, scores
        for depth in range(2, self.depth + 1):
            if not sampled and self._budget_full(flat_scores, frontier):
                break
            f = frontier.shape[1]
            # one head row per frontier node: input (h estimating its feature, its token)
            node_tokens = flat_tokens.gather(1, frontier)
            parent_rows = frontier_rows
            visible_draft = torch.zeros(batch, f, num_rows + f, dtype=torch.bool, device=self.device)
            if num_rows:
                inherited = ancestors[rows[:, None], parent_rows.clamp(min=0)] & (parent_rows >= 0)[:, :, None]
                visible_draft[:, :, :num_rows] = inherited
            visible_draft[:, :, num_rows:] = torch.eye(f, dtype=torch.bool, device=self.device)
            ancestors = torch.cat([torch.nn.functional.pad(ancestors, (0, f)), visible_draft], 1)
            out = self._draft_rows(frontier_source, node_tokens, depth, num_rows, visible_draft)  # [B, F, H]
            child_scores, child_tokens, q = self._children(out, ctx, sampled)  # [B, F, K]
            if sampled:
                pool_q.append(q[:, :, None, :].expand(-1, -1, self.top_k, -1).flatten(1, 2))
            child_scores = child_scores + flat_scores.gather(1, frontier)[:, :, None]
            pool_tokens.append(child_tokens.flatten(1))
            pool_parents.append(frontier[:, :, None].expand(-1, -1, self.top_k).flatten(1))
            pool_scores.append(child_scores.flatten(1))
            pool_depths.append(torch.full_like(child_tokens.flatten(1), depth))
            new_rows = num_rows + torch.arange(f, device=self.device)[None, :, None].expand(batch, -1, self.top_k).flatten(1)
            flat_tokens = torch.cat(pool_tokens, 1)
            flat_scores = torch.cat(pool_scores, 1)
            # next frontier: the top_k best new nodes, or (static) the first-drawn child of each node
            if sampled and self.static:
                best = (torch.arange(f, device=self.device) * self.top_k).expand(batch, -1)[:, : self.top_k]
            else:
                best = child_scores.flatten(1).topk(self.top_k, -1).indices  # [B, K] among the new nodes
            frontier = size + best
            frontier_source = out.gather(1, (best // self.top_k)[:, :, None].expand(-1, -1, out.shape[-1]))
            frontier_rows = new_rows.gather(1, best)
            num_rows += f
            size += f * self.top_k
        parents, depths = torch.cat(pool_parents, 1), torch.cat(pool_depths, 1)
        if sampled:
            return self._select_groups(flat_tokens, parents, flat_scores, depths, torch.cat(pool_q, 1))
        return self._select(flat_tokens, parents, flat_scores, depths)

    def _budget_full(self, scores: Tensor, frontier: Tensor) -> bool:
        """Whether the pool already holds total_tokens nodes scoring at least as high as every
        frontier node: descendants score no higher than their ancestor, so expanding further could
        not change the kept tree. Checked on the CPU only, where reading it costs no device sync
        (on a GPU the tree keeps static shapes and expands every depth)."""
        if self.device.type != "cpu" or scores.shape[1] < self.total_tokens:
            return False
        kth_best = scores.topk(self.total_tokens, -1).values[:, -1]  # [B]
        return bool((kth_best >= scores.gather(1, frontier).max(-1).values).all())

    def _children(self, h: Tensor, ctx: DraftContext, sampled: bool) -> tuple[Tensor, Tensor, Tensor | None]:
        """top_k children of each row of h [B, F, H]: log q of each [B, F, top_k], their target ids,
        and (sampled) q itself over the target vocabulary [B, F, V]."""
        logits = self.draft_lm_head(h).float()  # [B, F, K] over the draft vocabulary
        if not sampled:
            scores, index = torch.log_softmax(logits, -1).topk(self.top_k, -1)
            return scores, self.head.draft_ids[index], None
        q = probabilities(logits, ctx.sampling)  # [B, F, K]
        b, f, k = q.shape
        if self.mode is SiblingMode.SAMPLED_WOR:  # Gumbel-top-k: a without-replacement draw, in draw order
            # float64 keys: float32 would round the noise, tying keys and biasing the draw
            index = (q.double().log() + ctx.rng.gumbel(f, k)).topk(self.top_k, -1).indices  # [B, F, top_k]
        else:  # i.i.d. draws by exponential races
            index = (q[:, :, None, :].double() / ctx.rng.exponential(f, self.top_k, k)).argmax(-1)
        full = torch.zeros(b, f, self.vocab_size, device=q.device).index_copy_(2, self.head.draft_ids, q)
        return q.gather(2, index).log(), self.head.draft_ids[index], full

    def _select(self, tokens: Tensor, parents: Tensor, scores: Tensor, depth: Tensor) -> DraftTree:
        """Keep the total_tokens best pool nodes (a child never outscores its parent, and ancestors
        are forced in on ties), ordered by depth then score so parents precede children."""
        batch, pool = tokens.shape
        keep_count = min(self.total_tokens, pool)
        keep = torch.zeros(batch, pool, dtype=torch.bool, device=self.device)
        keep.scatter_(1, scores.topk(keep_count, -1).indices, True)
        for i in range(pool - 1, -1, -1):  # parents precede children: one backward pass closes over ancestors
            parent = parents[:, i].clamp(min=0)
            force = keep[:, i] & (parents[:, i] >= 0)
            keep.scatter_(1, parent[:, None], keep.gather(1, parent[:, None]) | force[:, None])
        key = torch.where(keep, depth.double() * 1e6 - scores.double().clamp(min=-1e5), math.inf)
        order = key.argsort(1)  # kept nodes by depth, best first; dropped nodes last
        new_index = torch.empty_like(order).scatter_(1, order, torch.arange(pool, device=self.device).expand(batch, -1))
        ordered_parents = parents.gather(1, order)
        ordered_parents = torch.where(ordered_parents >= 0, new_index.gather(1, ordered_parents.clamp(min=0)), -1)
        num_nodes = keep.sum(1)
        width = int(num_nodes.max())  # the target should not compute the dropped tail
        return DraftTree(
            tokens.gather(1, order)[:, :width], ordered_parents[:, :width], None, num_nodes, SiblingMode.DETERMINISTIC,
            confidence=scores.gather(1, order)[:, :width].exp().float(),  # the head's path probability
        )

    def _select_groups(self, tokens: Tensor, parents: Tensor, scores: Tensor, depth: Tensor, probs: Tensor) -> DraftTree:
        """Sampled trees: keep the root's sibling group, then the groups under the best-scoring
        parents (ties: the shallower), total_tokens // top_k groups in all. A group never outranks
        its parent's group (scores only fall with depth), so every kept group's parent is kept.
        The pool is already topological with each group in draw order; compaction keeps that."""
        batch, pool = tokens.shape
        group_parent = parents[:, :: self.top_k]  # [B, G]
        is_root = group_parent < 0
        # static shapes rank groups by pool position alone (the stable sorts below keep pool order)
        ranked = torch.zeros_like(scores) if self.static else scores
        parent_score = torch.where(is_root, math.inf, ranked.gather(1, group_parent.clamp(min=0)))
        parent_depth = torch.where(is_root, 0, depth.gather(1, group_parent.clamp(min=0)))
        order = parent_depth.argsort(dim=1, stable=True)
        order = order.gather(1, parent_score.gather(1, order).neg().argsort(dim=1, stable=True))
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1], device=self.device).expand(batch, -1))
        groups = max(1, self.total_tokens // self.top_k)
        keep = (rank < groups).repeat_interleave(self.top_k, 1)  # [B, pool]
        order = (~keep).int().argsort(dim=1, stable=True)
        new_index = torch.empty_like(order).scatter_(1, order, torch.arange(pool, device=self.device).expand(batch, -1))
        ordered_parents = parents.gather(1, order)
        ordered_parents = torch.where(ordered_parents >= 0, new_index.gather(1, ordered_parents.clamp(min=0)), -1)
        # the same number of groups for every request, known without reading the device
        width = min(groups, pool // self.top_k) * self.top_k
        order = order[:, :width]
        return DraftTree(tokens.gather(1, order), ordered_parents[:, :width],
                         probs.gather(1, order[:, :, None].expand(-1, -1, probs.shape[-1])), keep.sum(1), self.mode,
                         static_shape=self.static)

    def _commit_rows(self, ctx: DraftContext) -> Tensor:
        """Run the head over the rows whose true features just arrived; returns each request's
        last row's h [B, H], from one call per run of requests of similar counts."""
        counts = ctx.num_new.tolist()
        last = torch.cat([self._catch_up(ctx, run, max(max(counts[run]), 1)) for run in catch_up_runs(counts)])
        self.length = self.length + ctx.num_new
        return last

    def _catch_up(self, ctx: DraftContext, run: slice, rows: int) -> Tensor:  # [b, H] for the requests in run
        # rows past a request's count are padding (its tree was wider than its path, or a neighbour is longer)
        num_new, length, keys, values = ctx.num_new[run], self.length[run], self.keys[run], self.values[run]
        features = torch.cat([h[run, :rows] for h in ctx.new_hidden], -1).to(keys.dtype)  # [b, R, n*H]
        offsets = torch.arange(rows, device=self.device)
        positions = (ctx.lengths[run] - num_new - 1)[:, None] + offsets  # [b, R] from the first new feature's
        tokens = ctx.tokens[run]
        next_tokens = tokens.gather(1, (positions + 1).clamp(max=tokens.shape[1] - 1))
        valid = offsets < num_new[:, None]
        write = torch.where(valid, length[:, None] + offsets, keys.shape[2] - 1)  # padding: last slot
        columns = torch.arange(keys.shape[2], device=self.device)
        mask = columns[None, None, :] <= (length[:, None] + offsets)[:, :, None]  # causal over committed
        mask = torch.where(valid[:, :, None], mask, columns[None, None, :] == write[:, :, None])
        # writes through the views into the cache
        out = self.head.rows(features, self.embed(next_tokens).to(keys.dtype), positions, keys, values, mask, write)
        return out.gather(1, (num_new - 1).clamp(min=0)[:, None, None].expand(-1, 1, out.shape[-1]))[:, 0]

    def _draft_rows(self, source: Tensor, tokens: Tensor, depth: int, first_row: int, visible_draft: Tensor) -> Tensor:
        batch, f = tokens.shape
        slots = self.keys.shape[2]
        write = self.length[:, None] + first_row + torch.arange(f, device=self.device)  # [B, F]
        positions = (self.length - 1 + depth - 1)[:, None].expand(-1, f)  # row t = root + depth - 1
        columns = torch.arange(slots, device=self.device)
        mask = (columns < self.length[:, None])[:, None, :].expand(-1, f, -1).clone()  # committed rows
        draft_columns = self.length[:, None] + torch.arange(visible_draft.shape[2], device=self.device)
        mask.scatter_(2, draft_columns[:, None, :].expand(-1, f, -1), visible_draft)
        return self.head.rows(source.to(self.keys.dtype), self.embed(tokens).to(self.keys.dtype), positions, self.keys,
                              self.values, mask, write)

    def commit(self, tree: DraftTree, result: VerifyResult) -> None:
        pass  # draft rows are overwritten by the next proposal's committed rows

    def retain(self, rows: Tensor) -> None:
        self.keys, self.values, self.length = self.keys[rows], self.values[rows], self.length[rows]
