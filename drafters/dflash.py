"""DFlash block drafting (SpecForge's DFlashDraftModel): a block of tokens from one parallel forward
of a few decoder layers conditioned on the target's features of the whole prefix.

Terms. The root x_r is the last committed token, at position r; f_t is the fused target feature of
x_t (t < r): ``hidden_norm(fc(concat(selected target layers)))``. The *block* is x_r's embedding
followed by block_size-1 embeddings of one fixed mask token, at positions r..r+B-1. In every draft
layer each block row attends, in both directions, to the other block rows and to the *context*: the
rows f_0..f_{r-1} projected by that layer's own k/v projections (no input norm, no layer before
them). The context rows of a layer therefore depend on nothing drafted: they are computed once, when
the target's features of a committed token arrive, and kept per request like a KV cache; the block's
own keys/values are never stored, which is the reference's "crop at commit". Block row j
(j = 1..B-1), through the final norm and the target's frozen LM head, gives the draft logits of the
token at position r+j: B-1 tokens from one forward.

Draft layers are Qwen3-style: RMSNorm before attention and MLP, grouped-query attention, optional
per-head RMSNorm of queries and keys (q/k norm), RoPE, SwiGLU. The LM head is the target's, over the
whole vocabulary or over a declared draft vocabulary (``draft_ids``). Domino (drafters/domino.py) is
this backbone plus a refinement of each position's logits from the drafted prefix: ``DFlashHead``'s
``refine`` hook is the only place they differ.

Greedy drafting takes the argmax per position: a DETERMINISTIC chain, exact at any temperature
under the point-mass rule. ``sampled=True`` at T > 0 draws each position from q = probabilities
(its logits) and carries q: a SAMPLED_IID chain for the p/q test (q of node j depends on the path to
it only through the refinement, which reads exactly that path).

API (what a loader of another checkpoint format builds):

    config = DFlashConfig(hidden_size=..., num_heads=..., num_kv_heads=..., head_dim=...,
                          intermediate_size=..., num_layers=..., vocab_size=...,
                          target_num_layers=..., feature_layers=(our HFTarget layer indices),
                          block_size=16, mask_token_id=..., rope_theta=..., rope_scaling=None, rms_eps=...,
                          attention_bias=False, qk_norm=True, draft_vocab_size=vocab_size)
    head = DFlashHead(config, draft_ids=None)   # parameters named as SpecForge's DFlashDraftModel:
        # layers.{i}.self_attn.{q,k,v,o}_proj.weight (+ .bias when attention_bias),
        # layers.{i}.self_attn.{q,k}_norm.weight, layers.{i}.mlp.{gate,up,down}_proj.weight,
        # layers.{i}.{input,post_attention}_layernorm.weight, norm.weight, fc.weight, hidden_norm.weight
    head.load_state_dict(tensors)               # then check_fits(config, sizes_of(target), where) and .to(target)
    drafter = DFlashDrafter(target, head, depth=None, sampled=False)

``feature_layers`` are HFTarget indices (0 = embeddings, k = output of block k, L + 1 = final
norm); SpecForge's ``target_layer_ids`` i is our i + 1 (drafters/formats/specforge.py converts).
A head is saved as a SpecForge folder (``save_dflash``) and read by ``load_dflash``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from drafters.base import DraftContext, DrafterBase, DraftTree, SiblingMode, TargetSizes, VerifyResult
from drafters.eagle_published import rope_frequencies, rotate_with
from drafters.head_storage import weight_shapes
from drafters.heads import (
    RMSNorm,
    catch_up_runs,
    draft_lm_head,
    register_draft_ids,
    sizes_of,
    target_shape,
    token_embedding,
    use_target_kernels,
)
from specdec.protocols import HeadTarget
from specdec.sampling import probabilities
from specdec.tree import chain_tree


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int  # grouped-query attention: num_heads / num_kv_heads queries share a key
    head_dim: int
    intermediate_size: int
    num_layers: int  # draft decoder layers
    vocab_size: int  # the target's
    target_num_layers: int
    feature_layers: tuple[int, ...]  # HFTarget layers concatenated into the context feature
    block_size: int = 16  # B: the root and B-1 mask tokens, one forward
    mask_token_id: int = 0  # the fixed token whose embedding fills the block after the root
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # None, or Llama-3's {"rope_type": "llama3", "factor", ...}
    rms_eps: float = 1e-6
    attention_bias: bool = False
    qk_norm: bool = True  # per-head RMSNorm of queries and keys (Qwen3)
    draft_vocab_size: int = 0  # tokens the head drafts from; 0 = the whole vocabulary
    target: str = ""  # where the target came from, for error messages

    def __post_init__(self) -> None:
        if self.draft_vocab_size == 0:
            object.__setattr__(self, "draft_vocab_size", self.vocab_size)
        object.__setattr__(self, "feature_layers", tuple(self.feature_layers))
        for name in ("block_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "draft_vocab_size"):
            if getattr(self, name) < (2 if name == "block_size" else 1):
                raise ValueError(f"{type(self).__name__} {name} must be >= {2 if name == 'block_size' else 1}; "
                                 f"got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if not self.feature_layers:
            raise ValueError("feature_layers is empty: name the target layers the context feature concatenates")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is not a token of the {self.vocab_size}-token vocabulary")

    @classmethod
    def for_target(cls, target: HeadTarget, feature_layers: tuple[int, ...] | None = None, **sizes):
        """A head shaped like ``target``'s layers (its heads, KV heads, MLP width); ``sizes`` override
        any field (num_layers, block_size, mask_token_id, ...). Default features: three layers spread
        over the target (SpecForge's choice for three draft layers, in our indices)."""
        shape = target_shape(target)
        model_config = target.model.config
        heads = shape["num_heads"]
        settings = dict(
            hidden_size=shape["hidden_size"], num_heads=heads,
            num_kv_heads=getattr(model_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(model_config, "head_dim", None) or shape["hidden_size"] // heads,
            intermediate_size=shape["intermediate_size"], num_layers=1, vocab_size=shape["vocab_size"],
            target_num_layers=shape["target_num_layers"], rope_theta=shape["rope_theta"], target=shape["target"],
            feature_layers=tuple(feature_layers or default_feature_layers(target.num_layers, 3)),
            mask_token_id=default_mask_token(target),
        )
        return cls(**{**settings, **sizes})


def spread_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """SpecForge's default ``target_layer_ids`` (its 0-based block numbering): the middle block for
    one, else ``count`` ids spread evenly over 1..L-3."""
    if count == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (count - 1))) for i in range(count)]


def target_layer(layer_id: int, num_target_layers: int) -> int:
    """SpecForge's layer id -> our HFTarget index: its decode loop reads transformers'
    ``output_hidden_states[id + 1]``, block id + 1's output, except for the last block, whose entry
    there is the final norm's output (our L + 1)."""
    return num_target_layers + 1 if layer_id == num_target_layers - 1 else layer_id + 1


def default_feature_layers(num_target_layers: int, count: int) -> tuple[int, ...]:
    """SpecForge's spread in our indices; the middle block on a target too shallow to spread over."""
    ids = spread_layer_ids(num_target_layers, count if num_target_layers >= 4 else 1)
    return tuple(target_layer(i, num_target_layers) for i in ids)


def default_mask_token(target: HeadTarget) -> int:
    """A token the target never needs in a block: its pad token if it names one, else the last id."""
    pad = getattr(target.model.config, "pad_token_id", None)
    return pad if isinstance(pad, int) and 0 <= pad < target.vocab_size else target.vocab_size - 1


def check_fits(config: DFlashConfig, target: TargetSizes, where: str) -> None:
    """Refuse a head built for another target, in one line naming every mismatch; before the
    target loads (``target`` read from its config) or after (``sizes_of(target)``)."""
    wrong = [f"{name}: head {mine}, target {theirs}" for name, mine, theirs in [
        ("hidden size", config.hidden_size, target.hidden_size), ("vocabulary", config.vocab_size, target.vocab_size),
        ("layers", config.target_num_layers, target.num_layers)] if mine != theirs]
    outside = [layer for layer in config.feature_layers if not 0 <= layer <= target.num_layers + 1]
    if outside:
        wrong.append(f"feature layers {list(outside)} do not exist in a {target.num_layers}-layer target")
    if wrong:
        raise ValueError(f"{where} was made for another target ({config.target or 'unknown'}), not for "
                         f"{target.name}: " + "; ".join(wrong))


def check_weight_names(path: Path, head: DFlashHead, skipped: tuple[str, ...], where: str) -> None:
    """The safetensors file at ``path`` holds exactly ``head``'s parameters, of its shapes, besides
    the ``skipped`` names (read from its header; ``head`` may live on the meta device)."""
    found = {name: shape for name, shape in weight_shapes(path).items() if name not in skipped}
    expected = {name: tuple(tensor.shape) for name, tensor in head.state_dict().items() if name != "draft_ids"}
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    shapes = [f"{name} {found[name]} (its config gives {expected[name]})" for name in sorted(set(found) & set(expected))
              if found[name] != expected[name]]
    if missing or unexpected or shapes:
        raise ValueError(f"{where}: its weights do not match its config (missing: {', '.join(missing) or 'none'}; "
                         f"unexpected: {', '.join(unexpected) or 'none'}; other shapes: {', '.join(shapes) or 'none'})")


class Attention(nn.Module):
    """Block rows attend to the cached context keys/values and to each other."""

    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.frequencies = rope_frequencies(c.head_dim, c.rope_theta, c.rope_scaling)  # [D / 2] float32
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.attention_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_eps) if c.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(c.head_dim, c.rms_eps) if c.qk_norm else nn.Identity()

    def keys_values(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Rows x [B, R, H] at positions [B, R] -> rotated keys, values [B, kv_heads, R, D]."""
        b, r, _ = x.shape
        keys = self.k_norm(self.k_proj(x).view(b, r, self.kv_heads, self.head_dim)).transpose(1, 2)
        values = self.v_proj(x).view(b, r, self.kv_heads, self.head_dim).transpose(1, 2)
        return rotate_with(keys, positions, self.frequencies), values

    def forward(
        self,
        x: Tensor,  # [B, N, K, H] normed rows of N blocks of K
        positions: Tensor,  # [B, N, K] int64
        context_keys: Tensor,  # [B, kv_heads, C, D]
        context_values: Tensor,  # [B, kv_heads, C, D]
        visible: Tensor,  # [B, N, C] bool: the context rows each block sees
    ) -> Tensor:  # [B, N, K, H]
        """Every row of a block attends to the context rows its block sees and to its own block's
        rows, never to another block's: scores are [.., K, C + K] per block rather than a dense
        [N K, C + N K] mask, which is what lets training run hundreds of blocks a sequence at once."""
        b, n, k, _ = x.shape
        flat = positions.reshape(b, n * k)
        queries = self.q_norm(self.q_proj(x).view(b, n * k, self.heads, self.head_dim)).transpose(1, 2)
        queries = rotate_with(queries, flat, self.frequencies) * self.head_dim**-0.5  # [B, h, N K, D]
        keys, values = self.keys_values(x.reshape(b, n * k, -1), flat)
        group = self.heads // self.kv_heads  # grouped-query attention: each key serves `group` query heads
        keys, values, context_keys, context_values = (t.repeat_interleave(group, 1) for t in
                                                      (keys, values, context_keys, context_values))
        c = context_keys.shape[2]
        scores_context = (queries @ context_keys.transpose(2, 3)).view(b, self.heads, n, k, c)
        scores_context = scores_context.masked_fill(~visible[:, None, :, None, :], -math.inf)
        scores_own = queries.view(b, self.heads, n, k, -1) @ keys.view(b, self.heads, n, k, -1).transpose(3, 4)
        weights = torch.softmax(torch.cat([scores_context, scores_own], -1).float(), -1).to(values.dtype)
        attended = (weights[..., :c].reshape(b, self.heads, n * k, c) @ context_values
                    + (weights[..., c:] @ values.view(b, self.heads, n, k, -1)).reshape(b, self.heads, n * k, -1))
        return self.o_proj(attended.transpose(1, 2).reshape(b, n, k, -1))


class MLP(nn.Module):
    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.self_attn, self.mlp = Attention(c), MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_eps)

    def forward(self, x: Tensor, positions: Tensor, keys: Tensor, values: Tensor, visible: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, keys, values, visible)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashHead(nn.Module):
    """The backbone: context projection (fc, hidden_norm), draft layers, final norm."""

    def __init__(self, config: DFlashConfig, draft_ids: Tensor | None = None) -> None:
        super().__init__()
        self.config = config
        c = config
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_eps)
        self.fc = nn.Linear(len(c.feature_layers) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_eps)
        register_draft_ids(self, draft_ids, c.draft_vocab_size)

    # Block row j + label_shift predicts the token at position r + j (j >= 1); Domino may shift by one.
    label_shift = 0
    refines = False  # whether ``refine`` reads the drafted prefix (DFlash: no)

    @property
    def max_depth(self) -> int:
        """Tokens one block drafts: rows 1..B-1, or 0..B-1 with the labels shifted."""
        return self.config.block_size - 1 + self.label_shift

    def context(self, features: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Concatenated target features [B, R, n*H] of tokens at positions [B, R] -> each layer's
        context keys and values [B, kv_heads, R, D]."""
        rows = self.hidden_norm(self.fc(features))
        return [layer.self_attn.keys_values(rows, positions) for layer in self.layers]

    def forward(
        self,
        block: Tensor,  # [B, N, K, H] embeddings of N blocks: each block's root, then mask tokens
        positions: Tensor,  # [B, N, K] int64
        context: list[tuple[Tensor, Tensor]],  # per layer keys, values [B, kv_heads, C, D]
        visible: Tensor,  # [B, N, C] bool: the context rows each block sees (it always sees itself)
    ) -> Tensor:  # [B, N, K, H] normed rows (LM-head inputs)
        x = block
        for layer, (keys, values) in zip(self.layers, context):
            x = layer(x, positions, keys, values, visible)
        return self.norm(x)

    def start(self, batch: int, like: Tensor) -> Tensor | None:
        """The refinement's state before the block's first drafted token (DFlash: none)."""
        return None

    def refine(self, depth: int, row: Tensor, base: Tensor, previous: Tensor | None,
               state: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """Logits [N, K] of the token at depth ``depth`` (1-based) from its backbone row [N, H], its
        base logits [N, K] and the embedding [N, H] of the token before it (None unless ``refines``).
        DFlash: the base logits."""
        return base, state


class BlockChain:
    """The tokens of a block chosen position by position from logits over the draft vocabulary:
    the argmax (a DETERMINISTIC chain carrying the path's probability as its confidence), or, when
    ``sampled`` at T > 0, a draw from q = probabilities(logits) with the request's own stream (a
    SAMPLED_IID chain carrying q)."""

    def __init__(self, draft_ids: Tensor, vocab_size: int, ctx: DraftContext, sampled: bool) -> None:
        self.draft_ids, self.vocab_size, self.ctx = draft_ids, vocab_size, ctx
        self.sample = sampled and not ctx.sampling.greedy
        self.tokens, self.probs = [], []

    def choose(self, logits: Tensor) -> Tensor:  # [B, K] over the draft vocabulary -> [B] token ids
        if self.sample:
            full = torch.full((logits.shape[0], self.vocab_size), -math.inf, device=logits.device)
            full[:, self.draft_ids] = logits.float()
            q = probabilities(full, self.ctx.sampling)  # [B, V], zero outside the draft vocabulary
            token = (q.double() / self.ctx.rng.exponential(self.vocab_size)).argmax(-1)
            self.probs.append(q)
        else:
            prob, index = torch.softmax(logits.float(), -1).max(-1)
            token = self.draft_ids[index]
            self.probs.append(prob)
        self.tokens.append(token)
        return token

    def tree(self) -> DraftTree:
        tokens = torch.stack(self.tokens, 1)  # [B, depth]
        if self.sample:
            return chain_tree(tokens, SiblingMode.SAMPLED_IID, torch.stack(self.probs, 1))
        # confidence: the head's probability of the drafted path (for budgeted unions)
        return chain_tree(tokens, SiblingMode.DETERMINISTIC, confidence=torch.stack(self.probs, 1).cumprod(1))


class DFlashDrafter(DrafterBase):
    """Drafts the first ``depth`` tokens of a block (at most ``head.max_depth``) as a chain.

    Per request it keeps every draft layer's context keys/values of the committed tokens before the
    root, slot t = position t (one slot past ``max_length`` takes padding rows' writes, never read)."""

    def __init__(self, target: HeadTarget, head: DFlashHead, depth: int | None = None, sampled: bool = False) -> None:
        check_fits(head.config, sizes_of(target), f"the {type(head).__name__}")
        depth = head.max_depth if depth is None else depth
        if not 1 <= depth <= head.max_depth:
            raise ValueError(f"depth must lie in [1, {head.max_depth}] (the head drafts {head.max_depth} tokens a block); "
                             f"got {depth}")
        self.head, self.depth, self.sampled, self.max_depth = use_target_kernels(head, target), depth, sampled, head.max_depth
        self.embed = token_embedding(target)
        self.draft_lm_head = draft_lm_head(target, head.draft_ids)  # [..., H] -> [..., K]
        self.target_layers = head.config.feature_layers
        self.vocab_size, self.device = target.vocab_size, target.device

    def quantizable(self) -> list[nn.Module]:
        return [self.head]  # the embeddings and LM head are the target's

    def reset(self, batch_size: int, max_length: int) -> None:
        c = self.head.config
        dtype = next(self.head.parameters()).dtype
        shape = (batch_size, c.num_kv_heads, max_length + 1, c.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(c.num_layers)]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.spare = max_length  # the slot padding rows write to

    def admit(self, count: int, max_length: int) -> None:
        keys, values = self.keys, self.values
        length = max(max_length, self.spare)
        self.reset(count, length)
        # the running requests' slots move up to the new length; the spare slot stays the last one
        widen = lambda old: F.pad(old[:, :, :-1], (0, 0, 0, length + 2 - old.shape[2]))
        self.keys = [torch.cat([widen(old), new]) for old, new in zip(keys, self.keys)]
        self.values = [torch.cat([widen(old), new]) for old, new in zip(values, self.values)]

    def retain(self, rows: Tensor) -> None:
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]

    def commit(self, tree: DraftTree, result: VerifyResult) -> None:
        pass  # the accepted tokens' features arrive with the next DraftContext; the block was never cached

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> DraftTree:
        width = self._read(ctx)  # context slots in use: positions 0..r-1 of the longest request
        c = self.head.config
        batch = ctx.tokens.shape[0]
        root = ctx.lengths - 1  # [B] x_r's index and position
        offsets = torch.arange(c.block_size, device=self.device)
        ids = torch.where(offsets == 0, ctx.tokens.gather(1, root[:, None]), c.mask_token_id)  # [B, K]
        dtype = self.keys[0].dtype
        context = [(k[:, :, :width], v[:, :, :width]) for k, v in zip(self.keys, self.values)]
        visible = (torch.arange(width, device=self.device) < root[:, None])[:, None]  # [B, 1, C] positions 0..r-1
        rows = self.head(self.embed(ids).to(dtype)[:, None], (root[:, None] + offsets)[:, None], context, visible)[:, 0]
        shift = self.head.label_shift
        base = self.draft_lm_head(rows[:, 1 - shift: 1 - shift + self.depth])  # [B, depth, K] every position at once
        token = ids[:, 0]
        state = self.head.start(batch, rows)
        chain = BlockChain(self.head.draft_ids, self.vocab_size, ctx, self.sampled)
        for j in range(1, self.depth + 1):
            previous = self.embed(token).to(dtype) if self.head.refines else None
            logits, state = self.head.refine(j, rows[:, j - shift], base[:, j - 1], previous, state)
            token = chain.choose(logits)
        return chain.tree()

    def _read(self, ctx: DraftContext) -> int:
        """Write the context keys/values of the rows whose features just arrived; returns the
        context width the block must see (the longest request's committed length minus its root)."""
        counts_and_width = torch.cat([ctx.num_new, ctx.lengths.max()[None] - 1]).tolist()
        counts, width = counts_and_width[:-1], counts_and_width[-1]
        dtype = self.keys[0].dtype
        for run in catch_up_runs(counts):  # an admitted prompt is not padded onto every request's rows
            rows = max(max(counts[run]), 0)
            if rows == 0:
                continue
            num_new, lengths = ctx.num_new[run], ctx.lengths[run]
            offsets = torch.arange(rows, device=self.device)
            positions = (lengths - 1 - num_new)[:, None] + offsets  # [b, R] the new rows' positions
            features = torch.cat([h[run, :rows] for h in ctx.new_hidden], -1).to(dtype)
            slots = torch.where(offsets < num_new[:, None], positions, self.spare)
            for (keys, values), cache_k, cache_v in zip(self.head.context(features, positions.clamp(min=0)),
                                                        self.keys, self.values):
                index = slots[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[-1])
                cache_k[run].scatter_(2, index, keys)  # a slice of dim 0 is a view: written in place
                cache_v[run].scatter_(2, index, values)
        return width
