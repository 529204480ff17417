"""Self-speculation with the target's own layers, no trained weights (``layerskip``).

The drafter is the target with some decoder layers left out, followed by the target's final norm
and LM head; it drafts a greedy chain of ``num_draft`` tokens (DETERMINISTIC, so verification is
exact at any temperature).

- ``variant=early_exit``: the first ``exit_layer`` layers (LayerSkip-style early exit).
- ``variant=skip``: every layer but a skip set (Draft&Verify / SWIFT-style). Given, or searched
  greedily: starting from nothing, add the one layer whose removal keeps the drafter's argmax in
  best agreement with the full model's on calibration text, until ``num_skip`` layers are gone. The
  calibration text is written by the target itself (sampled from its BOS token with a fixed seed),
  so no data set is needed. Layer 0 is never skipped: the composite KV cache below borrows the
  target's entry 0, which is where transformers reads a cache's length. The search result is cached
  as JSON in ``specdec.packaged_models.cache_dir()/layerskip``, keyed by a fingerprint of the weights and
  the search settings.

KV cache. The layers before the first left-out one ("shared") see exactly the target's inputs for
committed tokens, so their KV is the target's: the drafter reads the target's cache entries for
them in place and appends its draft rows there, then puts the target's tensors back before
returning (nothing it computed stays in the target's cache). For early exit every draft layer is
shared: no committed token is ever recomputed. Layers after a skipped one ("own") see a different
residual stream, so their committed KV differs from the target's: the drafter keeps them in its own
tensors with the target's ragged layout (request b's committed tokens in columns [0, own[b])). The
root and the accepted draft tokens' own rows come from the drafting forwards; a token the drafter
never fed (the last draft when the whole chain is accepted, or a prompt) is caught up in the next
proposal's first forward, which then recomputes the shared layers for it too (one mask serves every
layer, so those rows must come from the same forward). Not reused the other way: the target's
verification forward recomputes every layer for the root and the drafts, shared layers included.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch
from torch import Tensor

from drafters.base import BudgetKnobs, DraftContext, DraftTree, DrafterBase, SiblingMode, VerifyResult, register
from specdec.files import write_atomically
from specdec.packaged_models import cache_dir
from specdec.protocols import HeadTarget
from specdec.tree import chain_tree, empty_tree

SEARCH_VERSION = 1  # bump when the search changes, so cached results of the old one are not reused


@dataclass(frozen=True)
class SkipSearch:
    skip: tuple[int, ...]  # layers left out, in the order the search added them
    agreement: tuple[float, ...]  # calibration argmax agreement with the full model after each addition
    settings: dict  # what the result is keyed by (model, fingerprint, search settings)


@register("layerskip", needs="model", budget=BudgetKnobs(depth="num_draft"))
def build_layerskip(
    target: HeadTarget,
    variant: str = "skip",
    exit_layer: int | None = None,
    skip: list[int] | None = None,
    num_skip: int | None = None,
    num_draft: int = 3,
    calibration_prompts: int = 4,
    calibration_tokens: int = 32,
    seed: int = 0,
) -> LayerSkipDrafter:
    """exit_layer defaults to two thirds of the layers; num_skip (layers the search removes when
    ``skip`` is null) to a tenth of them, at least one: on SmolLM2 first-depth acceptance fell
    steeply with an earlier exit and with more skipped layers (docs/RESULTS.md, "Self-speculation
    without weights")."""
    layers = target.num_layers
    if variant == "early_exit":
        if skip is not None or num_skip is not None:
            raise ValueError("skip and num_skip belong to variant=skip; early_exit takes exit_layer")
        exit_layer = max(1, 2 * layers // 3) if exit_layer is None else exit_layer
        if not 1 <= exit_layer <= layers:
            raise ValueError(f"exit_layer must lie in [1, {layers}] for this {layers}-layer target; got {exit_layer}")
        kept = tuple(range(exit_layer))
    elif variant == "skip":
        if exit_layer is not None:
            raise ValueError("exit_layer belongs to variant=early_exit; skip takes skip or num_skip")
        if skip is None:
            num_skip = max(1, layers // 10) if num_skip is None else num_skip
            skip = list(cached_skip_search(target, num_skip, calibration_prompts, calibration_tokens, seed).skip)
        elif num_skip is not None:
            raise ValueError("give either skip (the layers to leave out) or num_skip (how many to search for)")
        bad = [i for i in skip if not 1 <= i < layers]
        if bad or len(set(skip)) != len(skip):
            raise ValueError(
                f"skip must list distinct layers in [1, {layers}) (layer 0 is always kept); got {list(skip)}"
            )
        kept = tuple(i for i in range(layers) if i not in skip)
    else:
        raise ValueError(f"variant must be early_exit or skip; got {variant!r}")
    return LayerSkipDrafter(target, kept, num_draft)


class LayerSkipDrafter(DrafterBase):
    commit_reads_tree = True  # its own layers' cache keeps what its own last tree accepted

    def __init__(self, target: HeadTarget, kept: tuple[int, ...], num_draft: int) -> None:
        if num_draft < 1:
            raise ValueError(f"num_draft must be >= 1; got {num_draft}")
        if not kept or kept[0] != 0:
            raise ValueError(f"the drafter must keep layer 0 and at least one layer; got {list(kept)}")
        self.target, self.kept, self.num_draft = target, kept, num_draft
        first_left_out = next((i for i, layer in enumerate(kept) if layer != i), len(kept))
        self.shared = kept[:first_left_out]  # these layers' committed KV is the target's
        self.own = kept[first_left_out:]  # these keep their own KV
        device = target.device
        self._own_keys: list[Tensor] = []  # per own layer [B, H, W, D]; W >= the target's columns
        self._own_values: list[Tensor] = []  # per own layer [B, H, W, D]
        self._own_lengths = torch.zeros(0, dtype=torch.int64, device=device)  # [B] valid own columns
        self._last: tuple[int, Tensor] | None = None  # (first column fed last proposal, missing [B])

    def reset(self, batch_size: int, max_length: int) -> None:
        self._own_keys, self._own_values = [], []
        self._own_lengths = torch.zeros(batch_size, dtype=torch.int64, device=self.target.device)

    def admit(self, count: int, max_length: int) -> None:
        fresh = torch.zeros(count, dtype=torch.int64, device=self.target.device)
        self._own_lengths = torch.cat([self._own_lengths, fresh])  # their rows are padded in at propose

    def propose(self, ctx: DraftContext) -> DraftTree:
        # transformers: ~16 s to import cold; importing this module needs none of it
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        cache = self.target.kv_cache
        device = ctx.tokens.device
        committed = ctx.lengths - 1  # [B] tokens in the target's cache; the root is at this position
        width = cache.get_seq_length()  # C, the target's cache columns
        # rows each request must feed before its root: own layers lag behind (0 for early exit)
        seen = self._own_lengths if self.own else committed  # [B] committed columns a draft row may read
        missing = committed - seen  # [B]
        lag = int(missing.max())
        composite = DynamicCache()
        composite.layers = [DynamicLayer() for _ in range(self.target.num_layers)]
        saved = {i: (cache.layers[i].keys, cache.layers[i].values) for i in self.shared}
        for i in self.shared:
            composite.layers[i] = cache.layers[i]
        keys, values = self._fit_own(cache.layers[0].keys, width)
        for i, k, v in zip(self.own, keys, values):
            composite.layers[i].update(k, v)

        # first forward: the missing committed tokens (left-padded) and the root
        offsets = torch.arange(-lag, 1, device=device)  # [M+1]
        real = offsets >= -missing[:, None]  # [B, M+1]
        positions = torch.where(real, committed[:, None] + offsets, 0)  # [B, M+1]
        ids = ctx.tokens.gather(1, positions)  # [B, M+1]
        past = torch.arange(width, device=device) < seen[:, None]  # [B, C]
        causal = offsets[:, None] >= offsets[None, :]  # [M+1, M+1]
        eye = torch.eye(lag + 1, dtype=torch.bool, device=device)
        block = (causal & real[:, None, :]) | (eye & ~real[:, :, None])  # padding rows see only themselves
        visible = torch.cat([past[:, None, :].expand(-1, lag + 1, -1), block], dim=2)
        new_seen = real  # [B, rows so far] the new rows a draft row reads
        drafted = []
        try:
            for step in range(self.num_draft):
                logits = self.target.forward_layers(self.kept, composite, ids, positions, visible, logits_to_keep=1)
                token = logits[:, -1].argmax(-1)  # [B]
                drafted.append(token)
                if step + 1 == self.num_draft:
                    break
                ids, positions = token[:, None], positions[:, -1:] + 1
                new_seen = torch.cat([new_seen, torch.ones_like(new_seen[:, :1])], dim=1)
                visible = torch.cat([past, new_seen], dim=1)[:, None, :]
        finally:
            for i, (k, v) in saved.items():  # the target's own tensors back, draft rows gone
                cache.layers[i].keys, cache.layers[i].values = k, v
        self._own_keys = [composite.layers[i].keys for i in self.own]
        self._own_values = [composite.layers[i].values for i in self.own]
        self._last = (width, missing)
        return chain_tree(torch.stack(drafted, 1), SiblingMode.DETERMINISTIC)

    def _fit_own(self, like: Tensor, width: int) -> tuple[list[Tensor], list[Tensor]]:
        """Own KV padded (with never-read zeros) or cut to the batch's rows and ``width`` columns,
        so that every layer of the composite cache has the target's width."""
        batch, heads, _, dim = like.shape  # [B, H, C, D] the target's layer 0
        if not self._own_keys:
            zeros = like.new_zeros(batch, heads, width, dim)
            return [zeros] * len(self.own), [zeros] * len(self.own)

        def fit(tensor: Tensor) -> Tensor:  # [B', H, W', D] -> [B, H, width, D]
            tensor = tensor[:, :, :width]
            return torch.nn.functional.pad(tensor, (0, 0, 0, width - tensor.shape[2], 0, 0, 0, batch - tensor.shape[0]))

        return [fit(k) for k in self._own_keys], [fit(v) for v in self._own_values]

    def commit(self, tree: DraftTree, result: VerifyResult) -> None:
        if not self.own:
            return
        width, missing = self._last
        # own rows fed last proposal, in order: caught-up tokens, root, drafts 1..num_draft-1; the
        # kept ones (all caught-up, root, accepted drafts) move down to start at the old own length
        kept = missing + 1 + result.num_accepted.clamp(max=self.num_draft - 1)  # [B]
        lag = int(missing.max())
        rows = torch.arange(lag + self.num_draft, device=kept.device)  # [R]
        source = width + lag - missing[:, None] + rows  # [B, R]
        target = self._own_lengths[:, None] + rows  # [B, R]; rows past `kept` land past the new length
        for tensors in (self._own_keys, self._own_values):
            for tensor in tensors:  # [B, H, W, D]
                index = lambda cols: cols[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[3])
                moved = tensor.gather(2, index(source.clamp(max=tensor.shape[2] - 1)))
                tensor.scatter_(2, index(target), moved)
        self._own_lengths = self._own_lengths + kept

    def retain(self, rows: Tensor) -> None:
        self._own_keys = [k[rows] for k in self._own_keys]
        self._own_values = [v[rows] for v in self._own_values]
        self._own_lengths = self._own_lengths[rows]


# -- the skip-set search --


def cached_skip_search(target: HeadTarget, num_skip: int, prompts: int, tokens: int, seed: int) -> SkipSearch:
    """search_skip_set, read from the cache when the same model and settings were searched before."""
    key = {
        "fingerprint": _fingerprint(target.model),
        "num_layers": target.num_layers,
        "num_skip": num_skip,
        "calibration_prompts": prompts,
        "calibration_tokens": tokens,
        "seed": seed,
        "version": SEARCH_VERSION,
    }
    # the weights identify the model (a folder may be overwritten); its folder is kept for readers
    settings = {**key, "model": str(target.folder or target.key)}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir() / "layerskip" / f"skip-{digest}.json"
    if path.is_file():
        stored = json.loads(path.read_text())
        return SkipSearch(tuple(stored["skip"]), tuple(stored["agreement"]), stored["settings"])
    sequences = calibration_text(target, prompts, tokens, seed)
    found = search_skip_set(target, num_skip, sequences)
    found = SkipSearch(found.skip, found.agreement, settings)
    stored = {"skip": list(found.skip), "agreement": list(found.agreement), "settings": settings}
    write_atomically(path, lambda staged: staged.write_text(json.dumps(stored, indent=2)))
    return found


def search_skip_set(target: HeadTarget, num_skip: int, sequences: Tensor) -> SkipSearch:  # sequences [P, T] int64
    """Grow the skip set one layer at a time, each time removing the layer whose absence keeps the
    drafter's argmax in best agreement with the full model's over every position of ``sequences``."""
    layers = target.num_layers
    if not 0 <= num_skip < layers:
        raise ValueError(f"num_skip must lie in [0, {layers - 1}] for this {layers}-layer target; got {num_skip}")
    full = _argmax(target, tuple(range(layers)), sequences)  # [P, T]
    skip: list[int] = []
    agreement: list[float] = []
    for _ in range(num_skip):
        best_score, best_layer = -1.0, -1
        for layer in range(1, layers):
            if layer in skip:
                continue
            kept = tuple(i for i in range(layers) if i not in skip and i != layer)
            score = float((_argmax(target, kept, sequences) == full).float().mean())
            # `>=` prefers the later layer on ties: more layers before the first skipped one share KV
            if score >= best_score:
                best_score, best_layer = score, layer
        skip.append(best_layer)
        agreement.append(best_score)
    return SkipSearch(tuple(skip), tuple(agreement), {})


def calibration_text(target: HeadTarget, prompts: int, tokens: int, seed: int) -> Tensor:  # [P, tokens + 1] int64
    """Text the target writes itself: ``prompts`` sequences sampled at temperature 1 from its BOS
    token (token 0 if its config names none) with a fixed seed, one forward per token through the
    target's own cache: call it before decoding starts, never during."""
    if prompts < 1 or tokens < 1:
        raise ValueError(f"calibration_prompts and calibration_tokens must be >= 1; got {prompts}, {tokens}")
    bos = getattr(target.model.config, "bos_token_id", None)
    bos = 0 if bos is None else int(bos)
    device = target.device
    generator = torch.Generator().manual_seed(seed)
    sequence = torch.full((prompts, 1), bos, dtype=torch.int64, device=device)
    target.prefill(list(sequence), ())
    step = empty_tree(prompts, device)
    for _ in range(tokens):
        probs = torch.softmax(target.forward_tree(step, ()).logits[:, 0].double().cpu(), -1)  # [P, V]
        token = torch.multinomial(probs, 1, generator=generator).to(device)  # [P, 1]
        target.commit(step, VerifyResult(step.tokens, torch.zeros_like(token[:, 0]), token[:, 0]))
        sequence = torch.cat([sequence, token], dim=1)
    return sequence


def _argmax(target: HeadTarget, kept: tuple[int, ...], sequences: Tensor) -> Tensor:  # [P, T] int64
    batch, length = sequences.shape
    positions = torch.arange(length, device=sequences.device).expand(batch, -1)
    causal = torch.ones(length, length, dtype=torch.bool, device=sequences.device).tril()
    return target.forward_layers(kept, None, sequences, positions, causal.expand(batch, -1, -1)).argmax(-1)


def _fingerprint(model) -> str:
    """A cheap hash of the weights (the first values of every tensor): two different checkpoints
    saved under one path must not share a cached search."""
    digest = hashlib.sha256()
    for name, parameter in model.named_parameters():
        digest.update(name.encode())
        digest.update(parameter.detach().flatten()[:16].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]

