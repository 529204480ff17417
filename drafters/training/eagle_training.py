"""Training an EagleHead on cached target features.

Per sequence x_0..x_{T-1} with features f_t: unroll step j = 0..U-1 feeds row t with
(input_j[t], embedding of x_{t+1+j}) and asks for the target's next-token choice after x_{t+1+j},
i.e. argmax(lm_head(f_{t+1+j})). input_0 is the true feature f_t; input_j (j > 0) is the head's own
step j-1 output at row t (training-time test: the head learns to read its own estimates, as it
must when it drafts several tokens). EAGLE-1 adds a SmoothL1 regression of the output onto the
final-norm feature it estimates.

The CE runs on the reduced draft vocabulary (drafters.training.data): through the target's frozen LM
head rows, or (arch=eagle3, the published EAGLE-3 head) through the head's own norm and LM head,
initialised from those rows. arch=eagle1|eagle3 trains the published architectures, which
specdec-export writes for vLLM and SGLang; arch=native (the default) is the head every bundled
checkpoint has.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from drafters.eagle import EagleDrafter, EagleHead, build_head, load_head
from drafters.eagle_config import ARCHS, EagleConfig
from drafters.eagle_published import PublishedEagleHead
from drafters.heads import save_head
from drafters.training.data import EagleBatch, HeadData, draft_vocabulary
from drafters.training.features import fused_layers
from drafters.training.methods import METHODS, HeadMethod, Prepared, check_head
from specdec.protocols import HeadTarget

FUSED = "fused"  # train.feature_layers: EAGLE-3's low, middle and high blocks of whatever target (fused_layers)
AUTO = "auto"  # train.feature_norm: decided from the target's features (needs_feature_norm)
# A fused layer whose typical row RMS is above this gets the fusion norm under feature_norm=auto. Unit-scale
# targets (SmolLM2) stay well below it and keep the head every bundled checkpoint of theirs has; targets whose
# residual stream grows by orders of magnitude (Gemma 3) are far above it (docs/NOTES.md, "In training").
FEATURE_SCALE_LIMIT = 100.0


@dataclass(frozen=True)
class EagleLossConfig:
    unroll: int = 1  # training-time test steps (1 = EAGLE-1 teacher forcing only)
    step_decay: float = 0.8  # weight of unroll step j is step_decay ** j
    regression_weight: float = 1.0  # SmoothL1 onto the final-norm feature (0 for EAGLE-3)
    feature_noise: float = 0.1  # uniform noise on input features, relative to each row's RMS


class EagleLoss:
    def __init__(self, head: EagleHead | PublishedEagleHead, embedding: Tensor, lm_head: Tensor,
                 config: EagleLossConfig) -> None:
        self.head, self.embedding, self.config = head, embedding, config
        self.draft_lm_head, self.to_draft = draft_vocabulary(lm_head, head.draft_ids)
        self.own_lm_head = head.config.arch == "eagle3"  # trained with the head, not the target's frozen rows

    def __call__(self, batch: EagleBatch) -> tuple[Tensor, dict[str, float]]:
        c = self.config
        t = batch.tokens.shape[1]
        inputs = batch.features[:, : t - 1]
        if c.feature_noise > 0:
            rms = inputs.pow(2).mean(-1, keepdim=True).sqrt()
            inputs = inputs + (torch.rand_like(inputs) * 2 - 1) * c.feature_noise * rms
        total = torch.zeros((), device=batch.tokens.device)
        metrics: dict[str, float] = {}
        for j in range(c.unroll):
            rows = t - 1 - j
            if rows <= 0:
                break
            tokens = batch.tokens[:, 1 + j : t]  # x_{t+1+j}
            out = self.head.forward_sequence(inputs[:, :rows], F.embedding(tokens, self.embedding))
            labels = self.to_draft[batch.labels[:, 1 + j : t].clamp(min=0)]
            valid = batch.valid[:, 1 + j : t] & (labels >= 0)
            logits = self.head.draft_logits(out[valid]) if self.own_lm_head else out[valid] @ self.draft_lm_head.T
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
class EagleMethod(HeadMethod):
    """EAGLE-1 (final-norm feature, regression + CE) and EAGLE-3 (fused layers, training-time test)."""

    name: str = "eagle"
    feature_layers_: tuple[int, ...] | str | None = None  # null: the final-norm output (EAGLE-1); "fused": fused_layers
    loss_config: EagleLossConfig = EagleLossConfig()
    draft_vocab: int = 8192
    arch: str = "native"  # or eagle1 / eagle3: the published architectures specdec-export writes
    feature_norm: bool | str = AUTO  # native heads: an RMSNorm after the fusion (EagleConfig.feature_norm); auto: needs_feature_norm

    def feature_layers(self, target: HeadTarget) -> tuple[int, ...]:
        if self.feature_layers_ == FUSED:
            return fused_layers(target.num_layers)
        return tuple(self.feature_layers_ or (target.num_layers + 1,))

    def prepare_on(self, target: HeadTarget, d: HeadData, head: EagleHead | None = None) -> Prepared:
        layers = self.feature_layers(target)
        if head is None:
            # published heads keep draft ids ascending, the order t2d-based readers of their d2t/t2d maps assume
            draft_ids = d.draft_ids if self.arch == "native" else d.draft_ids.sort().values
            norm = self.feature_norm
            if norm == AUTO:
                norm = self.arch == "native" and needs_feature_norm(next(d.data.batches(0)), len(layers))
            head = build_head(EagleConfig.for_target(target, layers, len(draft_ids), self.arch, norm), draft_ids)
            if self.arch == "eagle3":  # its own LM head starts as the target's, on the draft vocabulary
                with torch.no_grad():
                    head.lm_head.weight.copy_(d.lm_head[draft_ids])
        # auto keeps whatever an init= head was built with
        norm_setting = {} if self.feature_norm == AUTO else {"feature_norm": self.feature_norm}
        check_head(head, self.name, feature_layers=layers, arch=self.arch, **norm_setting)
        loss = EagleLoss(head, d.embedding, d.lm_head, self.loss_config)
        return Prepared(head, d.data.batches, loss, d.data.num_tokens(), len(d.data.sequences))

    def load(self, target: HeadTarget, directory: Path) -> EagleHead | PublishedEagleHead:
        return load_head(directory, target)

    def export(self, model: nn.Module, directory: Path, extra: dict) -> None:
        save_head(model, directory, extra)

    def drafter(self, target: HeadTarget, model: nn.Module, depth: int) -> EagleDrafter:
        return EagleDrafter(target, model, depth=depth)


def needs_feature_norm(batch: EagleBatch, num_layers: int) -> bool:
    """feature_norm=auto: whether some fused layer's median row RMS in ``batch`` is above
    FEATURE_SCALE_LIMIT. Fused raw, such states make the first steps of training shrink the fusion's
    weights instead of learning (docs/RESULTS.md, the Gemma EAGLE-3 head)."""
    rows = batch.features[batch.valid]  # [N, num_layers * H]
    rms = rows.unflatten(-1, (num_layers, -1)).pow(2).mean(-1).sqrt()  # [N, num_layers]
    return bool(rms.median(0).values.max() > FEATURE_SCALE_LIMIT)


@METHODS.register("eagle", online=True, needs="model")
@METHODS.register("eagle3", online=True, needs="model")
def eagle_method(name: str = "eagle", feature_layers: list[int] | str | None = None, unroll: int = 2,
                 step_decay: float = 0.8, regression_weight: float = 1.0, feature_noise: float = 0.1, draft_vocab: int = 8192,
                 arch: str = "native", feature_norm: bool | str = AUTO) -> EagleMethod:
    if arch not in ARCHS:
        raise ValueError(f"train.arch={arch!r}: choose one of {', '.join(ARCHS)}")
    if feature_norm not in (True, False, AUTO):
        raise ValueError(f"train.feature_norm={feature_norm!r}: choose true, false or {AUTO} (on for targets whose "
                         f"layers are far from unit scale)")
    if feature_norm is True and arch != "native":
        raise ValueError(f"train.feature_norm=true belongs to train.arch=native; arch={arch} normalises its features itself")
    if isinstance(feature_layers, str) and feature_layers != FUSED:
        raise ValueError(f"train.feature_layers={feature_layers!r}: give a list of layers, {FUSED} (low, middle and high "
                         f"blocks of the target: 2, L/2, L-3) or null (the final-norm output)")
    if arch == "eagle3" and not (feature_layers == FUSED or (feature_layers and len(feature_layers) == 3)):
        raise ValueError(f"train.arch=eagle3 fuses 3 target layers; set train.feature_layers to 3 layers or {FUSED} "
                         f"(got {feature_layers})")
    if arch == "eagle1" and feature_layers:
        raise ValueError("train.arch=eagle1 reads the target's final-norm output; leave train.feature_layers null")
    loss = EagleLossConfig(unroll, step_decay, regression_weight, feature_noise)
    layers = feature_layers if isinstance(feature_layers, str) else tuple(feature_layers) if feature_layers else None
    return EagleMethod(name, layers, loss, draft_vocab, arch, feature_norm)


# -- the head teacher-forced: what it predicts from true target features, as in training --------------


def head_logits(target: HeadTarget, drafter: EagleDrafter, sequence: list[int]) -> Tensor:  # [T-1, draft vocab]
    """The head's depth-1 logits over its draft vocabulary at every position of ``sequence``,
    teacher-forced on the target's true features: row t reads f_t and x_{t+1} and predicts x_{t+2}."""
    head = drafter.head
    tokens = torch.tensor(sequence)
    # a trailing dummy token makes prefill return the features of every real token
    hidden = target.prefill([torch.tensor(sequence + [0])], head.config.feature_layers).hidden
    features = torch.cat([h[:, : len(sequence)] for h in hidden], -1)  # [1, T, n*H]
    with torch.no_grad():
        out = head.forward_sequence(features[:, :-1], drafter.embed(tokens[1:])[None])[0]
        return drafter.draft_lm_head(out)


def teacher_forced_accuracy(target: HeadTarget, drafter: EagleDrafter, sequences: list[list[int]],
                            prompt_lengths: list[int]) -> tuple[float, int]:
    """Top-1 accuracy of the drafter's depth-1 prediction over the answer positions of each sequence,
    through the drafter's own embedding and draft-vocabulary LM head."""
    hits = total = 0
    for sequence, prompt_length in zip(sequences, prompt_lengths):
        tokens = torch.tensor(sequence)
        predicted = drafter.head.draft_ids[head_logits(target, drafter, sequence).argmax(-1)]  # [T-1], row t -> x_{t+2}
        # rows whose input token x_{t+1} is the target's own (the first answer token onwards)
        rows = torch.arange(prompt_length - 1, len(sequence) - 2)
        hits += int((predicted[rows] == tokens[rows + 2]).sum())
        total += len(rows)
    return hits / max(total, 1), total
