"""The miniature Domino that the bundled SmolLM2 head (drafters/checkpoints/domino-smollm2) was
trained in, kept so that head keeps running (``drafter=domino_mini``, and ``drafter=domino`` without a
checkpoint) until a head in the published architecture (drafters/domino.py) is bundled; it is not
trained any more. A whole block of k tokens from one parallel pass, then a light causal refinement.

Terms (as in drafters/eagle.py). f_t is the target feature after reading x_t; the root x_r is the
last committed token, so features exist up to f_{r-1}. A *memory row* m_t = fuse(f_t, embedding of
x_{t+1}) summarises one committed token; the *anchor* is m_{r-1}, the row that ends at the root.

- Backbone (non-causal): the block is the anchor followed by k-1 learned mask embeddings at
  positions r-1+j (j = 0..k-1). Its rows attend to each other in both directions and to the last
  ``context`` memory rows (m_{r-context}..m_{r-1}); memory rows pass through no layer, so a
  layer's keys/values for them are computed once, when the row is committed, and kept in a small
  ring per request. Block row j's output, through the target's frozen LM head restricted to the
  draft vocabulary, gives base logits for the token after x_{r+j}: all k positions in one pass.
- Refiner (causal, cheap): a GRU reads the block's prefix tokens (x_r, then the tokens chosen at
  positions 0..j-1) together with the backbone's row j, and a rank-r projection of its state is
  added to row j's base logits. Only this part runs position by position.

Greedy block rollout takes the argmax at every position: a chain, DETERMINISTIC, so it is verified
exactly at any temperature by the point-mass rule. With ``sampled=True`` and T > 0 each position's
token is drawn from q = probabilities(refined logits) (the draft vocabulary, zero elsewhere), the
refiner reads the drawn token, and the chain is SAMPLED_IID carrying q: q of node j depends only on
the path to it, as the p/q test requires.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from drafters.base import BudgetKnobs, DraftContext, DraftTree, DrafterBase, VerifyResult, register
from drafters.dflash import BlockChain
from drafters.heads import (DecoderBlock, RMSNorm, bundled_checkpoint, draft_lm_head, load_checkpoint, register_draft_ids,
                            rotate, save_head, target_name, target_shape, use_target_kernels)
from specdec.protocols import HeadTarget

CHECKPOINT_KEY = "domino"


@dataclass(frozen=True)
class MiniDominoConfig:
    hidden_size: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    feature_layers: tuple[int, ...]  # target layers fused into a memory row
    draft_vocab_size: int  # tokens the head may draft (the most frequent target choices)
    target_num_layers: int
    block_size: int = 3  # k: tokens one backbone pass drafts (anchor + k-1 masks)
    context: int = 16  # memory rows the block attends to (the anchor's included)
    num_layers: int = 1  # backbone layers
    gru_size: int = 256
    rank: int = 64  # of the refiner's projection onto the draft vocabulary
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    target: str = ""  # where the target came from, for error messages

    def __post_init__(self) -> None:
        for name in ("block_size", "context", "num_layers", "gru_size", "rank", "draft_vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"Domino {name} must be >= 1; got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")

    @staticmethod
    def for_target(target: HeadTarget, feature_layers: tuple[int, ...] | None = None, draft_vocab_size: int | None = None,
                   **sizes) -> MiniDominoConfig:
        """``sizes``: block_size, context, num_layers, gru_size, rank, intermediate_size."""
        settings = dict(
            **target_shape(target),
            feature_layers=tuple(feature_layers or (target.num_layers + 1,)),
            draft_vocab_size=draft_vocab_size or target.vocab_size,
        )
        return MiniDominoConfig(**{**settings, **sizes})


class BlockLayer(DecoderBlock):
    """Pre-norm attention + SwiGLU MLP over the block; memory rows are keys/values only."""

    def __init__(self, config: MiniDominoConfig) -> None:
        super().__init__()
        self.add_block(config.hidden_size, config.num_heads, config.intermediate_size, config.rope_theta, config.rms_eps)

    def memory(self, rows: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """rows [N, M, H] memory rows at positions [N, M] -> keys (rotated), values [N, heads, M, D]."""
        n, m, h = rows.shape
        kv = F.linear(self.attention_norm(rows), self.qkv.weight[h:])  # the query part is never needed
        keys, values = kv.view(n, m, 2, self.num_heads, h // self.num_heads).permute(2, 0, 3, 1, 4)
        return rotate(keys, positions, self.rope_theta), values

    def forward(
        self,
        x: Tensor,  # [N, K, H] block rows
        positions: Tensor,  # [N, K] int64
        memory_keys: Tensor,  # [N, heads, C, D]
        memory_values: Tensor,  # [N, heads, C, D]
        visible: Tensor,  # [N, C] bool, memory slots holding a row
    ) -> Tensor:  # [N, K, H]
        n, k, _ = x.shape
        q, keys, values = self.attention_inputs(x, positions)
        keys, values = torch.cat([memory_keys, keys], 2), torch.cat([memory_values, values], 2)
        # every block row sees every other block row (non-causal) and the same memory
        mask = torch.cat([visible, torch.ones(n, k, dtype=torch.bool, device=x.device)], 1)[:, None, None, :]
        return self.after_attention(x, F.scaled_dot_product_attention(q, keys, values, attn_mask=mask))


class MiniDominoHead(nn.Module):
    """Backbone (fuse -> block layers -> norm) and refiner (GRU + rank-r projection).

    ``draft_ids`` [K] are the target token ids the head drafts from; logits are over them, and the
    target's frozen LM head rows for them (not stored here) turn backbone rows into base logits."""

    def __init__(self, config: MiniDominoConfig, draft_ids: Tensor | None = None) -> None:
        super().__init__()
        self.config = config
        register_draft_ids(self, draft_ids, config.draft_vocab_size)
        h, g = config.hidden_size, config.gru_size
        layers = len(config.feature_layers)
        self.feature_fuse = nn.Linear(h * layers, h, bias=False) if layers > 1 else None
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.masks = nn.Parameter(torch.randn(config.block_size - 1, h) * 0.02)  # [k-1, H]
        self.layers = nn.ModuleList(BlockLayer(config) for _ in range(config.num_layers))
        self.out_norm = RMSNorm(h, config.rms_eps)
        self.refine_in = nn.Linear(2 * h, g)
        self.gru = nn.GRUCell(g, g)
        self.refine_down = nn.Linear(g, config.rank, bias=False)
        self.refine_up = nn.Linear(config.rank, config.draft_vocab_size, bias=False)
        nn.init.zeros_(self.refine_up.weight)  # the refiner starts as "no correction"

    def memory_rows(self, features: Tensor, embeddings: Tensor) -> Tensor:
        """features [N, M, n*H] (f_t), embeddings [N, M, H] (of x_{t+1}) -> memory rows m_t [N, M, H]."""
        if self.feature_fuse is not None:
            features = self.feature_fuse(features)
        return self.fc(torch.cat([features, embeddings], -1))

    def memory(self, rows: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Each layer's keys/values [N, heads, M, D] for memory rows [N, M, H] at positions [N, M]."""
        return [layer.memory(rows, positions) for layer in self.layers]

    def backbone(
        self,
        anchor: Tensor,  # [N, H] m_{r-1}
        positions: Tensor,  # [N, K] int64, r-1+j
        memory: list[tuple[Tensor, Tensor]],  # per layer [N, heads, C, D] keys, values
        visible: Tensor,  # [N, C] bool
    ) -> Tensor:  # [N, K, H] normalised block rows (LM-head inputs)
        x = torch.cat([anchor[:, None], self.masks[None].expand(anchor.shape[0], -1, -1)], 1)
        for layer, (keys, values) in zip(self.layers, memory):
            x = layer(x, positions, keys, values, visible)
        return self.out_norm(x)

    def refine(self, row: Tensor, prefix: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
        """One causal step: backbone row j [N, H], embedding of the token before position j [N, H],
        GRU state [N, G] -> (new state, correction [N, K] added to row j's base logits)."""
        state = self.gru(self.refine_in(torch.cat([prefix, row], -1)), state)
        return state, self.refine_up(self.refine_down(state))


def save_domino_mini(head: MiniDominoHead, directory: str | Path, extra: dict | None = None) -> None:
    save_head(head, directory, extra, kind=CHECKPOINT_KEY)


def load_domino_mini(directory: str | Path, target: HeadTarget) -> MiniDominoHead:
    """Load a head and check it fits ``target``; clear errors for a foreign or corrupt checkpoint."""
    parse = lambda raw: MiniDominoConfig(**{**raw, "feature_layers": tuple(raw["feature_layers"])})
    return load_checkpoint(directory, target, CHECKPOINT_KEY, parse, MiniDominoHead, label="Domino")


class MiniDominoDrafter(DrafterBase):
    """Drafts the first ``depth`` tokens of a block (depth <= the head's block_size) as a chain.

    Per request it keeps the last ``context`` memory rows' keys/values per layer in a ring (row t
    in slot t mod context), the anchor, and how many committed rows it has read."""

    def __init__(self, target: HeadTarget, head: MiniDominoHead, depth: int | None = None, sampled: bool = False) -> None:
        block = head.config.block_size
        depth = block if depth is None else depth
        if not 1 <= depth <= block:
            raise ValueError(f"depth must lie in [1, block_size={block}] (the head drafts blocks of {block}); got {depth}")
        self.head, self.depth, self.sampled = use_target_kernels(head, target), depth, sampled
        self.max_depth = block
        self.embed = target.model.get_input_embeddings()
        self.draft_lm_head = draft_lm_head(target, head.draft_ids)  # [..., H] -> [..., K]
        self.target_layers = head.config.feature_layers
        self.vocab_size = target.vocab_size
        self.device = target.device

    def quantizable(self) -> list[nn.Module]:
        return [self.head]  # the embeddings and LM head rows are the target's

    def reset(self, batch_size: int, max_length: int) -> None:
        c = self.head.config
        dtype = next(self.head.parameters()).dtype
        # slots 0..context-1 hold rows; the last slot takes padding rows' writes and is never read
        shape = (batch_size, c.num_heads, c.context + 1, c.hidden_size // c.num_heads)
        self.keys = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(c.num_layers)]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.anchor = torch.zeros(batch_size, c.hidden_size, dtype=dtype, device=self.device)  # [B, H]
        self.length = torch.zeros(batch_size, dtype=torch.int64, device=self.device)  # [B] rows read

    def admit(self, count: int, max_length: int) -> None:
        keys, values, anchor, length = self.keys, self.values, self.anchor, self.length
        self.reset(count, max_length)
        self.keys = [torch.cat([old, new]) for old, new in zip(keys, self.keys)]
        self.values = [torch.cat([old, new]) for old, new in zip(values, self.values)]
        self.anchor, self.length = torch.cat([anchor, self.anchor]), torch.cat([length, self.length])

    def retain(self, rows: Tensor) -> None:
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        self.anchor, self.length = self.anchor[rows], self.length[rows]

    def commit(self, tree: DraftTree, result: VerifyResult) -> None:
        pass  # the accepted rows' features arrive with the next DraftContext

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> DraftTree:
        self._read(ctx)
        c = self.head.config
        batch = ctx.tokens.shape[0]
        root = ctx.lengths - 1  # [B] index of x_r
        positions = (root - 1)[:, None] + torch.arange(c.block_size, device=self.device)  # [B, K]
        visible = torch.arange(c.context, device=self.device) < self.length.clamp(max=c.context)[:, None]
        memory = [(k[:, :, : c.context], v[:, :, : c.context]) for k, v in zip(self.keys, self.values)]
        rows = self.head.backbone(self.anchor, positions, memory, visible)  # [B, K, H]
        base = self.draft_lm_head(rows[:, : self.depth])  # [B, depth, K] all positions at once
        token = ctx.tokens.gather(1, root[:, None])[:, 0]  # [B] the prefix so far ends at the root
        state = torch.zeros(batch, c.gru_size, dtype=rows.dtype, device=self.device)
        chain = BlockChain(self.head.draft_ids, self.vocab_size, ctx, self.sampled)
        for j in range(self.depth):
            state, correction = self.head.refine(rows[:, j], self.embed(token).to(rows.dtype), state)
            token = chain.choose(base[:, j] + correction)
        return chain.tree()

    def _read(self, ctx: DraftContext) -> None:
        """Turn the rows whose features just arrived into memory rows: only the last ``context`` of
        them can ever be attended to, so at most that many are computed (a long prompt costs no more)."""
        c = self.head.config
        count = min(int(ctx.num_new.max()), c.context)
        if count == 0:  # one-token prompts: nothing to read, the anchor stays empty
            return
        offsets = torch.arange(count, device=self.device)
        t = (ctx.lengths - 1 - count)[:, None] + offsets  # [B, R] row indices m_t
        valid = offsets >= (count - ctx.num_new)[:, None]
        source = (ctx.num_new[:, None] - count + offsets).clamp(min=0)  # [B, R] rows of new_hidden
        features = torch.cat([h.gather(1, source[:, :, None].expand(-1, -1, h.shape[-1])) for h in ctx.new_hidden], -1)
        next_tokens = ctx.tokens.gather(1, (t + 1).clamp(min=0))  # x_{t+1}, at most the root
        dtype = self.anchor.dtype
        rows = self.head.memory_rows(features.to(dtype), self.embed(next_tokens).to(dtype))  # [B, R, H]
        slots = torch.where(valid, t.clamp(min=0) % c.context, c.context)
        for (keys, values), cache_k, cache_v in zip(self.head.memory(rows, t.clamp(min=0)), self.keys, self.values):
            index = slots[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[-1])
            cache_k.scatter_(2, index, keys)
            cache_v.scatter_(2, index, values)
        self.anchor = torch.where((ctx.num_new > 0)[:, None], rows[:, -1], self.anchor)
        self.length = self.length + ctx.num_new


@register("domino_mini", needs="model", budget=BudgetKnobs(depth="depth", bounded=True))
def domino_mini(target: HeadTarget, checkpoint: str | None = None, depth: int | None = None, sampled: bool = False) -> MiniDominoDrafter:
    """The miniature Domino with its bundled SmolLM2 head (or a head of that architecture); depth null =
    the head's block size; sampled=true draws each position from q at T > 0 (exact p/q test)."""
    directory = checkpoint or bundled_checkpoint("domino", "domino", target_name(target))
    return MiniDominoDrafter(target, load_domino_mini(directory, target), depth, sampled)
