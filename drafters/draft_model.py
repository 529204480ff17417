"""An independent (smaller) Hugging Face LM sharing the target's tokenizer drafts a chain.

Greedy (T = 0): argmax chain, DETERMINISTIC. T > 0: tokens sampled from the draft model's processed
distribution q, a SAMPLED_IID chain carrying q for the Leviathan/Chen test.

Two ways to draft k tokens:
- sequential (default): k forwards of the draft model, each reading the token drafted before it.
- parallel (PARD, ICLR 2026): ONE forward over the draft's new tokens followed by k-1 copies of a
  mask token (the draft's config names it, ``pard_token``); the row after the last real token
  drafts position 1 and the row after mask j drafts position j + 1, so each position's q is
  conditioned on the committed text and the masks, not on the drafts before it. The chain's
  verification is unchanged: each node carries the q it was drawn from. The mask rows never stay
  in the draft's cache; the accepted drafts enter it in front of the next forward instead.

The draft model runs on its own HFTarget engine. Between steps, for every request: the engine's
cache holds a prefix of the committed tokens, its root is the next committed token, and
``pending`` holds the committed tokens after the root (sequential: exactly the last one once the
request runs; parallel: the accepted drafts but the first, then the target's bonus/correction).
The next proposal feeds them in front of its draft.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from drafters.base import (BudgetKnobs, DraftContext, DraftTree, DrafterBase, SiblingMode, TargetSizes, VerifyResult,
                           register)
from specdec.packaged_models import PACKAGED_MODELS, load_packaged
from specdec.protocols import Target
from specdec.sampling import probabilities
from specdec.target import HFTarget
from specdec.tree import chain_tree, empty_tree


def check_pard_folder(options: Mapping[str, Any], target: TargetSizes) -> None:
    """drafter.parallel=true with a model folder whose config.json names no pard_token: refused
    before the target loads (drafters.base.register's check)."""
    path = options.get("model_path")
    config = Path(str(path)) / "config.json"
    if not options.get("parallel") or not path or not config.is_file():
        return  # nothing to read here: the factory loads the model and checks it
    try:
        raw = json.loads(config.read_text())
    except (OSError, json.JSONDecodeError):
        return  # transformers names what is wrong with it when it loads
    if isinstance(raw, dict) and raw.get("pard_token") is None:
        raise ValueError(_no_mask_token(str(path)))


@register("draft_model", budget=BudgetKnobs(depth="num_draft"), check=check_pard_folder)
class DraftModelDrafter(DrafterBase):
    commit_reads_tree = True  # its cache keeps what its own last tree accepted

    def __init__(
        self,
        target: Target,
        model_path: str | None = None,
        num_draft: int = 4,
        dtype: str = "float32",
        parallel: bool = False,  # PARD: k drafts from one forward over k-1 appended mask tokens
        model=None,  # an already loaded transformers model (tests, notebooks)
    ) -> None:
        if num_draft < 1:
            raise ValueError(f"num_draft must be >= 1; got {num_draft}")
        if model is None:
            model = load_draft_model(model_path, dtype)
        self.mask_token = mask_token(model, model_path or "the draft model") if parallel else None
        # on the target's device (a model loaded here is on the CPU); the kernels configs/target/*.yaml pick
        self.engine = HFTarget(model.to(target.device), packed_gemm_from="auto")
        if self.engine.vocab_size != target.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary has {self.engine.vocab_size} tokens but the target's has "
                f"{target.vocab_size}; a draft model must share the target's tokenizer"
            )
        self.num_draft = num_draft
        # [B, W] committed tokens after the engine's root, not yet seen; the first count[b] are real
        self._pending = torch.zeros(0, 1, dtype=torch.int64, device=target.device)
        self._count = torch.zeros(0, dtype=torch.int64, device=target.device)  # [B]
        self._unread = 0  # requests at the end of the batch whose prompts the engine has not read yet
        self._lengths: torch.Tensor | None = None  # [B] committed lengths at the last proposal
        self._roots: torch.Tensor | None = None  # [B] the target's root at the last proposal

    def quantizable(self) -> list[nn.Module]:
        return [self.engine.model]

    def reset(self, batch_size: int, max_length: int) -> None:
        self._pending, self._count, self._unread = self._pending[:0], self._count[:0], batch_size

    def admit(self, count: int, max_length: int) -> None:
        self._unread += count

    def propose(self, ctx: DraftContext) -> DraftTree:
        batch, device = ctx.tokens.shape[0], ctx.tokens.device
        read = batch - self._unread
        if self._unread:  # new requests: the engine starts from their prompts, nothing pending
            prompts = [ctx.tokens[b, :n] for b, n in zip(range(read, batch), ctx.lengths[read:].tolist())]
            (self.engine.admit if read else self.engine.prefill)(prompts, ())
            width = self._pending.shape[1]
            self._pending = torch.cat([self._pending, self._pending.new_zeros(self._unread, width)])
            self._count = torch.cat([self._count, self._count.new_zeros(self._unread)])
            self._unread = 0
        self._lengths = ctx.lengths
        self._roots = ctx.tokens.gather(1, (ctx.lengths - 1)[:, None])[:, 0]
        if self.mask_token is not None:
            tokens, probs = self._draft_in_parallel(ctx)
        else:
            tokens, probs = self._draft_in_turn(ctx)
        if ctx.sampling.greedy:
            return chain_tree(tokens, SiblingMode.DETERMINISTIC)
        return chain_tree(tokens, SiblingMode.SAMPLED_IID, probs)

    def _draft_in_turn(self, ctx: DraftContext) -> tuple[torch.Tensor, torch.Tensor]:  # [B, k], [B, k, V]
        """k forwards, each feeding the token drafted before it (the first feeds the pending ones)."""
        batch, device = ctx.tokens.shape[0], ctx.tokens.device
        step = chain_tree(self._pending, SiblingMode.DETERMINISTIC, num_nodes=self._count)
        drafted, probs = [], []
        for _ in range(self.num_draft):
            logits = self.engine.forward_tree(step, ()).logits  # [B, N+1, V]
            last = step.num_nodes[:, None, None].expand(-1, 1, logits.shape[-1])  # the row after the tree
            q = probabilities(logits.gather(1, last)[:, 0], ctx.sampling)  # [B, V]
            token = _draw(q, ctx)
            drafted.append(token)
            probs.append(q)
            self.engine.commit(step, _accept_first(step, step.num_nodes, next_token=token))
            step = empty_tree(batch, device)
        return torch.stack(drafted, 1), torch.stack(probs, 1)

    def _draft_in_parallel(self, ctx: DraftContext) -> tuple[torch.Tensor, torch.Tensor]:  # [B, k], [B, k, V]
        """One forward over the pending tokens and k-1 masks; the masks' rows are dropped again."""
        k, count = self.num_draft, self._count
        width = self._pending.shape[1] + k - 1
        tokens = torch.full((len(count), width), self.mask_token, dtype=torch.int64, device=count.device)
        real = torch.arange(self._pending.shape[1], device=count.device) < count[:, None]  # [B, W]
        tokens[:, : self._pending.shape[1]] = torch.where(real, self._pending, self.mask_token)
        step = chain_tree(tokens, SiblingMode.DETERMINISTIC, num_nodes=count + k - 1)
        logits = self.engine.forward_tree(step, ()).logits  # [B, width + 1, V]
        # [B, k, 1]: the row after the last real token, then the row after each mask
        rows = (count[:, None] + torch.arange(k, device=count.device))[:, :, None]
        q = probabilities(logits.gather(1, rows.expand(-1, -1, logits.shape[-1])), ctx.sampling)  # [B, k, V]
        drafted = _draw(q, ctx)
        # keep the pending tokens, drop the masks; the first draft waits as the engine's root
        self.engine.commit(step, _accept_first(step, count, next_token=drafted[:, 0]))
        return drafted, q

    def commit(self, tree: DraftTree, result: VerifyResult) -> None:
        accepted = result.num_accepted
        if self.mask_token is None:
            # keep the engine's cache up to the last accepted draft token, which becomes its root
            last = tree.tokens.gather(1, (accepted - 1).clamp(min=0)[:, None])[:, 0]
            roots = torch.where(accepted > 0, last, self._roots)
            self.engine.rewind(self._lengths - 1 + accepted, roots)
            self._pending, self._count = result.next_token[:, None], torch.ones_like(accepted)
            return
        # the engine's cache holds every committed token up to the last proposal and its root is
        # the first draft: kept if accepted, else replaced by the target's correction
        self.engine.rewind(self._lengths, torch.where(accepted > 0, tree.tokens[:, 0], result.next_token))
        pending = torch.cat([tree.tokens[:, 1:], tree.tokens[:, :1]], 1)  # [B, k]: drafts 2..k, a spare column
        self._pending = pending.scatter(1, (accepted - 1).clamp(min=0)[:, None], result.next_token[:, None])
        self._count = accepted

    def retain(self, rows: torch.Tensor) -> None:
        self.engine.retain(rows)
        self._pending, self._count = self._pending[rows], self._count[rows]


def _draw(q: torch.Tensor, ctx: DraftContext) -> torch.Tensor:  # [B, ..., V] -> [B, ...]
    """argmax at T = 0; else one token per row drawn from q (exponential race)."""
    if ctx.sampling.greedy:
        return q.argmax(-1)
    return (q.double() / ctx.rng.exponential(*q.shape[1:])).argmax(-1)


def _accept_first(tree: DraftTree, count: torch.Tensor, next_token: torch.Tensor) -> VerifyResult:
    """The engine keeps the first count[b] nodes of a chain and takes next_token as its root."""
    accepted = torch.arange(tree.max_nodes, device=next_token.device).expand(tree.batch_size, -1)
    return VerifyResult(accepted, count, next_token)


def mask_token(model, name: str) -> int:
    """The PARD mask token id from the draft model's config (``pard_token``, as PARD's checkpoints
    and vLLM's parallel drafting read it)."""
    token = getattr(model.config, "pard_token", None)
    vocab = model.get_output_embeddings().weight.shape[0]
    if token is None:
        raise ValueError(_no_mask_token(name))
    if not 0 <= int(token) < vocab:
        raise ValueError(f"{name}'s pard_token {token} is outside its vocabulary of {vocab} tokens")
    return int(token)


def _no_mask_token(name: str) -> str:
    return (f"drafter.parallel=true needs a PARD draft model, but {name}'s config has no pard_token (the mask token "
            f"it was trained to fill); use a PARD checkpoint or drafter.parallel=false")


def load_draft_model(model_path: str | None, dtype: str):
    """The transformers model a draft_model config names: a Hugging Face folder, or a packaged
    model's name ("smollm2", "gemma3_270m")."""
    if not model_path:
        raise ValueError("drafter=draft_model needs drafter.model_path=<HF model folder> (or 'smollm2')")
    if model_path in PACKAGED_MODELS:
        return load_packaged(model_path, getattr(torch, dtype))[0]
    from transformers import AutoModelForCausalLM  # transformers' auto classes: ~0.4 s more, for a folder's model alone

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
