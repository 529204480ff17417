"""Training Medusa-1 heads on cached target features (the target stays frozen).

Per sequence with final-norm features f_t and the target's own next-token choices c_t =
argmax(lm_head(f_t)) (the label of x_{t+1}), head k at row t is trained to predict c_{t+1+k}, the
target's choice k + 1 tokens after the root, with cross-entropy on the reduced draft vocabulary;
head k's loss is weighted head_decay ** k (later heads are less accurate and matter less, since
a deep node is only reached through its ancestors). Labels outside the draft vocabulary are dropped
from the loss (counted in ``label_coverage``).

The last shard of the cache is held out from training: after training, :meth:`MedusaMethod.export`
measures on it how often each head's rank-r candidate is the target's choice and stores those
accuracies and the static tree built from them (drafters.medusa.build_tree) in the checkpoint.

Medusa-2 (fine-tuning the target jointly with the heads, with self-distillation) is
drafters/training/medusa2_training.py: it changes the target, so it exports the fine-tuned target too.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from drafters.medusa import (
    MedusaConfig,
    MedusaDrafter,
    MedusaHeads,
    build_tree,
    expected_accepted,
    load_heads,
    save_heads,
    with_tree,
)
from drafters.training.data import EagleBatch, EagleData, draft_vocabulary, select_draft_vocab
from drafters.training.features import FeatureCache
from drafters.training.methods import METHODS, HeadMethod, Prepared, check_head
from specdec.protocols import HeadTarget


class MedusaLoss:
    def __init__(self, heads: MedusaHeads, lm_head: Tensor, head_decay: float) -> None:
        self.heads, self.head_decay = heads, head_decay
        self.draft_lm_head, self.to_draft = draft_vocabulary(lm_head, heads.draft_ids)

    def __call__(self, batch: EagleBatch) -> tuple[Tensor, dict[str, float]]:
        t = batch.tokens.shape[1]
        total = torch.zeros(())
        metrics: dict[str, float] = {}
        out_all = self.heads(batch.final[:, : t - 1])  # [B, T-1, K, H]
        for k in range(self.heads.config.num_heads):
            rows = t - 1 - k
            if rows <= 0:
                break
            labels = self.to_draft[batch.labels[:, 1 + k :].clamp(min=0)]  # [B, rows] c_{t+1+k}
            valid = batch.valid[:, 1 + k :] & (labels >= 0)  # [B, rows]
            # only rows with a label: the vocabulary product dominates the cost
            out = out_all[:, :rows, k][valid]  # [M, H]
            logits = out @ self.draft_lm_head.T  # [M, D]
            ce = F.cross_entropy(logits, labels[valid]) if valid.any() else self.heads.bias.sum() * 0
            total = total + self.head_decay**k * ce
            metrics[f"ce_{k}"] = float(ce.detach())
            metrics[f"accuracy_{k}"] = float((logits.argmax(-1) == labels[valid]).float().mean()) if valid.any() else 0.0
        metrics["label_coverage"] = float((self.to_draft[batch.labels.clamp(min=0)] >= 0)[batch.valid].float().mean())
        return total, metrics


@torch.no_grad()
def measure_accuracies(heads: MedusaHeads, lm_head: Tensor, data: EagleData, top_k: int) -> list[list[float]]:
    """accuracies[k][r] = fraction of held-out rows where head k's rank-r candidate is the target's
    choice (a label outside the draft vocabulary counts as a miss for every rank)."""
    num_heads = heads.config.num_heads
    draft_lm_head = lm_head[heads.draft_ids].to(heads.bias.dtype)
    hits = torch.zeros(num_heads, top_k, dtype=torch.float64)
    counts = torch.zeros(num_heads, dtype=torch.float64)
    for _, _, final, labels in data.sequences:
        t = len(labels)
        logits = heads(final.to(heads.bias.dtype)) @ draft_lm_head.T  # [T, K, D]
        candidates = heads.draft_ids[logits.topk(top_k, -1).indices]  # [T, K, top_k] target ids
        for k in range(min(num_heads, t - 1)):
            target_choice = labels[1 + k :]  # [t-1-k] c_{t+1+k}
            hits[k] += (candidates[: t - 1 - k, k] == target_choice[:, None]).double().sum(0)
            counts[k] += t - 1 - k
    if bool((counts == 0).any()):
        raise ValueError(f"the held-out sequences are too short to measure all {num_heads} heads")
    return (hits / counts[:, None]).tolist()


class MedusaMethod(HeadMethod):
    """Medusa-1: K residual heads on the final-norm feature. Not a frozen dataclass: ``prepare``
    keeps the held-out shard for ``export`` to measure the tree on."""

    name = "medusa"

    def __init__(self, num_heads: int, head_decay: float, draft_vocab: int, tree_top_k: int, total_tokens: int) -> None:
        if num_heads < 1 or tree_top_k < 1 or total_tokens < 1:
            raise ValueError(f"num_heads, tree_top_k and total_tokens must be >= 1; got {num_heads}, {tree_top_k}, {total_tokens}")
        self.num_heads, self.head_decay, self.draft_vocab = num_heads, head_decay, draft_vocab
        self.tree_top_k, self.total_tokens = tree_top_k, total_tokens
        self.held_out: EagleData | None = None
        self.lm_head: Tensor | None = None

    def feature_layers(self, target: HeadTarget) -> tuple[int, ...]:
        return (target.num_layers + 1,)

    def prepare(self, target: HeadTarget, cache: FeatureCache, batch_size: int, seed: int, shards: list[int],
                head: MedusaHeads | None = None) -> Prepared:
        if len(shards) < 2:
            raise ValueError(
                f"Medusa training holds the last shard out to measure the heads' accuracies, so it needs >= 2 "
                f"shards; the cache at {cache.directory} offers {len(shards)} (extract more, or raise data.shards)"
            )
        lm_head = target.model.get_output_embeddings().weight.detach().float()
        final = target.num_layers + 1
        data = EagleData(cache, (final,), lm_head, final, batch_size, seed, shards[:-1])
        self.held_out = EagleData(cache, (final,), lm_head, final, 1, seed, shards[-1:])
        self.lm_head = lm_head
        if head is None:
            draft_ids = select_draft_vocab(data.label_counts(target.vocab_size), self.draft_vocab)
            head = MedusaHeads(MedusaConfig.for_target(target, self.num_heads, len(draft_ids)), draft_ids)
        check_head(head, self.name, num_heads=self.num_heads)
        if len(head.draft_ids) < self.tree_top_k:
            raise ValueError(f"tree_top_k={self.tree_top_k} exceeds the {len(head.draft_ids)} tokens the heads can draft")
        return Prepared(head, data.batches, MedusaLoss(head, lm_head, self.head_decay), data.num_tokens(), len(data.sequences))

    def load(self, target: HeadTarget, directory: Path) -> MedusaHeads:
        heads = load_heads(directory, target)
        # the loss and the accuracies apply the target's LM head after one block per head: a head
        # of the published shape would train as another function without a word
        if heads.config.own_lm_heads or heads.config.num_layers != 1:
            config = heads.config
            raise ValueError(f"{directory} holds Medusa heads of the published shape ({config.num_layers} blocks per "
                             f"head, own LM heads: {config.own_lm_heads}); training continues only heads of one block "
                             "on the target's LM head")
        return heads

    def export(self, model: nn.Module, directory: Path, extra: dict) -> None:
        """Measure the accuracies on the held-out shard (in float32), build the tree, save."""
        if self.held_out is None:
            raise RuntimeError("export needs the held-out data that prepare() loads; call prepare first")
        accuracies = measure_accuracies(copy.deepcopy(model).float().eval(), self.lm_head, self.held_out, self.tree_top_k)
        tree = build_tree(accuracies, self.total_tokens)
        with_tree(model, accuracies, tree)
        measured = {"held_out_tokens": self.held_out.num_tokens(), "expected_accepted": expected_accepted(accuracies, tree)}
        save_heads(model, directory, {**extra, "tree_measurement": measured})

    def drafter(self, target: HeadTarget, model: nn.Module, depth: int) -> MedusaDrafter:
        return MedusaDrafter(target, model, [p for p in model.config.tree if len(p) <= depth])


# cached features only: it holds the cache's last shard out to measure its tree on
@METHODS.register("medusa", needs="model")
def medusa_method(num_heads: int = 4, head_decay: float = 0.8, draft_vocab: int = 8192, tree_top_k: int = 8,
                  total_tokens: int = 16) -> MedusaMethod:
    return MedusaMethod(num_heads, head_decay, draft_vocab, tree_top_k, total_tokens)
