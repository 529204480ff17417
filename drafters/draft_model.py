"""An independent (smaller) Hugging Face LM sharing the target's tokenizer drafts a chain.

Greedy (T = 0): argmax chain, DETERMINISTIC. T > 0: tokens sampled from the draft model's processed
distribution q, a SAMPLED_IID chain carrying q for the Leviathan/Chen test.

The draft model runs on its own HFTarget engine. Invariant between steps: its cache holds all
committed tokens but the last two, its root is the second-to-last, and the last (the target's
bonus/correction token) is ``pending``, fed in front of the next draft.
"""

from __future__ import annotations

import torch
from torch import nn

from drafters.base import BudgetKnobs, DraftContext, DraftTree, DrafterBase, SiblingMode, VerifyResult, register
from specdec.protocols import Target
from specdec.sampling import probabilities
from specdec.target import HFTarget
from specdec.tree import chain_tree, empty_tree


@register("draft_model", budget=BudgetKnobs(depth="num_draft"))
class DraftModelDrafter(DrafterBase):
    commit_reads_tree = True  # its cache keeps what its own last tree accepted

    def __init__(
        self,
        target: Target,
        model_path: str | None = None,
        num_draft: int = 4,
        dtype: str = "float32",
        model=None,  # an already loaded transformers model (tests, notebooks)
    ) -> None:
        if num_draft < 1:
            raise ValueError(f"num_draft must be >= 1; got {num_draft}")
        if model is None:
            model = load_draft_model(model_path, dtype)
        # on the target's device (a model loaded here is on the CPU); the kernels configs/target/*.yaml pick
        self.engine = HFTarget(model.to(target.device), packed_gemm_from="auto")
        if self.engine.vocab_size != target.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary has {self.engine.vocab_size} tokens but the target's has "
                f"{target.vocab_size}; a draft model must share the target's tokenizer"
            )
        self.num_draft = num_draft
        # [B - unread] last committed token, not yet seen
        self._pending = torch.zeros(0, dtype=torch.int64, device=target.device)
        self._unread = 0  # requests at the end of the batch whose prompts the engine has not read yet
        self._lengths: torch.Tensor | None = None  # [B] committed lengths at the last proposal
        self._roots: torch.Tensor | None = None  # [B] the target's root at the last proposal

    def quantizable(self) -> list[nn.Module]:
        return [self.engine.model]

    def reset(self, batch_size: int, max_length: int) -> None:
        self._pending, self._unread = self._pending[:0], batch_size

    def admit(self, count: int, max_length: int) -> None:
        self._unread += count

    def propose(self, ctx: DraftContext) -> DraftTree:
        batch, device = ctx.tokens.shape[0], ctx.tokens.device
        read = batch - self._unread
        if self._unread:  # new requests: the engine starts from their prompts
            prompts = [ctx.tokens[b, :n] for b, n in zip(range(read, batch), ctx.lengths[read:].tolist())]
            (self.engine.admit if read else self.engine.prefill)(prompts, ())
            self._unread = 0
        # requests already running feed their pending token; new ones start from their root
        pending = torch.cat([self._pending, torch.zeros(batch - read, dtype=torch.int64, device=device)])
        running = (torch.arange(batch, device=device) < read).long()  # [B] one node or none
        step = chain_tree(pending[:, None], SiblingMode.DETERMINISTIC, num_nodes=running)
        self._lengths = ctx.lengths
        self._roots = ctx.tokens.gather(1, (ctx.lengths - 1)[:, None])[:, 0]
        drafted, probs = [], []
        for _ in range(self.num_draft):
            logits = self.engine.forward_tree(step, ()).logits  # [B, N+1, V]
            last = step.num_nodes[:, None, None].expand(-1, 1, logits.shape[-1])  # the row after the tree
            q = probabilities(logits.gather(1, last)[:, 0], ctx.sampling)  # [B, V]
            if ctx.sampling.greedy:
                token = q.argmax(-1)
            else:
                token = (q.double() / ctx.rng.exponential(q.shape[-1])).argmax(-1)
            drafted.append(token)
            probs.append(q)
            self.engine.commit(step, _accept_all(step, next_token=token))
            step = empty_tree(batch, device)
        if ctx.sampling.greedy:
            return chain_tree(torch.stack(drafted, 1), SiblingMode.DETERMINISTIC)
        return chain_tree(torch.stack(drafted, 1), SiblingMode.SAMPLED_IID, torch.stack(probs, 1))

    def commit(self, tree: DraftTree, result: VerifyResult) -> None:
        # keep the engine's cache up to the last accepted draft token, which becomes its root
        last = tree.tokens.gather(1, (result.num_accepted - 1).clamp(min=0)[:, None])[:, 0]
        roots = torch.where(result.num_accepted > 0, last, self._roots)
        self.engine.rewind(self._lengths - 1 + result.num_accepted, roots)
        self._pending = result.next_token

    def retain(self, rows: torch.Tensor) -> None:
        self.engine.retain(rows)
        self._pending = self._pending[rows]


def _accept_all(tree: DraftTree, next_token: torch.Tensor) -> VerifyResult:
    accepted = torch.arange(tree.max_nodes, device=next_token.device).expand(tree.batch_size, -1)
    return VerifyResult(accepted, tree.num_nodes, next_token)


def load_draft_model(model_path: str | None, dtype: str):
    """The transformers model a draft_model config names: a Hugging Face folder, or a packaged
    model's name ("smollm2", "gemma3_270m")."""
    from specdec.packaged_models import PACKAGED_MODELS, load_packaged

    if not model_path:
        raise ValueError("drafter=draft_model needs drafter.model_path=<HF model folder> (or 'smollm2')")
    if model_path in PACKAGED_MODELS:
        return load_packaged(model_path, getattr(torch, dtype))[0]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
