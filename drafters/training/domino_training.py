"""Training a DominoHead on cached target features.

Per sequence x_0..x_{T-1} with features f_t and labels y_t = the target's argmax after x_t (its own
choice of x_{t+1}): memory rows m_t = fuse(f_t, x_{t+1}) are computed once; every a = 1..T-1 is an
anchor (a root), whose block (m_{a-1}, masks) at positions a-1+j attends to m_{a-context}..m_{a-1}
and predicts y_{a+j} at position j. All blocks of a batch run as one batch of [k]-row blocks.

The refiner is teacher-forced: its prefix at position j is x_a..x_{a+j}, the tokens the label
y_{a+j} was computed after (on an accepted draft path those are exactly the target's own choices).

Loss = CE(refined logits) + w * CE(base logits), w decaying linearly from ``base_weight_start`` to
``base_weight_end`` over ``base_weight_steps`` steps (the base-anchored curriculum: early on the
backbone must predict every position by itself, so it does not leave the work to the refiner).
The CE runs on the reduced draft vocabulary (labels outside it are dropped and counted in
``label_coverage``), as for EAGLE heads.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from drafters.domino import DominoConfig, DominoDrafter, DominoHead, load_domino, save_domino
from drafters.training.data import EagleData, HeadData, draft_vocabulary, head_data
from drafters.training.features import FeatureCache
from drafters.training.methods import Prepared, check_head, register_method
from specdec.protocols import HeadTarget


@dataclass(frozen=True)
class DominoBatch:
    features: Tensor  # [B, T, n*H] float32, the head's input layers
    tokens: Tensor  # [B, T] int64
    labels: Tensor  # [B, T] int64, target's argmax after token t, -1 on padding
    valid: Tensor  # [B, T] bool
    step: int  # optimizer step this batch is for (drives the curriculum; survives a resume)


@dataclass(frozen=True)
class Curriculum:
    base_weight_start: float = 1.0
    base_weight_end: float = 0.1
    base_weight_steps: int = 600

    def base_weight(self, step: int) -> float:
        progress = min(step / max(self.base_weight_steps, 1), 1.0)
        return self.base_weight_start + (self.base_weight_end - self.base_weight_start) * progress


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def domino_batches(data: EagleData, index: int) -> Iterator[DominoBatch]:
    """Batch ``index`` on: under torchrun process r of W takes batches s * W + r at step s."""
    world = _world_size()
    for i, batch in enumerate(data.batches(index)):
        yield DominoBatch(batch.features, batch.tokens, batch.labels, batch.valid, (index + i) // world)


class DominoLoss:
    def __init__(self, head: DominoHead, embedding: Tensor, lm_head: Tensor, curriculum: Curriculum) -> None:
        self.head, self.embedding, self.curriculum = head, embedding, curriculum
        self.draft_lm_head, self.to_draft = draft_vocabulary(lm_head, head.draft_ids)

    def __call__(self, batch: DominoBatch) -> tuple[Tensor, dict[str, float]]:
        c = self.head.config
        b, t = batch.tokens.shape
        if t < 2:
            raise ValueError(f"training sequences need at least 2 tokens; this batch has {t}")
        k, window, a = c.block_size, c.context, t - 1  # a anchors: roots x_1..x_{T-1}
        device = batch.tokens.device
        embed = lambda tokens: F.embedding(tokens, self.embedding)
        rows = self.head.memory_rows(batch.features[:, : t - 1], embed(batch.tokens[:, 1:]))  # [B, T-1, H] m_0..m_{T-2}
        positions = torch.arange(t - 1, device=device).expand(b, -1)
        anchors = torch.arange(1, t, device=device)  # [A] root index of each block
        # anchor a attends to m_{a-window}..m_{a-1}: left-pad by `window` rows, slide a window over them
        memory = []
        for keys, values in self.head.memory(rows, positions):
            windows = [F.pad(x, (0, 0, window, 0)).unfold(2, window, 1)[:, :, 1:] for x in (keys, values)]
            # [B, heads, A, D, C] -> [B * A, heads, C, D]
            memory.append(tuple(w.permute(0, 2, 1, 4, 3).reshape(b * a, w.shape[1], window, w.shape[3]) for w in windows))
        visible = (anchors[:, None] - window + torch.arange(window, device=device)) >= 0  # [A, C]
        visible = visible.expand(b, -1, -1).reshape(b * a, window)
        block_positions = (anchors - 1)[:, None] + torch.arange(k, device=device)  # [A, K]
        block_positions = block_positions.expand(b, -1, -1).reshape(b * a, k)
        out = self.head.backbone(rows.reshape(b * a, -1), block_positions, memory, visible)  # [B*A, K, H]
        base = out @ self.draft_lm_head.T  # [B*A, K, Kd]

        target_index = (anchors[:, None] + torch.arange(k, device=device)).clamp(max=t - 1)  # [A, K] a+j
        in_sequence = (anchors[:, None] + torch.arange(k, device=device)) < t
        gather = lambda x: x[:, target_index].reshape(b * a, k)
        labels = self.to_draft[gather(batch.labels).clamp(min=0)]  # [B*A, K] draft-vocabulary index
        in_data = gather(batch.valid) & in_sequence.expand(b, -1, -1).reshape(b * a, k)
        valid = in_data & (labels >= 0)
        prefix = embed(gather(batch.tokens))  # [B*A, K, H] x_{a+j}, read at position j
        state = torch.zeros(b * a, c.gru_size, device=device)
        corrections = []
        for j in range(k):
            state, correction = self.head.refine(out[:, j], prefix[:, j], state)
            corrections.append(correction)
        refined = base + torch.stack(corrections, 1)

        weight = self.curriculum.base_weight(batch.step)
        ce_refined = F.cross_entropy(refined[valid], labels[valid]) if valid.any() else refined.sum() * 0
        ce_base = F.cross_entropy(base[valid], labels[valid]) if valid.any() else base.sum() * 0
        metrics = {"ce_refined": ce_refined.item(), "ce_base": ce_base.item(), "base_weight": weight}
        correct = refined.argmax(-1) == labels
        for j in range(k):
            column = valid[:, j]
            metrics[f"accuracy_{j}"] = float(correct[column, j].float().mean()) if column.any() else 0.0
        base_correct = base.argmax(-1) == labels
        metrics["base_accuracy"] = float(base_correct[valid].float().mean()) if valid.any() else 0.0
        # a block whose every position is right (teacher-forced): what a full-block acceptance needs
        full = (correct | ~in_sequence.expand(b, -1, -1).reshape(b * a, k)) & in_data[:, :1]
        metrics["block_accuracy"] = float(full.all(1)[in_data[:, 0]].float().mean()) if in_data[:, 0].any() else 0.0
        metrics["label_coverage"] = float((labels >= 0)[in_data].float().mean()) if in_data.any() else 0.0
        return ce_refined + weight * ce_base, metrics


@dataclass(frozen=True)
class DominoMethod:
    name: str = "domino"
    feature_layers_: tuple[int, ...] | None = None  # null: the final-norm output
    draft_vocab: int = 8192
    sizes: tuple[tuple[str, int], ...] = ()  # DominoConfig sizes: block_size, context, num_layers, ...
    curriculum: Curriculum = Curriculum()

    def feature_layers(self, target: HeadTarget) -> tuple[int, ...]:
        return tuple(self.feature_layers_ or (target.num_layers + 1,))

    def prepare(self, target: HeadTarget, cache: FeatureCache, batch_size: int, seed: int, shards: list[int],
                head: DominoHead | None = None) -> Prepared:
        d = head_data(target, cache, self.feature_layers(target), batch_size, seed, shards, self.draft_vocab)
        return self.prepare_on(target, d, head)

    def prepare_on(self, target: HeadTarget, d: HeadData, head: DominoHead | None = None) -> Prepared:
        """As prepare, on the batches and draft vocabulary in ``d``: cached features (head_data) or
        features the target computes as training runs (drafters.training.online)."""
        layers = self.feature_layers(target)
        if head is None:
            head = DominoHead(DominoConfig.for_target(target, layers, len(d.draft_ids), **dict(self.sizes)), d.draft_ids)
        check_head(head, self.name, feature_layers=layers, **dict(self.sizes))
        loss = DominoLoss(head, d.embedding, d.lm_head, self.curriculum)
        return Prepared(head, lambda index: domino_batches(d.data, index), loss, d.data.num_tokens(), len(d.data.sequences))

    def load(self, target: HeadTarget, directory: Path) -> DominoHead:
        return load_domino(directory, target)

    def export(self, model: nn.Module, directory: Path, extra: dict) -> None:
        save_domino(model, directory, extra)

    def drafter(self, target: HeadTarget, model: nn.Module, depth: int) -> DominoDrafter:
        # eval.depth is shared by every method (default 4); a block cannot draft past its own size
        return DominoDrafter(target, model, depth=min(depth, model.config.block_size))


@register_method("domino")
def domino_method(name: str = "domino", feature_layers: list[int] | None = None, draft_vocab: int = 8192,
                  block_size: int = 3, context: int = 16, num_layers: int = 1, gru_size: int = 256, rank: int = 64,
                  intermediate_size: int | None = None, base_weight_start: float = 1.0, base_weight_end: float = 0.1,
                  base_weight_steps: int = 600) -> DominoMethod:
    sizes = dict(block_size=block_size, context=context, num_layers=num_layers, gru_size=gru_size, rank=rank)
    if intermediate_size is not None:
        sizes["intermediate_size"] = intermediate_size
    curriculum = Curriculum(base_weight_start, base_weight_end, base_weight_steps)
    return DominoMethod(name, tuple(feature_layers) if feature_layers else None, draft_vocab, tuple(sizes.items()), curriculum)
