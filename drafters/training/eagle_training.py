"""Training an EagleHead on cached target features.

Per sequence x_0..x_{T-1} with features f_t: unroll step j = 0..U-1 feeds row t with
(input_j[t], embedding of x_{t+1+j}) and asks for the target's next-token choice after x_{t+1+j},
i.e. argmax(lm_head(f_{t+1+j})). input_0 is the true feature f_t; input_j (j > 0) is the head's own
step j-1 output at row t (training-time test: the head learns to read its own estimates, as it
must when it drafts several tokens). EAGLE-1 adds a SmoothL1 regression of the output onto the
final-norm feature it estimates.

The CE runs on the reduced draft vocabulary (drafters.training.data).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from drafters.eagle import EagleConfig, EagleDrafter, EagleHead, load_head
from drafters.heads import save_head
from drafters.training.data import EagleBatch, draft_vocabulary, head_data
from drafters.training.features import FeatureCache
from drafters.training.methods import Prepared, check_head, register_method
from specdec.protocols import HeadTarget


@dataclass(frozen=True)
class EagleLossConfig:
    unroll: int = 1  # training-time test steps (1 = EAGLE-1 teacher forcing only)
    step_decay: float = 0.8  # weight of unroll step j is step_decay ** j
    regression_weight: float = 1.0  # SmoothL1 onto the final-norm feature (0 for EAGLE-3)
    feature_noise: float = 0.1  # uniform noise on input features, relative to each row's RMS


class EagleLoss:
    def __init__(self, head: EagleHead, embedding: Tensor, lm_head: Tensor, config: EagleLossConfig) -> None:
        self.head, self.embedding, self.config = head, embedding, config
        self.draft_lm_head, self.to_draft = draft_vocabulary(lm_head, head.draft_ids)

    def __call__(self, batch: EagleBatch) -> tuple[Tensor, dict[str, float]]:
        c = self.config
        t = batch.tokens.shape[1]
        inputs = batch.features[:, : t - 1]
        if c.feature_noise > 0:
            rms = inputs.pow(2).mean(-1, keepdim=True).sqrt()
            inputs = inputs + (torch.rand_like(inputs) * 2 - 1) * c.feature_noise * rms
        total = torch.zeros(())
        metrics: dict[str, float] = {}
        for j in range(c.unroll):
            rows = t - 1 - j
            if rows <= 0:
                break
            tokens = batch.tokens[:, 1 + j : t]  # x_{t+1+j}
            out = self.head.forward_sequence(inputs[:, :rows], F.embedding(tokens, self.embedding))
            labels = self.to_draft[batch.labels[:, 1 + j : t].clamp(min=0)]
            valid = batch.valid[:, 1 + j : t] & (labels >= 0)
            logits = out[valid] @ self.draft_lm_head.T
            ce = F.cross_entropy(logits, labels[valid]) if valid.any() else out.sum() * 0
            loss = ce
            if c.regression_weight > 0:
                target = batch.final[:, 1 + j : t]
                in_sequence = batch.valid[:, 1 + j : t]
                loss = loss + c.regression_weight * F.smooth_l1_loss(out[in_sequence], target[in_sequence])
            total = total + c.step_decay**j * loss
            metrics[f"ce_{j}"] = float(ce.detach())
            metrics[f"accuracy_{j}"] = float((logits.argmax(-1) == labels[valid]).float().mean()) if valid.any() else 0.0
            inputs = out[:, :-1] if rows > 1 else out  # row t's estimate of f_{t+1+j} feeds step j+1
        metrics["label_coverage"] = float((self.to_draft[batch.labels.clamp(min=0)] >= 0)[batch.valid].float().mean())
        return total, metrics


@dataclass(frozen=True)
class EagleMethod:
    """EAGLE-1 (final-norm feature, regression + CE) and EAGLE-3 (fused layers, training-time test)."""

    name: str = "eagle"
    feature_layers_: tuple[int, ...] | None = None  # null: the final-norm output (EAGLE-1)
    loss_config: EagleLossConfig = EagleLossConfig()
    draft_vocab: int = 8192

    def feature_layers(self, target: HeadTarget) -> tuple[int, ...]:
        return tuple(self.feature_layers_ or (target.num_layers + 1,))

    def prepare(self, target: HeadTarget, cache: FeatureCache, batch_size: int, seed: int, shards: list[int],
                head: EagleHead | None = None) -> Prepared:
        layers = self.feature_layers(target)
        d = head_data(target, cache, layers, batch_size, seed, shards, self.draft_vocab)
        if head is None:
            head = EagleHead(EagleConfig.for_target(target, layers, len(d.draft_ids)), d.draft_ids)
        check_head(head, self.name, feature_layers=layers)
        loss = EagleLoss(head, d.embedding, d.lm_head, self.loss_config)
        return Prepared(head, d.data.batches, loss, d.data.num_tokens(), len(d.data.sequences))

    def load(self, target: HeadTarget, directory: Path) -> EagleHead:
        return load_head(directory, target)

    def export(self, model: nn.Module, directory: Path, extra: dict) -> None:
        save_head(model, directory, extra)

    def drafter(self, target: HeadTarget, model: nn.Module, depth: int) -> EagleDrafter:
        return EagleDrafter(target, model, depth=depth)


@register_method("eagle", "eagle3")
def eagle_method(name: str = "eagle", feature_layers: list[int] | None = None, unroll: int = 2, step_decay: float = 0.8,
                 regression_weight: float = 1.0, feature_noise: float = 0.1, draft_vocab: int = 8192) -> EagleMethod:
    loss = EagleLossConfig(unroll, step_decay, regression_weight, feature_noise)
    return EagleMethod(name, tuple(feature_layers) if feature_layers else None, loss, draft_vocab)
