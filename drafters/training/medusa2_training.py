"""Medusa-2: Medusa heads trained jointly with the target's last decoder layers, with
self-distillation to the original target.

What trains. The heads (drafters.medusa.MedusaHeads, as in Medusa-1) and the target's last
``trainable_layers`` decoder layers plus its final norm; the embeddings, every earlier layer and the
LM head stay frozen. Whole layers rather than LoRA adapters: the fine-tuned target must be exported
as a plain Hugging Face folder that any HFTarget loads, and full layers need no adapter merge and no
new dependency; on SmolLM2 one layer is ~3.5M parameters, so a few layers are a small, cheap
fine-tune. The trained layers are the target's OWN modules: ``prepare`` fine-tunes ``target.model``
in place (so specdec-train's evaluation, which decodes with the target it passed in, decodes with
the fine-tuned target), and checkpoints hold only the heads and the trained layers.

Data and loss. Token sequences come from the feature cache's shards (the data flow of
specdec-train is unchanged) and run through the target online at every step, because the target
changes. Per sequence, with f'_t the fine-tuned target's final-norm feature, f_t the ORIGINAL
target's cached one and c_t = argmax(lm_head(f_t)) the original's cached next-token choice:
  loss = sum_k head_decay**k * CE(head k on f'_t, c_{t+1+k})            (Medusa-1's heads loss)
       + distill_weight * mean_t KL(softmax(lm_head f_t) || softmax(lm_head f'_t))
The KL term (self-distillation) keeps the fine-tuned target's next-token distribution on the
original's; the original's logits come from the cached features and the frozen LM head, so no second
copy of the target is needed. One learning rate serves heads and layers (the trainer's one AdamW).

Exactness, honestly. Speculative decoding with these heads is exact (greedy output equals plain
greedy decoding; sampled output follows the target's distribution) with respect to the FINE-TUNED
target, not the original one: the fine-tuned target is a different model. How far it moved must be
reported with every Medusa-2 result: :func:`measure_divergence` gives the mean KL(original ||
fine-tuned) per token and the top-1 agreement of the two on the held-out (last) shard, and
``export`` records both, next to the same figures for the untouched target (the floor that the
float16 feature cache alone causes), in the checkpoint's config and beside the exported target.

Export. ``<output>`` holds the heads (drafters.medusa format, with the static tree built from the
heads' top-k accuracies measured on the held-out shard against the FINE-TUNED target's choices, as
the fine-tuned target is the verifier) and ``<output>/target`` the fine-tuned target (save_pretrained,
plus the tokenizer of the folder the target was loaded from, when it has one). Decode with:
    specdec-run target=hf target.path=<output>/target drafter=medusa drafter.checkpoint=<output>
The exported target is the whole model in its dtype (~540 MB for SmolLM2 in float32), so unlike the
heads it cannot be a bundled checkpoint in the repository.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from drafters.medusa import (
    TARGET_FOLDER,
    MedusaConfig,
    MedusaDrafter,
    MedusaHeads,
    build_tree,
    expected_accepted,
    save_heads,
    with_tree,
)
from drafters.training.data import EagleBatch, EagleData, select_draft_vocab
from drafters.training.features import FeatureCache
from drafters.training.medusa_training import MedusaLoss, measure_accuracies
from drafters.training.methods import METHODS, HeadMethod, Prepared
from specdec.files import replace_folder
from specdec.protocols import HeadTarget
from specdec.target import decoder_layers, final_norm

REPORT_FILE = "medusa2.json"  # beside the exported target: what it was fine-tuned from, and how far it moved


class Medusa2Model(nn.Module):
    """What the trainer optimises and checkpoints: the heads and the target's own last decoder layers
    and final norm (the same module objects as inside the target). The frozen rest of the target is
    not registered here, so a checkpoint holds only what training changes."""

    def __init__(self, heads: MedusaHeads, layers: list[nn.Module], norm: nn.Module) -> None:
        super().__init__()
        self.heads = heads
        self.layers = nn.ModuleList(layers)
        self.norm = norm


def fine_tuned_features(model, tokens: Tensor) -> Tensor:  # [B, T] int64 -> [B, T, H]
    """The causal LM's final-norm features of right-padded sequences (causal attention: padding at
    the end never reaches a real row). Gradients flow only where parameters require them."""
    return model.base_model(input_ids=tokens, use_cache=False).last_hidden_state


@dataclass(frozen=True)
class Divergence:
    kl: float  # mean over held-out tokens of KL(original || fine-tuned next-token distribution), nats
    top1_agreement: float  # fraction of held-out tokens where the two targets' argmax choices agree
    tokens: int


@dataclass(frozen=True)
class _HeldOutRows:
    """The part of an EagleData that measure_accuracies reads, here with the FINE-TUNED target's
    features and choices."""

    sequences: list[tuple[Tensor, Tensor, Tensor, Tensor]]  # (tokens [T], features [T, H], final [T, H], labels [T])


@torch.no_grad()
def _held_out_pass(model, lm_head: Tensor, data: EagleData) -> tuple[Divergence, _HeldOutRows]:
    """One pass of ``model`` over the held-out sequences: its divergence from the original target
    (cached features and choices) and its own final-norm features and choices."""
    kl, agreements, count, rows = 0.0, 0, 0, []
    for tokens, _, original_final, original_choices in data.sequences:
        final = fine_tuned_features(model, tokens[None])[0].float()  # [T, H]
        log_q = F.log_softmax(final @ lm_head.T, -1)  # [T, V] fine-tuned
        log_p = F.log_softmax(original_final.float() @ lm_head.T, -1)  # [T, V] original
        choices = log_q.argmax(-1)  # [T]
        kl += float((log_p.exp() * (log_p - log_q)).sum())
        agreements += int((choices == original_choices).sum())
        count += len(tokens)
        rows.append((tokens, final, final, choices))
    # a KL summed in float32 can come out a hair below zero when the two agree
    return Divergence(max(kl / count, 0.0), agreements / count, count), _HeldOutRows(rows)


def measure_divergence(model, lm_head: Tensor, data: EagleData) -> Divergence:
    """Mean KL(original || fine-tuned) per token and top-1 agreement between the original target
    (its cached final-norm features and choices in ``data``) and ``model`` run on the same tokens."""
    return _held_out_pass(model, lm_head, data)[0]


class Medusa2Loss:
    def __init__(self, target_model, heads: MedusaHeads, lm_head: Tensor, head_decay: float, distill_weight: float) -> None:
        self.target_model, self.lm_head, self.distill_weight = target_model, lm_head, distill_weight
        self.heads_loss = MedusaLoss(heads, lm_head, head_decay)

    def __call__(self, batch: EagleBatch) -> tuple[Tensor, dict[str, float]]:
        final = fine_tuned_features(self.target_model, batch.tokens)  # [B, T, H] f'_t, through the trained layers
        # the heads read the fine-tuned features (what they see when drafting) but learn the original's choices
        heads_loss, metrics = self.heads_loss(EagleBatch(final, final, batch.tokens, batch.labels, batch.valid))
        log_q = F.log_softmax(final[batch.valid] @ self.lm_head.T, -1)  # [M, V] fine-tuned
        with torch.no_grad():
            log_p = F.log_softmax(batch.final[batch.valid] @ self.lm_head.T, -1)  # [M, V] original
        kl = F.kl_div(log_q, log_p, reduction="batchmean", log_target=True)
        metrics.update(heads_loss=float(heads_loss.detach()), kl=float(kl.detach()),
                       top1_agreement=float((log_q.argmax(-1) == batch.labels[batch.valid]).float().mean()))
        return heads_loss + self.distill_weight * kl, metrics


class Medusa2Method(HeadMethod):
    """Medusa-2 (see the module docstring). Not a frozen dataclass: ``prepare`` keeps the target it
    fine-tunes and the held-out shard for ``export``."""

    name = "medusa2"

    def __init__(self, num_heads: int, head_decay: float, draft_vocab: int, tree_top_k: int, total_tokens: int,
                 trainable_layers: int, distill_weight: float) -> None:
        if num_heads < 1 or tree_top_k < 1 or total_tokens < 1 or trainable_layers < 1:
            raise ValueError(
                f"num_heads, tree_top_k, total_tokens and trainable_layers must be >= 1; got {num_heads}, "
                f"{tree_top_k}, {total_tokens}, {trainable_layers}"
            )
        if distill_weight < 0:
            raise ValueError(f"distill_weight must be >= 0 (0 lets the target drift freely); got {distill_weight}")
        self.num_heads, self.head_decay, self.draft_vocab = num_heads, head_decay, draft_vocab
        self.tree_top_k, self.total_tokens = tree_top_k, total_tokens
        self.trainable_layers, self.distill_weight = trainable_layers, distill_weight
        self.target: HeadTarget | None = None  # the target prepare fine-tunes
        self.held_out: EagleData | None = None
        self.lm_head: Tensor | None = None
        self.floor: Divergence | None = None

    def feature_layers(self, target: HeadTarget) -> tuple[int, ...]:
        return (target.num_layers + 1,)

    def load(self, target: HeadTarget, directory: Path) -> nn.Module:
        raise ValueError(
            "train=medusa2 cannot continue from an exported checkpoint: its export pairs the heads with a "
            "fine-tuned target, and the run fine-tunes the target it loads; continue a killed run with "
            "resume=latest or resume=<its run dir> instead"
        )

    def prepare(self, target: HeadTarget, cache: FeatureCache, batch_size: int, seed: int, shards: list[int],
                head: None = None) -> Prepared:
        """Freezes ``target.model`` except its last ``trainable_layers`` layers and final norm, which
        the returned model trains IN PLACE: from here on ``target`` is the target being fine-tuned."""
        if len(shards) < 2:
            raise ValueError(
                f"Medusa-2 training holds the last shard out to measure the heads and the target's divergence, so it "
                f"needs >= 2 shards; the cache at {cache.directory} offers {len(shards)} (extract more, or raise data.shards)"
            )
        layers = decoder_layers(target.model)
        if self.trainable_layers > len(layers):
            raise ValueError(f"trainable_layers={self.trainable_layers} exceeds the target's {len(layers)} decoder layers")
        lm_head = target.model.get_output_embeddings().weight.detach().float()
        final = target.num_layers + 1
        data = EagleData(cache, (final,), lm_head, final, batch_size, seed, shards[:-1])
        self.held_out = EagleData(cache, (final,), lm_head, final, 1, seed, shards[-1:])
        self.target, self.lm_head = target, lm_head
        # before any change: how far the untouched target already is from its float16 cache
        self.floor = measure_divergence(target.model, lm_head, self.held_out)
        draft_ids = select_draft_vocab(data.label_counts(target.vocab_size), self.draft_vocab)
        if len(draft_ids) < self.tree_top_k:
            raise ValueError(f"tree_top_k={self.tree_top_k} exceeds the {len(draft_ids)} tokens the heads can draft")
        heads = MedusaHeads(MedusaConfig.for_target(target, self.num_heads, len(draft_ids)), draft_ids)
        model = Medusa2Model(heads, list(layers[len(layers) - self.trainable_layers :]), final_norm(target.model))
        target.model.requires_grad_(False)
        model.requires_grad_(True)  # the heads and the target's own last layers and final norm
        loss = Medusa2Loss(target.model, heads, lm_head, self.head_decay, self.distill_weight)
        return Prepared(model, data.batches, loss, data.num_tokens(), len(data.sequences))

    def export(self, model: Medusa2Model, directory: Path, extra: dict) -> None:
        """Measure the fine-tuned target's divergence and the heads' accuracies on the held-out
        shard, build the tree, and write the heads into ``directory`` and the fine-tuned target into
        ``directory/target``, both at once (one folder renamed into place)."""
        if self.held_out is None:
            raise RuntimeError("export needs the target and held-out data that prepare() loads; call prepare first")
        # specdec-train hands the model over in float16; the trained layers must share the rest of
        # the target's dtype, and the exported target is then exactly the one evaluated afterwards
        model.layers.to(self.target.dtype)
        model.norm.to(self.target.dtype)
        self.target.model.eval()
        divergence, rows = _held_out_pass(self.target.model, self.lm_head, self.held_out)
        accuracies = measure_accuracies(copy.deepcopy(model.heads).float().eval(), self.lm_head, rows, self.tree_top_k)
        tree = build_tree(accuracies, self.total_tokens)
        with_tree(model.heads, accuracies, tree)
        report = {
            "exact_with_respect_to": "the fine-tuned target in target/ (NOT the original target)",
            "fine_tuned_from": str(self.target.model.name_or_path or type(self.target.model).__name__),
            "trainable_layers": self.trainable_layers,
            "distill_weight": self.distill_weight,
            "divergence_from_original": asdict(divergence),
            "divergence_floor_untouched_target": asdict(self.floor),
        }
        measured = {"held_out_tokens": self.held_out.num_tokens(), "expected_accepted": expected_accepted(accuracies, tree)}
        _write_export(self.target.model, model.heads, Path(directory),
                      {**extra, "tree_measurement": measured, "medusa2": report}, report)

    def drafter(self, target: HeadTarget, model: Medusa2Model, depth: int) -> MedusaDrafter:
        if decoder_layers(target.model)[-1] is not model.layers[-1]:
            raise ValueError(
                "Medusa-2 heads draft for the fine-tuned target: evaluate them with the target this method "
                f"fine-tuned (the one given to prepare), or load the exported {TARGET_FOLDER}/ folder with its heads"
            )
        return MedusaDrafter(target, model.heads, [p for p in model.heads.config.tree if len(p) <= depth])


def _write_export(target_model, heads: MedusaHeads, directory: Path, config_extra: dict, report: dict) -> None:
    """Heads at ``directory``, the fine-tuned target (and tokenizer, when the folder it was loaded
    from has one) at ``directory/target``, swapped in together (specdec.files.replace_folder), so a
    reader never sees heads without their target."""

    def write(staged: Path) -> None:
        save_heads(heads, staged, config_extra)
        target_dir = staged / TARGET_FOLDER
        target_model.save_pretrained(target_dir)
        source = Path(target_model.name_or_path) if target_model.name_or_path else None
        if source is not None and (source / "tokenizer_config.json").exists():
            from transformers import AutoTokenizer  # transformers' auto classes: ~0.4 s more, for this copy alone

            AutoTokenizer.from_pretrained(source).save_pretrained(target_dir)
        (target_dir / REPORT_FILE).write_text(json.dumps(report, indent=2))

    replace_folder(directory, write)


# cached features only: it fine-tunes the target that would compute them, and holds a shard out
@METHODS.register("medusa2", needs="model")
def medusa2_method(num_heads: int = 4, head_decay: float = 0.8, draft_vocab: int = 8192, tree_top_k: int = 8,
                   total_tokens: int = 16, trainable_layers: int = 2, distill_weight: float = 5.0) -> Medusa2Method:
    return Medusa2Method(num_heads, head_decay, draft_vocab, tree_top_k, total_tokens, trainable_layers, distill_weight)
