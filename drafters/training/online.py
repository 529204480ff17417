"""Training batches whose target features are computed while training runs, not read from a cache.

A feature cache (drafters.training.features) stores several [T, H] matrices per token; for tens of
millions of tokens that is more than a GPU machine's disk, and on a GPU the frozen target's forward
costs no more than the head's own step. So here every batch is one forward of the target: token
rows right-padded to the batch's longest, causal attention and no mask (a padding column sees only
real tokens before it and is never read), hooks on the layers the head reads, and the target's
argmax choice after every token from the final-norm output. The result is the EagleBatch a cache
would give, so every method's loss is the one it trains with on cached features (``prepare_on``).

Sequences say which tokens are trained on (``TokenSequences.trained``): the positions before those
tokens get labels, the others -1, so a conversation's prompts are read as context while only its
answers are learnt. Batches hold about ``batch_tokens`` tokens (sequences of similar length
together, to pad little) and come in an order seeded by the epoch, so batch ``step`` is the same
whenever it is asked for, as the trainer's resume needs.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from drafters.training.data import EagleBatch, HeadData, select_draft_vocab
from specdec.protocols import HeadTarget
from specdec.target import decoder_layers, final_norm

LABEL_ROWS = 8192  # final-norm rows per LM-head product when labelling: bounds the [rows, V] logits


@dataclass(frozen=True)
class TokenSequences:
    tokens: Tensor  # [N] int64, every sequence's tokens back to back
    offsets: Tensor  # [S + 1] int64, sequence s is tokens[offsets[s] : offsets[s + 1]]
    trained: Tensor  # [N] bool, True for a token the heads learn to predict (an answer's, not a prompt's)

    def __post_init__(self) -> None:
        if self.offsets.ndim != 1 or len(self.offsets) < 2 or int(self.offsets[0]) != 0 \
                or int(self.offsets[-1]) != len(self.tokens) or bool((self.offsets.diff() < 1).any()):
            raise ValueError("TokenSequences: offsets must run from 0 to len(tokens) in steps of at least one token")
        if self.trained.shape != self.tokens.shape:
            raise ValueError(f"TokenSequences: trained has shape {tuple(self.trained.shape)}, tokens {tuple(self.tokens.shape)}")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> Tensor:  # [S] int64
        return self.offsets.diff()

    def num_trained(self) -> int:
        """Positions with a label: a trained token that is not its sequence's first."""
        first = torch.zeros_like(self.trained)
        first[self.offsets[:-1]] = True
        return int((self.trained & ~first).sum())

    def select(self, indices: Tensor) -> TokenSequences:  # [K] int64 sequence indices, in the order given
        starts, ends = self.offsets[indices], self.offsets[indices + 1]
        rows = torch.cat([torch.arange(int(a), int(b)) for a, b in zip(starts, ends)])
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), (ends - starts).cumsum(0)])
        return TokenSequences(self.tokens[rows], offsets, self.trained[rows])

    @staticmethod
    def concatenate(parts: list[TokenSequences]) -> TokenSequences:
        shifts = torch.tensor([0] + [len(p.tokens) for p in parts[:-1]]).cumsum(0)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64)] + [p.offsets[1:] + s for p, s in zip(parts, shifts)])
        return TokenSequences(torch.cat([p.tokens for p in parts]), offsets, torch.cat([p.trained for p in parts]))


def target_features(target: HeadTarget, tokens: Tensor, layers: tuple[int, ...]) -> tuple[dict[int, Tensor], Tensor]:
    """One forward of the frozen target over right-padded rows ``tokens`` [B, T] (on its device):
    the hidden states of ``layers`` and of the final norm ({layer: [B, T, H]}, in the target's
    dtype; 0 = embeddings, k = block k, L + 1 = final norm, as HFTarget numbers them) and the
    target's argmax choice after every token ([B, T] int64)."""
    model, final = target.model, target.num_layers + 1
    modules = {0: model.get_input_embeddings(), final: final_norm(model)}
    modules.update({index + 1: layer for index, layer in enumerate(decoder_layers(model))})
    bad = [k for k in layers if k not in modules]
    if bad:
        raise ValueError(f"hidden-state layers {bad} out of range [0, {final}] for this target "
                         f"(0 = embeddings, {final} = final-norm output)")
    captured: dict[int, Tensor] = {}

    def capture(index: int):
        def hook(module, args, output):
            captured[index] = output[0] if isinstance(output, tuple) else output

        return hook

    handles = [modules[k].register_forward_hook(capture(k)) for k in dict.fromkeys((*layers, final))]
    try:
        with torch.no_grad():
            model.base_model(input_ids=tokens, use_cache=False)  # the base model: no [B, T, V] logits
    finally:
        for handle in handles:
            handle.remove()
    lm_head = model.get_output_embeddings().weight  # [V, H]
    with torch.no_grad():
        rows = captured[final].flatten(0, 1)  # [B*T, H]
        choices = torch.cat([(chunk @ lm_head.T).argmax(-1) for chunk in rows.split(LABEL_ROWS)])
    return captured, choices.view(tokens.shape)


class OnlineData:
    """The batches EagleData gives from a cache, computed by ``target`` from ``sequences``: features
    of ``layers`` (concatenated, float32), the final-norm output and the target's choices as labels
    where the next token is trained on."""

    def __init__(self, target: HeadTarget, sequences: TokenSequences, layers: tuple[int, ...], batch_tokens: int,
                 seed: int = 0) -> None:
        if batch_tokens < 1:
            raise ValueError(f"batch_tokens must be >= 1; got {batch_tokens}")
        self.target, self.sequences, self.layers, self.seed = target, sequences, tuple(layers), seed
        self.groups = _length_groups(sequences.lengths(), batch_tokens, seed)

    def num_tokens(self) -> int:
        return len(self.sequences.tokens)

    def batches(self, step: int) -> Iterator[EagleBatch]:
        while True:
            epoch, index = divmod(step, len(self.groups))
            order = torch.randperm(len(self.groups), generator=torch.Generator().manual_seed(self.seed + epoch))
            yield self.batch(self.groups[int(order[index])])
            step += 1

    def batch(self, indices: Tensor) -> EagleBatch:  # [B] sequence indices
        device, s = self.target.device, self.sequences
        lengths = s.lengths()[indices]
        width = int(lengths.max())
        tokens = torch.zeros(len(indices), width, dtype=torch.int64)
        trained = torch.zeros(len(indices), width, dtype=torch.bool)
        for row, (start, length) in enumerate(zip(s.offsets[indices].tolist(), lengths.tolist())):
            tokens[row, :length] = s.tokens[start : start + length]
            trained[row, :length] = s.trained[start : start + length]
        tokens, trained = tokens.to(device), trained.to(device)
        hidden, choices = target_features(self.target, tokens, self.layers)
        # the label at t is the target's choice of token t + 1: kept where that token is trained on
        labelled = torch.zeros_like(trained)
        labelled[:, :-1] = trained[:, 1:]
        labels = torch.where(labelled, choices, torch.full_like(choices, -1))
        features = torch.cat([hidden[k] for k in self.layers], -1).float()
        final = hidden[self.target.num_layers + 1].float()
        return EagleBatch(features, final, tokens, labels, labels >= 0)


def _length_groups(lengths: Tensor, batch_tokens: int, seed: int) -> list[Tensor]:
    """Sequence indices in batches of similar lengths, each padded to at most ``batch_tokens`` tokens
    (a sequence longer than that is a batch alone); ties in length are broken by a seeded shuffle."""
    shuffled = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed))
    order = shuffled[torch.sort(lengths[shuffled], stable=True).indices]  # by length, ties in seeded order
    widths = lengths[order].tolist()
    groups, start = [], 0
    for end in range(1, len(order)):
        # sorted ascending, so sequence order[end] would set the padded width of the batch it joins
        if (end + 1 - start) * widths[end] > batch_tokens:
            groups.append(order[start:end])
            start = end
    groups.append(order[start:])
    return groups


def choice_vocabulary(data: OnlineData, size: int, label_tokens: int) -> Tensor:  # [K] token ids
    """The ``size`` most frequent target choices at the labelled positions of ``data``'s first
    batches (at least ``label_tokens`` labels, or a whole epoch): a draft vocabulary, as
    select_draft_vocab picks one from a cache's labels."""
    vocab_size = data.target.vocab_size
    counts = torch.zeros(vocab_size, dtype=torch.int64, device=data.target.device)
    seen = 0
    for batch, _ in zip(data.batches(0), range(len(data.groups))):
        counts += torch.bincount(batch.labels[batch.valid], minlength=vocab_size)
        seen += int(batch.valid.sum())
        if seen >= label_tokens:
            break
    return select_draft_vocab(counts.cpu(), size)


def online_head_data(data: OnlineData, draft_ids: Tensor) -> HeadData:
    """What a method's ``prepare_on`` trains from: ``data`` and the draft vocabulary ``draft_ids`` [K]."""
    model = data.target.model
    return HeadData(model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach(), data,
                    draft_ids)
