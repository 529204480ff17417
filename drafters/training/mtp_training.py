"""Training MTP modules (drafters/mtp.py) on cached target features, the target frozen.

Per sequence x_0..x_{T-1} with final-norm features f_t: depth d reads rows i = 0..T-1-d with
(h^{d-1}_i, embedding of x_{i+d}), h^0 = f, and is asked for the target's own next-token choice
after x_{i+d}, i.e. argmax(lm_head(f_{i+d})) (the labels EagleData computes). Depth d > 1 reads the
modules' own depth d-1 outputs, as when drafting (DeepSeek-V3 trains its chained modules the same
way). The loss is sum_d w_d CE_d / sum_d w_d: DeepSeek-V3 weighs the mean of its depth losses by one
lambda against the main model's loss; with the target frozen there is no main loss, so one lambda
would only rescale the learning rate, and what remains are the relative depth weights.

As for the EAGLE heads, the CE runs on the reduced draft vocabulary (a label outside it is dropped
from the CE term and counted in ``label_coverage``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from drafters.heads import save_head
from drafters.mtp import MTPConfig, MTPDrafter, MTPHead, load_mtp
from drafters.training.data import EagleBatch, HeadData, draft_vocabulary
from drafters.training.methods import METHODS, HeadMethod, Prepared, check_head
from specdec.protocols import HeadTarget


class MTPLoss:
    def __init__(self, head: MTPHead, embedding: Tensor, lm_head: Tensor, depth_weights: tuple[float, ...]) -> None:
        if len(depth_weights) != head.config.depth:
            raise ValueError(f"depth_weights needs one weight per depth ({head.config.depth}); got {list(depth_weights)}")
        self.head, self.embedding, self.depth_weights = head, embedding, depth_weights
        self.draft_lm_head, self.to_draft = draft_vocabulary(lm_head, head.draft_ids)

    def __call__(self, batch: EagleBatch) -> tuple[Tensor, dict[str, float]]:
        t = batch.tokens.shape[1]
        hidden = batch.features[:, : t - 1]  # h^0 for rows 0..T-2
        total = torch.zeros((), device=batch.tokens.device)
        metrics: dict[str, float] = {}
        for depth, weight in enumerate(self.depth_weights, start=1):
            rows = t - depth
            if rows <= 0:
                break
            tokens = batch.tokens[:, depth:t]  # x_{i+d}
            out = self.head.forward_sequence(depth, hidden[:, :rows], F.embedding(tokens, self.embedding))
            labels = self.to_draft[batch.labels[:, depth:t].clamp(min=0)]
            valid = batch.valid[:, depth:t] & (labels >= 0)
            logits = self.head.module(depth).output_norm(out[valid]) @ self.draft_lm_head.T
            ce = F.cross_entropy(logits, labels[valid]) if valid.any() else out.sum() * 0
            total = total + weight * ce
            metrics[f"ce_{depth}"] = float(ce.detach())
            metrics[f"accuracy_{depth}"] = float((logits.argmax(-1) == labels[valid]).float().mean()) if valid.any() else 0.0
            hidden = out[:, :-1]  # row i's h^d feeds depth d+1 at row i (which reads x_{i+d+1})
        metrics["label_coverage"] = float((self.to_draft[batch.labels.clamp(min=0)] >= 0)[batch.valid].float().mean())
        return total / sum(self.depth_weights), metrics


@dataclass(frozen=True)
class MTPMethod(HeadMethod):
    name: str = "mtp"
    depth: int = 2
    num_modules: int = 1
    depth_weights: tuple[float, ...] = (1.0, 1.0)
    draft_vocab: int = 8192

    def feature_layers(self, target: HeadTarget) -> tuple[int, ...]:
        return (target.num_layers + 1,)

    def prepare_on(self, target: HeadTarget, d: HeadData, head: MTPHead | None = None) -> Prepared:
        if head is None:
            head = MTPHead(MTPConfig.for_target(target, self.num_modules, self.depth, len(d.draft_ids)), d.draft_ids)
        check_head(head, self.name, depth=self.depth, num_modules=self.num_modules, feature_layer=self.feature_layers(target)[0])
        loss = MTPLoss(head, d.embedding, d.lm_head, self.depth_weights)
        return Prepared(head, d.data.batches, loss, d.data.num_tokens(), len(d.data.sequences))

    def load(self, target: HeadTarget, directory: Path) -> MTPHead:
        return load_mtp(directory, target)

    def export(self, model: nn.Module, directory: Path, extra: dict) -> None:
        save_head(model, directory, extra, kind="mtp")

    def drafter(self, target: HeadTarget, model: nn.Module, depth: int) -> MTPDrafter:
        return MTPDrafter(target, model, depth)


@METHODS.register("mtp", online=True, needs="model")
def mtp_method(depth: int = 2, modules: int = 1, depth_weights: list[float] | None = None, draft_vocab: int = 8192) -> MTPMethod:
    """``modules``: 1 (one module reused at every depth) or ``depth`` (one per depth);
    ``depth_weights``: one CE weight per depth (null: equal)."""
    if depth < 1 or modules not in (1, depth):
        raise ValueError(f"train=mtp needs depth >= 1 and modules 1 (shared) or {depth} (one per depth); got modules={modules}")
    weights = tuple(float(w) for w in depth_weights) if depth_weights is not None else (1.0,) * depth
    if len(weights) != depth or min(weights) < 0 or sum(weights) <= 0:
        raise ValueError(f"train.depth_weights needs {depth} non-negative weights, not all zero; got {depth_weights}")
    return MTPMethod("mtp", depth, modules, weights, draft_vocab)
