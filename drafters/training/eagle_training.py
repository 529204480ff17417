"""Training an EagleHead on cached target features.

Per sequence x_0..x_{T-1} with features f_t: unroll step j = 0..U-1 feeds row t with
(input_j[t], embedding of x_{t+1+j}) and asks for the target's next-token choice after x_{t+1+j},
i.e. argmax(lm_head(f_{t+1+j})). input_0 is the true feature f_t; input_j (j > 0) is the head's own
step j-1 output at row t (training-time test: the head learns to read its own estimates, as it
must when it drafts several tokens). EAGLE-1 adds a SmoothL1 regression of the output onto the
final-norm feature it estimates.

The frozen 49152-way LM head dominates the cost on a CPU, so the head drafts from, and the
classification loss runs on, a reduced vocabulary: the ``draft_vocab`` most frequent target
choices in the training data (a label outside it is dropped from the CE term, and counted in
``label_coverage``).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from drafters.eagle import EagleConfig, EagleDrafter, EagleHead, load_head, save_head
from drafters.training.features import FeatureCache
from drafters.training.methods import Prepared, check_head, register_method


@dataclass(frozen=True)
class EagleLossConfig:
    unroll: int = 1  # training-time test steps (1 = EAGLE-1 teacher forcing only)
    step_decay: float = 0.8  # weight of unroll step j is step_decay ** j
    regression_weight: float = 1.0  # SmoothL1 onto the final-norm feature (0 for EAGLE-3)
    feature_noise: float = 0.1  # uniform noise on input features, relative to each row's RMS


@dataclass(frozen=True)
class EagleBatch:
    features: Tensor  # [B, T, n*H] float32, the head's input layers
    final: Tensor  # [B, T, H] float32, final-norm features (regression targets)
    tokens: Tensor  # [B, T] int64
    labels: Tensor  # [B, T] int64, target's argmax after token t, -1 on padding
    valid: Tensor  # [B, T] bool


class EagleData:
    """All sequences of a feature cache in memory (only the layers this head needs), with the
    target's argmax labels computed once; batches in a seeded order that depends only on the step."""

    def __init__(self, cache: FeatureCache, layers: tuple[int, ...], lm_head: Tensor, final_layer: int,
                 batch_size: int, seed: int = 0, shards: list[int] | None = None) -> None:
        self.batch_size, self.seed = batch_size, seed
        self.sequences = []
        needed = tuple(dict.fromkeys(layers + (final_layer,)))
        shards = list(shards) if shards is not None else list(range(len(cache.shards)))
        # the target's own next-token choices, in the order cache.sequences yields the rows
        choices = cache.target_choices(shards, lm_head, final_layer) if shards else None
        start = 0
        for seq in cache.sequences(needed, shards):
            labels = choices[start : start + len(seq.tokens)]  # [T]
            start += len(seq.tokens)
            self.sequences.append((seq.tokens, torch.cat([seq.features[k] for k in layers], -1), seq.features[final_layer], labels))
        if not self.sequences:
            raise ValueError(f"the feature cache at {cache.directory} has no sequences to train on")
        self.batches_per_epoch = max(1, len(self.sequences) // batch_size)

    def label_counts(self, vocab_size: int) -> Tensor:  # [V] how often each token is the target's choice
        return torch.bincount(torch.cat([labels for *_, labels in self.sequences]), minlength=vocab_size)

    def num_tokens(self) -> int:
        return sum(len(tokens) for tokens, *_ in self.sequences)

    def batches(self, step: int) -> Iterator[EagleBatch]:
        while True:
            epoch, index = divmod(step, self.batches_per_epoch)
            order = list(range(len(self.sequences)))
            random.Random(self.seed + epoch).shuffle(order)
            chosen = order[index * self.batch_size : (index + 1) * self.batch_size]
            yield self._collate([self.sequences[i] for i in chosen])
            step += 1

    @staticmethod
    def _collate(group) -> EagleBatch:
        width = max(len(tokens) for tokens, *_ in group)
        b = len(group)
        n_h, h = group[0][1].shape[-1], group[0][2].shape[-1]
        features = torch.zeros(b, width, n_h)
        final = torch.zeros(b, width, h)
        tokens = torch.zeros(b, width, dtype=torch.int64)
        labels = torch.full((b, width), -1, dtype=torch.int64)
        for i, (t, f, fin, lab) in enumerate(group):
            n = len(t)
            features[i, :n], final[i, :n], tokens[i, :n], labels[i, :n] = f.float(), fin.float(), t, lab
        return EagleBatch(features, final, tokens, labels, labels >= 0)


def select_draft_vocab(label_counts: Tensor, size: int) -> Tensor:  # [V] -> [K] token ids
    """The ``size`` most frequent target choices (fewer if fewer ever occur), most frequent first."""
    return label_counts.topk(min(size, int((label_counts > 0).sum()))).indices


@dataclass(frozen=True)
class HeadData:
    """What every head trained on cached features starts from."""

    embedding: Tensor  # [V, H] the target's input embeddings (frozen)
    lm_head: Tensor  # [V, H] the target's LM head (frozen)
    data: EagleData  # features of ``layers`` and the target's choices, batched
    draft_ids: Tensor  # [K] the draft vocabulary: the most frequent choices in data


def head_data(target, cache: FeatureCache, layers: tuple[int, ...], batch_size: int, seed: int,
              shards: list[int], draft_vocab: int) -> HeadData:
    lm_head = target.model.get_output_embeddings().weight.detach()
    data = EagleData(cache, layers, lm_head, target.num_layers + 1, batch_size, seed, shards)
    draft_ids = select_draft_vocab(data.label_counts(target.vocab_size), draft_vocab)
    return HeadData(target.model.get_input_embeddings().weight.detach(), lm_head, data, draft_ids)


def draft_vocabulary(lm_head: Tensor, draft_ids: Tensor) -> tuple[Tensor, Tensor]:
    """The frozen LM head's rows for the draft tokens [K, H], and target id -> draft index [V]
    (-1 outside the draft vocabulary: such labels drop out of the CE, counted in label_coverage)."""
    to_draft = torch.full((lm_head.shape[0],), -1, dtype=torch.int64)
    to_draft[draft_ids] = torch.arange(len(draft_ids))
    return lm_head[draft_ids], to_draft


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

    def feature_layers(self, target) -> tuple[int, ...]:
        return tuple(self.feature_layers_ or (target.num_layers + 1,))

    def prepare(self, target, cache: FeatureCache, batch_size: int, seed: int, shards: list[int],
                head: EagleHead | None = None) -> Prepared:
        layers = self.feature_layers(target)
        d = head_data(target, cache, layers, batch_size, seed, shards, self.draft_vocab)
        if head is None:
            head = EagleHead(EagleConfig.for_target(target, layers, len(d.draft_ids)), d.draft_ids)
        check_head(head, self.name, feature_layers=layers)
        loss = EagleLoss(head, d.embedding, d.lm_head, self.loss_config)
        return Prepared(head, d.data.batches, loss, d.data.num_tokens(), len(d.data.sequences))

    def load(self, target, directory: Path) -> EagleHead:
        return load_head(directory, target)

    def export(self, model: nn.Module, directory: Path, extra: dict) -> None:
        save_head(model, directory, extra)

    def drafter(self, target, model: nn.Module, depth: int) -> EagleDrafter:
        return EagleDrafter(target, model, depth=depth)


@register_method("eagle", "eagle3")
def eagle_method(name: str = "eagle", feature_layers: list[int] | None = None, unroll: int = 2, step_decay: float = 0.8,
                 regression_weight: float = 1.0, feature_noise: float = 0.1, draft_vocab: int = 8192) -> EagleMethod:
    loss = EagleLossConfig(unroll, step_decay, regression_weight, feature_noise)
    return EagleMethod(name, tuple(feature_layers) if feature_layers else None, loss, draft_vocab)
