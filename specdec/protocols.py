"""The contracts between the decode loop, targets, drafters and verifiers.

They live in the core because the loop creates or reads every one of these types; `drafters.base`
and `verifiers.base` re-export them for their users.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

if TYPE_CHECKING:  # transformers is heavy, and only model targets (specdec.target) need it
    from transformers import PreTrainedModel

from specdec.noise import RequestRNG, VerifyNoise
from specdec.sampling import SamplingParams
from specdec.tree import DraftTree


@dataclass(frozen=True)
class VerifyResult:
    accepted_nodes: Tensor  # [B, N] int64, accepted node indices root->leaf, -1 padded
    num_accepted: Tensor  # [B] int64
    next_token: Tensor  # [B] int64, correction (after a rejection) or bonus (all accepted)


def emitted_tokens(tree: DraftTree, result: VerifyResult) -> Tensor:  # [B, N+1] int64
    """The tokens a step commits after the root: the accepted path, then next_token at column
    num_accepted; columns past it are meaningless."""
    emitted = tree.tokens.gather(1, result.accepted_nodes.clamp(min=0))
    emitted = torch.cat([emitted, result.next_token[:, None]], dim=1)
    return emitted.scatter_(1, result.num_accepted[:, None], result.next_token[:, None])


class Verifier(Protocol):
    def __call__(
        self,
        tree: DraftTree,
        target_logits: Tensor,  # [B, N+1, V]; row 0 after the committed prefix, row i+1 after node i
        sampling: SamplingParams,
        noise: VerifyNoise,
    ) -> VerifyResult: ...


@dataclass(frozen=True)
class TargetOutput:
    logits: Tensor  # [B, R, V] float32
    hidden: tuple[Tensor, ...]  # one [B, R, H] per requested layer, same rows as logits


def cat_padded(tensors: Sequence[Tensor], dim: int) -> Tensor:
    """Concatenate along dim 0 after zero-padding dimension ``dim`` of each to the widest."""
    width = max(t.shape[dim] for t in tensors)
    pad = lambda t: torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1 - dim) + (0, width - t.shape[dim]))
    return torch.cat([pad(t) for t in tensors])


def stack_rows(*parts: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """Per layer [B1, R1, H], [B2, R2, H], ... -> [B1 + B2 + ..., max R, H], zero-padded; padding
    rows are never read (each request's valid rows are counted by its number of new tokens)."""
    return tuple(cat_padded(layer, 1) for layer in zip(*parts))


@dataclass(frozen=True)
class DraftContext:
    """What a drafter sees before proposing.

    ``new_hidden`` holds the target's hidden states of the tokens that entered the target's KV cache
    since the last proposal (after prefill: the prompt minus its last token; after a step: the root
    and the accepted nodes), so a feature-based drafter can extend its own state incrementally.
    """

    tokens: Tensor  # [B, L] int64, committed tokens (prompt + generated, root last), right-padded
    lengths: Tensor  # [B] int64, valid length per request; tokens[b, lengths[b] - 1] is the root
    new_hidden: tuple[Tensor, ...]  # one [B, R, H] per layer in Drafter.target_layers
    num_new: Tensor  # [B] int64, valid rows of new_hidden per request
    sampling: SamplingParams
    rng: RequestRNG  # per-request streams for the drafter's own sampling


class Drafter(Protocol):
    """Batch rows follow the target's: ``reset`` starts a batch, ``retain`` drops finished rows,
    ``admit`` appends new requests as the last rows (continuous batching). Within a decode step the
    loop calls retain, then admit, then propose, so an admitted request's first DraftContext
    carries its prompt (``num_new`` = prompt length - 1 hidden rows, as after a prefill). A drafter
    whose per-request state is rebuilt from each DraftContext needs no work for any of these
    (``drafters.base.StatelessDrafter``)."""

    # target layers whose hidden states the drafter needs (0 = embeddings, k = output of block k,
    # L + 1 = final-norm output); empty for drafters that read tokens only
    target_layers: tuple[int, ...]

    def reset(self, batch_size: int, max_length: int) -> None: ...

    def admit(self, count: int, max_length: int) -> None:
        """Append ``count`` new requests (fresh state) after the current rows; ``max_length`` bounds
        every request's committed length, as in reset."""
        ...

    def propose(self, ctx: DraftContext) -> DraftTree: ...

    def commit(self, tree: DraftTree, result: VerifyResult) -> None: ...

    def observe(self, tree: DraftTree, logits: Tensor, result: VerifyResult) -> None:
        """After commit, every step: the target's logits over the step's tree ([B, N+1, V]; row 0
        after the root, row i+1 after node i), for drafters that draft from what the target
        predicted (Token Recycling's candidates, Lookahead's Jacobi window). The next proposal may
        depend on them: they are a function of the committed text and the drafted tokens, never
        of the coins of the step that will verify that proposal, so verification stays exact."""
        ...

    def retain(self, rows: Tensor) -> None:
        """Keep only these requests ([A] int64 indices into the current batch, in this order)."""
        ...


@dataclass(frozen=True)
class TargetSizes:
    """What a drafter is checked against before the target's weights load (read from its config):
    a head's checkpoint must have the target's sizes."""

    # as checkpoints record a target and errors name it: a packaged model's key (its bundled heads are
    # found by it), another model's folder (specdec.target_loader)
    name: str
    vocab_size: int
    hidden_size: int | None  # None: a target without hidden states (the synthetic one)
    num_layers: int | None
    kind: str = "model"  # as Target.kind: "model" (a transformers model), "synthetic"


class Target(Protocol):
    vocab_size: int
    max_length: int  # context window in tokens
    device: torch.device  # where its tensors live: the loop keeps its own there
    # True: a row's logits are those of its token computed alone, bit for bit, whatever the batch
    # and tree around it, so greedy output equals plain decoding's (the "bitwise" contract). False:
    # kernels may round a row differently with the batch shape; the verifier stays exact for the
    # logits it is given (the "logits" contract, docs/NOTES.md "The exactness contract")
    invariant: bool
    # what the target is, for drafters that need one kind (their registration's ``needs``): "model"
    # = a HeadTarget, a transformers causal LM behind it that drafters and transformers' generate()
    # can run; "synthetic" = specdec.synthetic.SyntheticTarget, logits hashed from the context
    kind: str
    # the registered name (specdec.target_loader.TARGETS) that opened it: smollm2, gemma3_270m (its
    # bfloat16 config too: the same model), synthetic, and hf for any other model, a user's folder or
    # one built in memory. It decides which heads are bundled for the target (drafters.heads), so it
    # names what the target is, never where its files are
    key: str

    def prefill(self, prompts: list[Tensor], layers: tuple[int, ...]) -> TargetOutput:
        """Start one request per prompt (1-D int64 tensors, len >= 1). Caches all but the last token
        of each prompt (it becomes the root of the first tree); returns their hidden states
        (logits may be empty: nothing is sampled from them)."""
        ...

    def admit(self, prompts: list[Tensor], layers: tuple[int, ...]) -> TargetOutput:
        """Start one request per prompt as new rows after the current ones (continuous batching);
        caches and returns exactly what ``prefill`` would for these prompts alone (hidden [P, R, H])."""
        ...

    def forward_tree(self, tree: DraftTree, layers: tuple[int, ...]) -> TargetOutput:
        """Logits [B, N+1, V] for the root and every node: ancestors-only attention, positions =
        committed length + depth."""
        ...

    def commit(self, tree: DraftTree, result: VerifyResult) -> None:
        """Keep the root and the accepted path of the last tree in the cache; next_token is the new root."""
        ...

    def retain(self, rows: Tensor) -> None:
        """Keep only these requests ([A] int64 indices into the current batch, in this order):
        finished requests leave the batch instead of being computed for nothing. A may be 0 when
        every request finished and queued ones are admitted next."""
        ...


class HeadTarget(Target, Protocol):
    """A target backed by a transformers causal LM (``specdec.target.HFTarget``), as drafters that
    draft with the target's own modules read it: trained heads (EAGLE, MTP, Medusa, Domino) take
    their sizes from it and share its frozen embeddings and LM head; layer skip runs its decoder
    blocks on its KV cache."""

    model: PreTrainedModel  # the causal LM itself (embeddings, LM head, config, decoder blocks)
    folder: Path | None  # the model folder it was loaded from (its tokenizer's too); None for a model built in memory
    num_layers: int  # decoder blocks L: hidden-state layers are 0 (embeddings) .. L + 1 (final norm)
    hidden_size: int
    dtype: torch.dtype  # of its weights: a head is loaded in the same one
    # on a CPU: the rows from which its linear layers take packed GEMMs, which a head's own layers
    # take too (drafters.heads.use_target_kernels); None = the stock kernels
    packed_gemm_from: int | None

    @property
    def kv_cache(self) -> Any:
        """The transformers Cache of the committed tokens (request b owns columns [0, cached[b]) of
        every layer); whatever a drafter appends to it must be gone before the target's next forward."""
        ...

    def forward_layers(
        self,
        layers: Sequence[int],
        cache: Any,
        input_ids: Tensor,  # [B, Q] int64
        positions: Tensor,  # [B, Q] int64
        visible: Tensor,  # [B, Q, C+Q] bool, C = columns already in `cache` (0 without one)
        logits_to_keep: int = 0,
    ) -> Tensor:  # [B, Q or logits_to_keep, V] float32
        """Logits of the target reduced to decoder ``layers`` (increasing indices), then its final
        norm and LM head; ``cache`` is a transformers Cache whose entry i serves layer i, or None."""
        ...
