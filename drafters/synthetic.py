"""SyntheticDrafter: drafts from its own q, a dial between the synthetic target's p and noise.

q(.|ctx) = processed((1 - divergence) * target_logits(ctx) + divergence * sharpness * z'(ctx)), so
divergence = 0 gives q = p (everything accepted) and divergence = 1 an unrelated distribution.
Trees have a static branching per depth, e.g. (1, 1, 1) is a 3-chain, (2, 2) a binary tree of depth 2.
``depth_ms`` simulates a drafter cost per tree level (see specdec/synthetic.py on simulated costs).
"""

from __future__ import annotations

import time
import torch
from torch import Tensor

from drafters.base import DraftContext, DraftTree, SiblingMode, StatelessDrafter, register
from specdec.sampling import probabilities
from specdec.synthetic import NO_TOKEN, SyntheticTarget, hashed_normal, spend_until


# it mixes the synthetic target's own logits
@register("synthetic", needs="synthetic")
class SyntheticDrafter(StatelessDrafter):
    def __init__(
        self,
        target: SyntheticTarget,
        branching: tuple[int, ...] = (1, 1, 1),
        mode: SiblingMode | str = SiblingMode.SAMPLED_IID,
        divergence: float = 0.5,
        seed: int = 1,
        depth_ms: float = 0.0,  # simulated drafting time per tree level
    ) -> None:
        if not branching or any(w < 1 for w in branching):
            raise ValueError(f"branching must list >= 1 children per depth; got {branching}")
        if not 0 <= divergence <= 1:
            raise ValueError(f"divergence must lie in [0, 1]; got {divergence}")
        self.target = target
        self.branching = tuple(branching)
        self.mode = SiblingMode(mode) if isinstance(mode, str) else mode
        self.divergence = divergence
        self.seed = seed
        if depth_ms < 0:
            raise ValueError(f"depth_ms must be >= 0; got {depth_ms}")
        self.depth_ms = depth_ms

    def draft_logits(self, context: Tensor, position: Tensor) -> Tensor:  # [..., order] -> [..., V]
        own = self.target.sharpness * hashed_normal(self.seed, context, position, self.target.vocab_size)
        return (1 - self.divergence) * self.target.logits(context, position) + self.divergence * own

    def propose(self, ctx: DraftContext) -> DraftTree:
        start = time.perf_counter()
        batch, order = ctx.tokens.shape[0], self.target.order
        offsets = torch.arange(-order, 0, device=ctx.tokens.device)
        index = ctx.lengths[:, None] + offsets  # [B, order]
        history = torch.where(index >= 0, ctx.tokens.gather(1, index.clamp(min=0)), NO_TOKEN)
        paths = history[:, None, :]  # [B, F, order+d] context + path of each frontier node
        frontier_rows = torch.full((batch, 1), -1, device=ctx.tokens.device)  # [B, F] node index
        tokens, parents, draft_probs = [], [], []
        num_nodes = 0
        for depth, width in enumerate(self.branching):
            frontier = paths.shape[1]
            position = (ctx.lengths + depth)[:, None].expand(batch, frontier)
            logits = self.draft_logits(paths[..., -order:], position)  # [B, F, V]
            q = probabilities(logits, ctx.sampling)  # [B, F, V]
            children = self._children(logits, q, width, ctx)  # [B, F, W]
            tokens.append(children.flatten(1))
            parents.append(frontier_rows[:, :, None].expand(-1, -1, width).flatten(1))
            draft_probs.append(q[:, :, None, :].expand(-1, -1, width, -1).flatten(1, 2))
            paths = torch.cat(
                [paths[:, :, None, :].expand(-1, -1, width, -1), children[..., None]], -1
            ).flatten(1, 2)
            frontier_rows = num_nodes + torch.arange(frontier * width, device=ctx.tokens.device)
            frontier_rows = frontier_rows.expand(batch, -1)
            num_nodes += frontier * width
        spend_until(start, self.depth_ms * len(self.branching))
        return DraftTree(
            tokens=torch.cat(tokens, 1),
            parents=torch.cat(parents, 1),
            draft_probs=None if self.mode is SiblingMode.DETERMINISTIC else torch.cat(draft_probs, 1),
            num_nodes=torch.full((batch,), num_nodes, device=ctx.tokens.device),
            mode=self.mode,
            static_shape=True,  # every node of a depth gets its branching-many children
        )

    def _children(self, logits: Tensor, q: Tensor, width: int, ctx: DraftContext) -> Tensor:
        batch, frontier, v = q.shape
        if self.mode is SiblingMode.DETERMINISTIC:
            return logits.topk(width, dim=-1).indices
        if self.mode is SiblingMode.SAMPLED_WOR:  # Gumbel-top-k = sampling without replacement
            # float64 keys: float32 would round the noise, tying keys and biasing the draw
            gumbel = ctx.rng.gumbel(frontier, v)  # [B, F, V] float64
            return (q.double().log() + gumbel).topk(width, dim=-1).indices
        race = ctx.rng.exponential(frontier, width, v)  # i.i.d. draws by exponential races
        return (q[:, :, None, :].double() / race).argmax(-1)
