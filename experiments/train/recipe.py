"""The one training recipe: setup -> train -> cleanup, for any registered method, on either feature
source (cached or online) and on the device the target computes on.

``TrainRecipe`` is what every training runs through: specdec-train (experiments.train.command, Hydra
settings), one method or, with schedule=NAME, several on shares of one time budget. Nothing here
imports Hydra.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from drafters.training.features import FeatureCache
from drafters.training.methods import HeadMethod, Prepared, check_feature_source
from drafters.training.online import OnlineData, TokenSequences, choice_vocabulary, online_head_data
from drafters.training.trainer import TrainConfig, train
from specdec.target import HFTarget


@dataclass(frozen=True)
class CachedFeatures:
    """features=cached: the shards of a feature cache, ``batch_size`` sequences per batch."""

    cache: FeatureCache
    batch_size: int
    seed: int
    shards: list[int]
    source: str = "cached"

    def prepare(self, method: HeadMethod, target: HFTarget, head: nn.Module | None) -> Prepared:
        return method.prepare(target, self.cache, self.batch_size, self.seed, self.shards, head)

    def tokens_per_step(self, prepared: Prepared, world: int) -> float:
        return self.batch_size * world * prepared.num_tokens / prepared.num_sequences


@dataclass(frozen=True)
class OnlineFeatures:
    """features=online: batches of about ``data``'s batch tokens, their features computed by the
    target; the draft vocabulary its most frequent choices (choice_vocabulary), or on a resume the
    one the checkpoint's head holds."""

    data: OnlineData
    draft_ids: torch.Tensor  # [K] token ids
    source: str = "online"

    @classmethod
    def of(cls, method: HeadMethod, target: HFTarget, sequences: TokenSequences, batch_tokens: int, seed: int,
           label_tokens: int, head: nn.Module | None, resumed_ids: torch.Tensor | None = None) -> OnlineFeatures:
        """``resumed_ids`` [K]: the draft vocabulary of the checkpoint a run resumes from (the same
        choices counted on the same data, without a pass of the target over it)."""
        data = OnlineData(target, sequences, method.feature_layers(target), batch_tokens, seed)
        if not method.counts_choices(head):  # nothing reads a counted vocabulary: the whole one, uncounted
            return cls(data, torch.arange(target.vocab_size))
        if resumed_ids is not None:
            return cls(data, resumed_ids)
        probe = OnlineData(target, sequences, (target.num_layers + 1,), batch_tokens, seed)
        return cls(data, choice_vocabulary(probe, method.draft_vocab_size(target), label_tokens))

    def prepare(self, method: HeadMethod, target: HFTarget, head: nn.Module | None) -> Prepared:
        return method.prepare_on(target, online_head_data(self.data, self.draft_ids), head)

    def tokens_per_step(self, prepared: Prepared, world: int) -> float:
        return world * prepared.num_tokens / len(self.data.groups)


Features = CachedFeatures | OnlineFeatures


class Counted:
    """A method's batches, counting the positions through the target and the labelled ones."""

    def __init__(self, batches) -> None:
        self.batches, self.positions, self.labels = batches, 0, 0

    def __call__(self, step: int):
        for batch in self.batches(step):
            self.positions += batch.tokens.numel()
            self.labels += int(batch.valid.sum())
            yield batch


class TrainRecipe:
    """One method trained on one target into ``run_dir`` (checkpoints; a run dir that holds one resumes)."""

    def __init__(self, method: HeadMethod, target: HFTarget, run_dir: Path) -> None:
        self.method, self.target, self.run_dir = method, target, run_dir
        self.prepared: Prepared | None = None
        self.counted: Counted | None = None

    def setup(self, features: Features, head: nn.Module | None = None) -> Prepared:
        """The head (``head`` to train further, or a new one), its batches and loss on ``features``,
        refused in one line for a feature source the method did not declare."""
        check_feature_source(self.method.name, features.source)
        self.prepared = features.prepare(self.method, self.target, head)
        self.prepared.model.to(self.target.device)
        self.counted = Counted(self.prepared.batches)
        return self.prepared

    def loss(self, batch) -> tuple[torch.Tensor, dict[str, float]]:
        """The method's loss, under bf16 autocast on CUDA (the head's weights stay float32)."""
        device = self.target.device
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            return self.prepared.loss(batch)

    def train(self, loop: TrainConfig, log: Callable[[int, dict[str, float]], None],
              deadline: float | None = None) -> int:
        """loop.steps steps (or until ``deadline``, time.monotonic()), resuming from run_dir's checkpoint."""
        return train(self.prepared.model, self.counted, self.loss, loop, self.run_dir, log, deadline=deadline)

    def cleanup(self, output: Path, extra: dict) -> nn.Module:
        """Export the head in float16 (what its drafter loads); returns it in float32 for evaluation."""
        model = self.prepared.model
        self.method.export(model.to(torch.float16), output, extra)
        return model.float().eval()
