"""MTP drafters: DeepSeek-V3-style multi-token prediction modules, trained post hoc on a frozen target.

Terms. f_i is the target feature after reading token x_i; h^0_i = f_i. Module d reads row
i = (h^{d-1}_i, x_{i+d}): RMSNorm of each, concatenated, projected 2H -> H, one causal pre-norm
transformer block over the rows of depth d, giving h^d_i; its own output RMSNorm and the target's
frozen LM head turn h^d_i into logits for x_{i+d+1}. Drafting k tokens after the root x_n reads row
n-1 at depths 1..k: depth 1 has only committed inputs and drafts x_{n+1}; depth d > 1 reads the
drafts x_{n+1} .. x_{n+d-1} and drafts x_{n+d}. The chain is the argmax at every depth
(DETERMINISTIC), so verification is exact at any temperature.

Two variants: ``num_modules = 1`` reuses one module at every depth (it can draft any depth),
``num_modules = depth`` has one module per depth, as DeepSeek-V3 (it drafts at most that deep).

State. Every depth keeps its own KV cache and its outputs h^d (the next depth's inputs) in slots
indexed by row, so a row's slot, RoPE position and causal mask are all its index i. Row i of depth
d is committed once all its inputs are (i <= n - d): it is computed once, in the proposal after its
last token is committed. Rows n-d+1 .. n-1 of depth d read drafted tokens: they are recomputed by
every proposal (k(k-1)/2 rows for a k-chain) and overwritten by later commits; a draft row never
overwrites a committed one. The last slot takes the keys of padding rows (ragged batches).

Which hidden state. DeepSeek-V3 feeds the main model's last hidden state before the final norm;
here h^0 is the final-norm output (HFTarget layer L + 1), because (1) it is what the shared
feature cache stores (the block-L output is not stored, and extracting it again costs the frozen
target's forward over every training token), (2) the module's own RMSNorm removes most of the
difference: final_norm(h) = w * h / rms(h) is h rescaled per channel by w (which the learned norm
weight can undo) and per row (which the RMSNorm removes up to the rms of w * h / rms(h)), and
(3) it stays free of the pre-norm state's massive activations (some channels in the thousands
on SmolLM2), which are awkward in float16 storage and drafting.

Reduced vocabulary. Like the EAGLE heads, the modules draft from the ``draft_vocab_size`` most
frequent target choices in the training data (``draft_ids``, saved with the checkpoint): SmolLM2's
frozen vocabulary-sized LM head would cost several times a module's block per drafted token (and
dominate the training loss). The candidates stay a deterministic argmax, so exactness does not
depend on it; a target token outside the draft vocabulary can simply never be drafted.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from drafters.base import BudgetKnobs, DraftContext, DraftTree, DrafterBase, SiblingMode, VerifyResult, register
from drafters.heads import (DecoderBlock, RMSNorm, bundled_checkpoint, catch_up_runs, checkpoint_check, draft_lm_head,
                            load_checkpoint, register_draft_ids, target_name, target_shape, token_embedding,
                            use_target_kernels)
from specdec.protocols import HeadTarget
from specdec.tree import chain_tree


@dataclass(frozen=True)
class MTPConfig:
    hidden_size: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int  # tokens the modules may draft (the most frequent target choices)
    num_modules: int  # 1: one module reused at every depth; = depth: one module per depth
    depth: int  # depths trained (the default draft depth)
    feature_layer: int  # target layer read as h^0 (L + 1 = final-norm output)
    target_num_layers: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    target: str = ""  # where the target came from, for error messages

    @staticmethod
    def for_target(target: HeadTarget, num_modules: int = 1, depth: int = 2, draft_vocab_size: int | None = None) -> MTPConfig:
        return MTPConfig(
            **target_shape(target),
            draft_vocab_size=draft_vocab_size or target.vocab_size,
            num_modules=num_modules,
            depth=depth,
            feature_layer=target.num_layers + 1,
        )


class MTPModule(DecoderBlock):
    """projection(cat(RMSNorm(h), RMSNorm(embedding))) -> one transformer block -> h^d; its own
    ``output_norm`` feeds the shared LM head."""

    def __init__(self, config: MTPConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.hidden_norm = RMSNorm(h, config.rms_eps)
        self.embedding_norm = RMSNorm(h, config.rms_eps)
        self.projection = nn.Linear(2 * h, h, bias=False)
        self.add_block(h, config.num_heads, config.intermediate_size, config.rope_theta, config.rms_eps)
        self.output_norm = RMSNorm(h, config.rms_eps)

    def fuse(self, hidden: Tensor, embeddings: Tensor) -> Tensor:  # [B, R, H], [B, R, H] -> [B, R, H]
        return self.projection(torch.cat([self.hidden_norm(hidden), self.embedding_norm(embeddings)], -1))


class MTPHead(nn.Module):
    """The MTP modules of one checkpoint and the draft vocabulary they share."""

    def __init__(self, config: MTPConfig, draft_ids: Tensor | None = None) -> None:
        super().__init__()
        if config.depth < 1 or config.num_modules not in (1, config.depth):
            raise ValueError(
                f"an MTP head has depth >= 1 and either one module or one per depth; got depth={config.depth}, "
                f"modules={config.num_modules}"
            )
        self.config = config
        register_draft_ids(self, draft_ids, config.draft_vocab_size)
        self.mtp_modules = nn.ModuleList(MTPModule(config) for _ in range(config.num_modules))

    def module(self, depth: int) -> MTPModule:
        """The module that predicts at ``depth`` (1 = the token after the root)."""
        if self.config.num_modules == 1:
            return self.mtp_modules[0]
        if not 1 <= depth <= self.config.num_modules:
            raise ValueError(f"this MTP head has one module per depth for depths 1..{self.config.num_modules}; got depth {depth}")
        return self.mtp_modules[depth - 1]

    def forward_sequence(self, depth: int, hidden: Tensor, embeddings: Tensor) -> Tensor:
        """Training: rows t = 0..T-1 of one depth, causal, at positions t. [B, T, H], [B, T, H] -> h^d [B, T, H]."""
        b, t = hidden.shape[:2]
        module = self.module(depth)
        positions = torch.arange(t, device=hidden.device).expand(b, t)
        causal = torch.ones(t, t, dtype=torch.bool, device=hidden.device).tril().expand(b, t, t)
        return module.block(module.fuse(hidden, embeddings), positions, None, None, causal)


def _parse_config(raw: dict) -> MTPConfig:
    return MTPConfig(**raw)


def load_mtp(directory: str | Path, target: HeadTarget) -> MTPHead:
    """Load MTP modules saved with ``save_head(head, directory, kind="mtp")`` and check they fit ``target``."""
    return load_checkpoint(directory, target, "mtp", _parse_config, MTPHead)


class MTPDrafter(DrafterBase):
    """A chain of ``depth`` argmax drafts through the MTP modules (see the module docstring)."""

    def __init__(self, target: HeadTarget, head: MTPHead, depth: int | None = None) -> None:
        depth = head.config.depth if depth is None else depth
        if depth < 1:
            raise ValueError(f"depth must be >= 1; got {depth}")
        if head.config.num_modules > 1 and depth > head.config.num_modules:
            raise ValueError(
                f"this MTP checkpoint has one module per depth for depths 1..{head.config.num_modules}; "
                f"depth={depth} needs a checkpoint trained that deep (or one with modules=1, reused at every depth)"
            )
        self.head, self.depth = use_target_kernels(head, target), depth
        self.max_depth = head.config.num_modules if head.config.num_modules > 1 else None
        self.embed = token_embedding(target)
        self.draft_lm_head = draft_lm_head(target, head.draft_ids)  # [..., H] -> [..., K]
        self.target_layers = (head.config.feature_layer,)
        self.device = target.device

    def quantizable(self) -> list[nn.Module]:
        return [self.head]  # the embeddings and LM head rows are the target's

    def reset(self, batch_size: int, max_length: int) -> None:
        c = self.head.config
        heads, width = c.num_heads, c.hidden_size // c.num_heads
        dtype = next(self.head.parameters()).dtype
        slots = max_length + 1  # rows 0..max_length-2 and a last slot for padding rows
        self.keys = torch.zeros(self.depth, batch_size, heads, slots, width, dtype=dtype, device=self.device)
        self.values = torch.zeros_like(self.keys)
        self.hidden = torch.zeros(self.depth, batch_size, slots, c.hidden_size, dtype=dtype, device=self.device)

    def admit(self, count: int, max_length: int) -> None:
        keys, values, hidden = self.keys, self.values, self.hidden
        self.reset(count, max_length)  # fresh rows for the new requests, appended below
        slots = max(keys.shape[3], self.keys.shape[3])
        # a wider cache moves the padding slot; the old one holds junk but is overwritten before it is read
        pad_cache = lambda t: F.pad(t, (0, 0, 0, slots - t.shape[3]))
        pad_hidden = lambda t: F.pad(t, (0, 0, 0, slots - t.shape[2]))
        self.keys = torch.cat([pad_cache(keys), pad_cache(self.keys)], 1)
        self.values = torch.cat([pad_cache(values), pad_cache(self.values)], 1)
        self.hidden = torch.cat([pad_hidden(hidden), pad_hidden(self.hidden)], 1)

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> DraftTree:
        root = ctx.lengths - 1  # [B] n: the root's index; rows 0..n-1 have target features
        counts = ctx.num_new.tolist()
        for run in catch_up_runs(counts):  # one call per module per run of requests of similar counts
            rows = max(counts[run])  # rows past a request's count are padding (its tree was wider than its path)
            if rows == 0:  # one-token prompts: nothing committed yet
                continue
            for depth in range(1, self.depth + 1):
                self._commit_rows(ctx, depth, root - ctx.num_new, root, rows, run)
        last = self.hidden[0].gather(1, (root - 1).clamp(min=0)[:, None, None].expand(-1, 1, self.hidden.shape[-1]))
        drafts, probs = map(list, zip(self._argmax(1, last[:, 0])))  # x_{n+1} from depth 1 at row n-1
        for depth in range(2, self.depth + 1):
            draft_rows = root[:, None] - depth + 1 + torch.arange(depth - 1, device=self.device)  # [B, d-1]: n-d+1 .. n-1
            out = self._run_rows(depth, draft_rows, draft_rows >= 0, torch.stack(drafts, 1))
            token, prob = self._argmax(depth, out[:, -1])
            drafts.append(token)
            probs.append(prob)
        # confidence: the modules' probability of the drafted path (for budgeted unions)
        return chain_tree(torch.stack(drafts, 1), SiblingMode.DETERMINISTIC, confidence=torch.stack(probs, 1).cumprod(1))

    def _commit_rows(self, ctx: DraftContext, depth: int, old_root: Tensor, root: Tensor, rows: int, run: slice) -> None:
        """Depth ``depth``'s newly committed rows: (old_root - d + 1 .. root - d), at most ``rows``
        per request, for the requests in ``run``."""
        first = (old_root[run] - depth + 1).clamp(min=0)  # [b]
        count = (root[run] - depth + 1).clamp(min=0) - first
        offsets = torch.arange(rows, device=self.device)
        row = first[:, None] + offsets  # [b, R]
        valid = offsets < count[:, None]
        tokens = ctx.tokens[run]
        next_tokens = tokens.gather(1, (row + depth).clamp(max=tokens.shape[1] - 1))  # x_{i+d}
        # depth 1 reads the target features (row first + j is new_hidden row j); deeper ones read h^{d-1}
        inputs = ctx.new_hidden[0][run, :rows].to(self.hidden.dtype) if depth == 1 else None
        self._run_rows(depth, row, valid, next_tokens, inputs, run)

    def _run_rows(self, depth: int, row: Tensor, valid: Tensor, tokens: Tensor, inputs: Tensor | None = None,
                  run: slice = slice(None)) -> Tensor:
        """Module ``depth`` over rows [b, R] of the requests in ``run`` (each row into its own slot;
        invalid rows into the padding slot), reading h^{d-1} at the same rows unless ``inputs``
        [b, R, H] is given; stores and returns h^d."""
        # views: the block and the scatter below write through them into the drafter's caches
        keys, values, hidden = self.keys[depth - 1, run], self.values[depth - 1, run], self.hidden[depth - 1, run]
        slots = keys.shape[2]
        if inputs is None:
            source = row.clamp(min=0, max=slots - 1)[:, :, None].expand(-1, -1, hidden.shape[-1])
            inputs = self.hidden[depth - 2, run].gather(1, source)
        write = torch.where(valid, row, slots - 1)  # [b, R]
        columns = torch.arange(slots, device=self.device)
        mask = torch.where(valid[:, :, None], columns <= row[:, :, None], columns == write[:, :, None])  # [b, R, S]
        module = self.head.module(depth)
        x = module.fuse(inputs, self.embed(tokens).to(hidden.dtype))
        out = module.block(x, torch.where(valid, row, 0), keys, values, mask, write)
        hidden.scatter_(1, write[:, :, None].expand(-1, -1, out.shape[-1]), out)
        return out

    def _argmax(self, depth: int, h: Tensor) -> tuple[Tensor, Tensor]:
        """[B, H] -> the drafted target token ids [B] and their probability under the module [B] float32."""
        logits = self.draft_lm_head(self.head.module(depth).output_norm(h))  # [B, K] over the draft vocabulary
        prob, index = torch.softmax(logits.float(), -1).max(-1)
        return self.head.draft_ids[index], prob

    def commit(self, tree: DraftTree, result: VerifyResult) -> None:
        pass  # committed rows are computed when their features arrive; draft rows are overwritten

    def retain(self, rows: Tensor) -> None:
        self.keys, self.values, self.hidden = self.keys[:, rows], self.values[:, rows], self.hidden[:, rows]


@register("mtp", needs="model", budget=BudgetKnobs(depth="depth", bounded=True),
          check=checkpoint_check("mtp", _parse_config, MTPHead, "mtp", "mtp"))
def mtp(target: HeadTarget, checkpoint: str | None = None, depth: int | None = None) -> MTPDrafter:
    """MTP chain drafting (default: the modules bundled for the target, at the depth they were trained for)."""
    return MTPDrafter(target, load_mtp(checkpoint or bundled_checkpoint("mtp", "mtp", target_name(target)), target), depth)
