"""Training DFlash and Domino heads (drafters/dflash.py, drafters/domino.py) on target features,
with the objective of the Domino paper and SpecForge's OnlineDFlashModel / OnlineDominoModel.

Per sequence x_0..x_{T-1} with fused features f_t and labels y_t (the target's argmax after x_t, its
own choice of x_{t+1}): up to ``num_anchors`` anchors a are drawn at random among positions with a
label, a fresh draw every step (seeded by the step, so a resumed run draws the same). Anchor a's
block is x_a and mask tokens at positions a..a+B-1; it sees the context rows f_0..f_{a-1} (what
drafting sees with x_a as the root) and its own rows, never another block's. All blocks of a batch
run in one forward: context keys/values are computed once per sequence, every block attends to
them under its own mask. The token at depth j (position a+j) is labelled y_{a+j-1}, weighted by
exp(-(j-1)/gamma): early depths decide whether later ones are reached at all.

DFlash: loss = the weighted CE of the base logits. Domino: the refinement is teacher-forced (its
prefix at depth j is x_a..x_{a+j-1}, which on an accepted path are the target's own choices), and
loss = (1 - lambda) CE(refined) + lambda CE(base), lambda falling linearly from ``lambda_start``
to 0 over the first ``lambda_decay_ratio`` of ``lambda_steps`` steps: the backbone learns to draft
alone first, then hands over to the refinement.

The CE runs on the head's draft vocabulary (labels outside it drop out, counted in label_coverage);
``draft_vocab: null`` keeps the whole vocabulary, which published heads and engines expect.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from drafters.dflash import DFlashConfig, DFlashDrafter, DFlashHead
from drafters.domino import DominoConfig, DominoHead
from drafters.formats.load import load_dflash, save_dflash
from drafters.training.data import EagleData, HeadData, draft_vocabulary
from drafters.training.methods import METHODS, HeadMethod, Prepared, check_head
from specdec.protocols import HeadTarget


@dataclass(frozen=True)
class BlockBatch:
    features: Tensor  # [B, T, n*H] float32, the head's input layers
    tokens: Tensor  # [B, T] int64
    labels: Tensor  # [B, T] int64, the target's argmax after token t, -1 on padding
    valid: Tensor  # [B, T] bool
    step: int  # the optimizer step it is for (draws the anchors, drives lambda; survives a resume)


def block_batches(data: EagleData, index: int) -> Iterator[BlockBatch]:
    """Batch ``index`` on: under torchrun process r of W takes batches s * W + r at step s."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    for i, batch in enumerate(data.batches(index)):
        yield BlockBatch(batch.features, batch.tokens, batch.labels, batch.valid, (index + i) // world)


def sample_anchors(valid: Tensor, count: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Up to ``count`` distinct anchors per sequence among its labelled positions ([B, T] bool), in
    increasing order -> (anchors [B, N] int64, kept [B, N] bool; unkept slots hold 0)."""
    available = valid.sum(1)  # [B]
    width = max(1, min(count, int(available.max())))
    scores = torch.rand(valid.shape, generator=generator, device=valid.device).masked_fill(~valid, 2.0)
    picked = scores.argsort(1)[:, :width]
    kept = torch.arange(width, device=valid.device) < available.clamp(max=width)[:, None]
    anchors = torch.where(kept, picked, valid.shape[1]).sort(1).values
    kept = anchors < valid.shape[1]
    return torch.where(kept, anchors, 0), kept


@dataclass(frozen=True)
class Objective:
    num_anchors: int = 512  # blocks per sequence and step
    gamma: float = 7.0  # depth j weighs exp(-(j-1)/gamma); <= 0: all depths alike
    lambda_start: float = 1.0  # Domino: the base CE's weight at step 0
    lambda_decay_ratio: float = 0.5  # ... reaching 0 after this share of lambda_steps
    lambda_steps: int = 1000

    def lambda_base(self, step: int) -> float:
        decay = max(1, int(self.lambda_steps * self.lambda_decay_ratio))
        return max(0.0, min(1.0, self.lambda_start * (1.0 - step / decay)))


CE_ROWS = 1024  # rows of logits alive at once in chunked_ce: [CE_ROWS, V] rather than [M, V]


def weighted_ce(logits: Tensor, target: Tensor, weight: Tensor) -> Tensor:  # [M, V], [M], [M] -> []
    """The weighted sum of the rows' cross-entropies."""
    return (F.cross_entropy(logits, target, reduction="none") * weight).sum()


def _chunk(rows: Tensor, lm_head: Tensor, target: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    logits = rows @ lm_head.T
    return weighted_ce(logits, target, weight), logits.detach().argmax(-1)


def chunked_ce(rows: Tensor, lm_head: Tensor, target: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """The weighted mean cross-entropy of the logits ``rows @ lm_head.T`` (rows [M, H], lm_head
    [V, H]) against target [M], and their argmax [M], CE_ROWS rows at a time, each chunk's logits
    recomputed in the backward pass: a 262k-token vocabulary would otherwise hold [M, V] logits and
    their gradient at once, more memory than a CPU machine has."""
    total, predicted = rows.new_zeros(()), []
    for start in range(0, len(rows), CE_ROWS):
        part = slice(start, start + CE_ROWS)
        chunk_sum, chunk_argmax = checkpoint(_chunk, rows[part], lm_head, target[part], weight[part], use_reentrant=False)
        total = total + chunk_sum
        predicted.append(chunk_argmax)
    return total / weight.sum().clamp(min=1e-6), torch.cat(predicted) if predicted else target.new_zeros(0)


def depth_metrics(correct: Tensor, valid: Tensor, in_data: Tensor, kept: Tensor, label_shift: int) -> dict[str, float]:
    """Teacher-forced figures of N blocks per sequence from correct / valid / in_data [B, N, K] bool
    (right; labelled in the draft vocabulary; labelled at all) and kept [B, N] bool, per depth j
    (block row j - label_shift):
    - accuracy_j: top-1 among the rows labelled at depth j;
    - alpha_j: the same among the rows whose depths 1..j-1 were all right, what the decode loop's
      per-depth alpha counts (a label outside the draft vocabulary is a miss). A block drafter's
      depths are drafted in parallel, so alpha_j can fall far below accuracy_j when its depth j is
      right mostly where depth j-1 was wrong;
    - accept_length: drafted depths in a row, right, from depth 1 (a row past the data ends the run
      without a miss)."""
    first = 1 - label_shift
    right, labelled, present = correct[..., first:], valid[..., first:], in_data[..., first:]  # [B, N, D]
    before = F.pad(right.long().cumprod(-1)[..., :-1], (1, 0), value=1).bool()  # depths 1..j-1 all right
    metrics = {}
    for j in range(1, right.shape[-1] + 1):
        column, reached = labelled[..., j - 1], before[..., j - 1] & present[..., j - 1]
        metrics[f"accuracy_{j}"] = float(right[..., j - 1][column].float().mean()) if column.any() else 0.0
        metrics[f"alpha_{j}"] = float(right[..., j - 1][reached].float().mean()) if reached.any() else 0.0
    run = (right | ~present).long().cumprod(-1) * present
    metrics["accept_length"] = float(run.sum(-1)[kept].float().mean()) if kept.any() else 0.0
    return metrics


class BlockLoss:
    def __init__(self, head: DFlashHead, embedding: Tensor, lm_head: Tensor, objective: Objective) -> None:
        self.head, self.embedding, self.objective = head, embedding, objective
        self.draft_lm_head, self.to_draft = draft_vocabulary(lm_head, head.draft_ids)

    def __call__(self, batch: BlockBatch) -> tuple[Tensor, dict[str, float]]:
        head, c = self.head, self.head.config
        b, t = batch.tokens.shape
        k, device = c.block_size, batch.tokens.device
        generator = torch.Generator(device=device).manual_seed(batch.step)
        anchors, kept = sample_anchors(batch.valid, self.objective.num_anchors, generator)
        n = anchors.shape[1]
        offsets = torch.arange(k, device=device)
        context = head.context(batch.features, torch.arange(t, device=device).expand(b, t))
        ids = torch.where(offsets == 0, batch.tokens.gather(1, anchors)[..., None], c.mask_token_id)  # [b, N, K]
        sees_context = (torch.arange(t, device=device) < anchors[..., None]) & kept[..., None]  # [b, N, T]
        rows = head(F.embedding(ids, self.embedding), anchors[..., None] + offsets, context, sees_context)  # [b, N, K, H]

        depth = offsets + head.label_shift  # [K] the depth each row drafts (0: none)
        label_at = anchors[..., None] + depth - 1  # [b, N, K] y index of that depth
        index = label_at.clamp(0, t - 1).reshape(b, -1)
        labels = self.to_draft[batch.labels.gather(1, index).clamp(min=0)].reshape(b, n, k)
        in_data = batch.valid.gather(1, index).reshape(b, n, k) & (depth >= 1) & (label_at < t) & kept[..., None]
        valid = in_data & (labels >= 0)
        gamma = self.objective.gamma
        weights = torch.exp(-(depth - 1).clamp(min=0).float() / gamma) if gamma > 0 else torch.ones(k, device=device)
        weight = weights.expand(b, n, k)[valid]  # [M]
        target = labels[valid]
        if not head.refines:  # DFlash: the base logits alone, a chunk of rows at a time
            loss, predicted = chunked_ce(rows[valid], self.draft_lm_head, target, weight)
        else:
            base = rows[valid] @ self.draft_lm_head.T  # [M, Kd] only the rows with a label
            total = weight.sum().clamp(min=1e-6)
            loss = weighted_ce(base, target, weight) / total
        metrics = {"ce_base": float(loss.detach()),
                   "label_coverage": float((labels >= 0)[in_data].float().mean()) if in_data.any() else 0.0}
        if head.refines:
            prefix = F.embedding(batch.tokens.gather(1, (anchors[..., None] + offsets).clamp(max=t - 1).reshape(b, -1)),
                                 self.embedding).reshape(b * n, k, -1)  # x_a..x_{a+K-1}
            inputs, corrected = head.correction_inputs(rows.reshape(b * n, k, -1), prefix)
            inputs, corrected = inputs.reshape(b, n, k, -1)[valid], corrected.expand(b, n, k)[valid]
            final = base + head.embed_proj(inputs) * corrected[:, None]
            lam = self.objective.lambda_base(batch.step)
            ce_final = weighted_ce(final, target, weight) / total
            predicted = final.detach().argmax(-1)
            metrics.update(ce_final=float(ce_final.detach()), lambda_base=lam)
            loss = (1 - lam) * ce_final + lam * loss
        with torch.no_grad():
            correct = torch.zeros(b, n, k, dtype=torch.bool, device=device)
            correct[valid] = predicted == target
            metrics.update(depth_metrics(correct, valid, in_data, kept, head.label_shift))
        return loss, metrics


@dataclass(frozen=True)
class BlockMethod(HeadMethod):
    """DFlash (``refine=False``) and Domino heads: the same backbone, data and objective."""

    name: str
    feature_layers_: tuple[int, ...] | None  # null: three layers spread over the target
    draft_vocab: int | None  # null: the whole vocabulary
    sizes: tuple[tuple[str, object], ...]  # config fields: block_size, num_layers, gru_size, ...
    objective: Objective
    refine: bool  # Domino: the GRU refinement after the backbone

    def feature_layers(self, target: HeadTarget) -> tuple[int, ...]:
        return DFlashConfig.for_target(target, self.feature_layers_).feature_layers

    def counts_choices(self, head: nn.Module | None) -> bool:
        return head is None and self.draft_vocab is not None

    def prepare_on(self, target: HeadTarget, d: HeadData, head: DFlashHead | None = None) -> Prepared:
        layers = self.feature_layers(target)
        if head is None:
            draft_ids = d.draft_ids.sort().values if self.draft_vocab else None
            config_class, head_class = (DominoConfig, DominoHead) if self.refine else (DFlashConfig, DFlashHead)
            sizes = {**dict(self.sizes), "draft_vocab_size": 0 if draft_ids is None else len(draft_ids)}
            head = head_class(config_class.for_target(target, layers, **sizes), draft_ids)
        if isinstance(head, DominoHead) and not self.refine:
            # DFlash from a Domino head: its backbone, the refinement dropped; train.draft_vocab=null
            # (the default) drafts over the whole vocabulary as published heads do, else the Domino's own
            head = head.backbone(whole_vocabulary=self.draft_vocab is None)
        if isinstance(head, DominoHead) != self.refine:
            raise ValueError(f"init: the checkpoint is a {type(head).__name__}, not a head train={self.name} trains")
        check_head(head, self.name, feature_layers=layers, block_size=dict(self.sizes)["block_size"])
        loss = BlockLoss(head, d.embedding, d.lm_head, self.objective)
        return Prepared(head, lambda index: block_batches(d.data, index), loss, d.data.num_tokens(), len(d.data.sequences))

    def load(self, target: HeadTarget, directory: Path) -> DFlashHead:
        return load_dflash(directory, target)

    def export(self, model: nn.Module, directory: Path, extra: dict) -> None:
        save_dflash(model, directory, extra)

    def drafter(self, target: HeadTarget, model: nn.Module, depth: int) -> DFlashDrafter:
        # eval.depth is shared by every method; a block cannot draft past its own size
        return DFlashDrafter(target, model, depth=min(depth, model.max_depth))


def build(name: str, refine: bool, feature_layers: list[int] | None, draft_vocab: int | None, objective: Objective,
          **sizes: object) -> BlockMethod:
    if objective.num_anchors < 1:
        raise ValueError(f"train={name}: num_anchors must be >= 1; got {objective.num_anchors}")
    sizes = {key: value for key, value in sizes.items() if value is not None}  # null: the target's (for_target)
    return BlockMethod(name, tuple(feature_layers) if feature_layers else None, draft_vocab, tuple(sizes.items()), objective,
                       refine)


@METHODS.register("dflash", online=True, needs="model")
def dflash_method(name: str = "dflash", feature_layers: list[int] | None = None, draft_vocab: int | None = None,
                  block_size: int = 16, num_layers: int = 1, mask_token_id: int | None = None,
                  intermediate_size: int | None = None, num_anchors: int = 512, gamma: float = 7.0) -> BlockMethod:
    return build(name, False, feature_layers, draft_vocab, Objective(num_anchors, gamma), block_size=block_size,
                 num_layers=num_layers, mask_token_id=mask_token_id, intermediate_size=intermediate_size)


@METHODS.register("domino", online=True, needs="model")
def domino_method(name: str = "domino", feature_layers: list[int] | None = None, draft_vocab: int | None = None,
                  block_size: int = 16, num_layers: int = 1, mask_token_id: int | None = None,
                  intermediate_size: int | None = None, num_anchors: int = 512, gamma: float = 7.0,
                  gru_size: int = 512, emb_dim: int = 256, pure_draft_prefix_len: int = 1, shift_label: bool = False,
                  lambda_start: float = 1.0, lambda_decay_ratio: float = 0.5, lambda_steps: int = 1000) -> BlockMethod:
    objective = Objective(num_anchors, gamma, lambda_start, lambda_decay_ratio, lambda_steps)
    return build(name, True, feature_layers, draft_vocab, objective, block_size=block_size, num_layers=num_layers,
                 mask_token_id=mask_token_id, intermediate_size=intermediate_size, gru_size=gru_size, emb_dim=emb_dim,
                 pure_draft_prefix_len=pure_draft_prefix_len, shift_label=shift_label)
