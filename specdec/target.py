"""HFTarget: any Hugging Face causal LM as a speculative-decoding target, through its standard API.

No forked modeling code: a tree is one forward with a 4D additive float mask (each row sees the
committed prefix, its ancestors and itself) and explicit positions (committed length + depth).

KV cache layout, one DynamicCache of in-place GrowingLayers for the batch (specdec.kv_cache):
request b owns columns [0, cached[b]) of every layer; columns past that are stale and masked out.
A forward appends its rows at the common end of the cache; ``commit`` then moves each request's
kept rows (root + accepted path) down to [cached[b], cached[b] + kept) and crops, so nothing is
ever recomputed and the cache never holds more than max(cached) + tree rows.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor
from transformers import DynamicCache

from specdec.cpu_kernels import (PackedLinear, fastest_packed_from, make_invariant, pack_linears, prompt_kernels,
                                 use_grouped_query_attention, uses_own_attention)
from specdec.kv_cache import growing_cache
from specdec.protocols import TargetOutput, VerifyResult, cat_padded, stack_rows
from specdec.tree import DraftTree


# on a CPU, admissions of at most this many prompts are prefilled one prompt per forward (admit)
SOLO_ADMISSIONS = 16


class HFTarget:
    """A HeadTarget (specdec.protocols): the Target protocol, plus the model, sizes, kernels, KV
    cache and reduced-layer forwards that drafters built on the target's own modules read."""

    kind = "model"

    def __init__(
        self, model, max_length: int | None = None, packed_gemm_from: int | str | None = None, invariant: bool | None = None,
        key: str = "hf", folder: Path | None = None,
    ) -> None:
        """model: a transformers causal LM (eval mode is set here). max_length defaults to the
        model's max_position_embeddings. packed_gemm_from: on a CPU, forwards of at least that many
        rows per linear layer use packed-weight GEMMs (specdec.cpu_kernels; None = stock kernels;
        "auto" = the threshold that is fastest for this model's layers on this machine, timed here
        in about a second, kept in ``self.packed_gemm_from``). Grouped-query attention runs without repeating key/value heads. invariant: compute every
        row as it would be computed alone (specdec.cpu_kernels.make_invariant, packed_gemm_from
        then does not apply), so that greedy speculative output equals plain decoding in half
        precision too; None = for bfloat16 / float16 models on a CPU. key: the registered target name
        that opened it (Target.key; specdec.target_loader passes it), hf for any other model. folder:
        where it was loaded from (HeadTarget.folder)."""
        config = model.config
        if config.model_type in ("bloom", "mpt") or getattr(config, "alibi", False):
            raise ValueError(
                f"{type(model).__name__} uses ALiBi position biases, which transformers derives from a "
                f"2D attention mask; tree verification needs explicit positions and a 4D mask, so "
                f"ALiBi models cannot be HFTarget targets (rotary and learned positions can)"
            )
        self.model = model.eval()
        self.key, self.folder = key, folder
        self._window, self._layer_kinds = _sliding_window(config)
        parameter = next(model.parameters())
        if invariant is None:
            invariant = parameter.dtype in (torch.bfloat16, torch.float16) and parameter.device.type == "cpu"
        self.invariant = invariant
        if invariant:
            make_invariant(model)
            self.packed_gemm_from = 1
        else:
            use_grouped_query_attention(model)
            if packed_gemm_from == "auto":
                packed_gemm_from = fastest_packed_from(model)
            elif not (packed_gemm_from is None or (isinstance(packed_gemm_from, int) and packed_gemm_from >= 1)):
                raise ValueError(f"packed_gemm_from must be an integer >= 1, 'auto' or None; got {packed_gemm_from!r}")
            self.packed_gemm_from = packed_gemm_from if packed_gemm_from and pack_linears(model, packed_gemm_from) else None
        self.packed_linears = sum(isinstance(m, PackedLinear) for m in model.modules())
        # sliding layers' masks may then skip the columns no row sees (cpu_kernels.keys_under_mask)
        self._cut_window = self._window is not None and uses_own_attention(model)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_length = max_length or getattr(config, "max_position_embeddings", 1 << 30)
        self.num_layers = config.num_hidden_layers
        self.hidden_size = config.hidden_size
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        # transformers >= 5.24 names the cache argument `cache`; older 5.x `past_key_values`
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        # the batch's KV cache, a factory so that a comparison can swap in transformers' DynamicCache
        self.new_cache = growing_cache
        self._cache = None
        self._cached = torch.zeros(0, dtype=torch.int64, device=self.device)  # [B] valid cache columns per request
        self._roots = torch.zeros(0, dtype=torch.int64, device=self.device)  # [B] last committed token, not yet cached
        self._captured: dict[int, Tensor] = {}
        self._hooks = self._install_hooks()
        self._layer_views: dict[tuple[int, ...], torch.nn.Module] = {}  # forward_layers' models, by kept layers

    # -- hidden states: 0 = embedding output, k = output of decoder layer k (before the final
    # norm, with its massive activations), L + 1 = final-norm output, the LM head's input --

    def _install_hooks(self) -> list:
        layers = decoder_layers(self.model)

        def capture(index: int):
            def hook(module, args, output):
                if index in self._wanted:
                    self._captured[index] = output[0] if isinstance(output, tuple) else output

            return hook

        self._wanted: tuple[int, ...] = ()
        handles = [self.model.get_input_embeddings().register_forward_hook(capture(0))]
        handles += [layer.register_forward_hook(capture(i + 1)) for i, layer in enumerate(layers)]
        handles.append(final_norm(self.model).register_forward_hook(capture(len(layers) + 1)))
        return handles

    def _attention_mask(self, visible: Tensor | None):  # [B, Q, K] bool -> the model's attention_mask
        """Additive masks [B, 1, Q, K]: one, or per layer kind for models that mix sliding-window
        and global layers. A row's visible keys are its path, one per position in column order, so
        a key lies (number of visible keys from it to the row) - 1 positions back: the window keeps
        the last ``window`` of them, as transformers' own sliding mask does; where the model runs
        our attention, the sliding mask starts at the first column some row sees and covers the
        cache's last columns (cpu_kernels.keys_under_mask). None (a causal forward
        over a fresh cache) stays None: the model masks causally, and slides, on its own."""
        if visible is None:
            return None
        if self._window is None:
            return _additive(visible, self.dtype)
        from_key_to_row = visible.flip(-1).cumsum(-1).flip(-1)  # [B, Q, K]
        in_window = visible & (from_key_to_row <= self._window)  # [B, Q, K]
        if self._cut_window and visible.shape[-1] > self._window:
            # the mask, and so the attention, starts at the first column some row sees (a host read)
            first = int(in_window.flatten(0, 1).any(0).int().argmax())
            in_window = in_window[..., first:]
        sliding = _additive(in_window, self.dtype)
        if self._layer_kinds is None:  # every layer slides (Mistral, Mixtral, Phi-3, Starcoder2)
            return sliding
        return {"full_attention": _additive(visible, self.dtype), "sliding_attention": sliding}

    def _forward(
        self,
        input_ids: Tensor,  # [B, Q]
        positions: Tensor,  # [B, Q]
        visible: Tensor | None,  # [B, Q, C+Q] bool, C = columns already in the cache; None = causal, C = 0
        layers: tuple[int, ...],
        logits_to_keep: int,
        cache=None,  # a DynamicCache to extend; None = the batch's own
    ) -> TargetOutput:
        bad = [k for k in layers if not 0 <= k <= self.num_layers + 1]
        if bad:
            raise ValueError(
                f"hidden-state layers {bad} out of range [0, {self.num_layers + 1}] for this model "
                f"(0 = embeddings, {self.num_layers + 1} = final-norm output)"
            )
        self._wanted, self._captured = tuple(layers), {}
        with torch.no_grad():
            out = self.model(
                input_ids=input_ids,
                position_ids=positions,
                attention_mask=self._attention_mask(visible),
                use_cache=True,
                logits_to_keep=logits_to_keep,
                **{self._cache_arg: self._cache if cache is None else cache},
            )
        hidden = tuple(self._captured.pop(k) for k in layers)
        return TargetOutput(out.logits.float(), hidden)

    # -- Target protocol --

    def prefill(self, prompts: list[Tensor], layers: tuple[int, ...]) -> TargetOutput:
        self._cached, self._roots = self._cached[:0], self._roots[:0]  # an empty batch, then admit
        return self.admit(prompts, layers)

    def admit(self, prompts: list[Tensor], layers: tuple[int, ...]) -> TargetOutput:
        """Prefill the new prompts in new caches, then append their rows to the batch's cache in one
        copy, padding the narrower ones with stale (masked) columns.

        An invariant target prefills each prompt in a forward of its own with fast kernels
        (specdec.cpu_kernels.prompt_kernels): its cache then does not depend on which prompts it
        was admitted with. Any CPU target does so for admissions of up to SOLO_ADMISSIONS prompts,
        where a CPU pays padding rows in full: plain decoding's requests finish together and would
        be admitted in one forward padded to the longest prompt, while a speculative batch admits
        them one or two at a time, so padding alone would favour speculation (docs/NOTES.md,
        "Problems seen and left alone"). Larger admissions (a whole statistical test's requests at
        once) stay one forward."""
        solo = self.invariant or (self.device.type == "cpu" and len(prompts) <= SOLO_ADMISSIONS)
        prefills = [self._prefill_group(group, layers) for group in ([[p] for p in prompts] if solo else [prompts])]
        caches = [cache for cache, _ in prefills]
        self._cache = _stack_caches(caches if self._cached.numel() == 0 else [self._cache, *caches])
        self._cached = torch.cat([self._cached, torch.tensor([len(p) - 1 for p in prompts], device=self.device)])
        self._roots = torch.cat([self._roots, torch.stack([p[-1] for p in prompts]).to(self.device)])
        self._crop()
        logits = torch.empty(len(prompts), 0, self.vocab_size, device=self.device)  # no token is verified yet
        return TargetOutput(logits, stack_rows(*(hidden for _, hidden in prefills)))

    def _prefill_group(self, prompts: list[Tensor], layers: tuple[int, ...]) -> tuple[DynamicCache, tuple[Tensor, ...]]:
        """All but the last token of each prompt, right-padded into one forward over a new cache:
        the cache and the hidden states ([P, W, H] per layer) of the prompts' rows."""
        lengths = torch.tensor([len(p) - 1 for p in prompts], device=self.device)  # all but the root
        width = max(int(lengths.max()), 1)
        ids = torch.zeros(len(prompts), width, dtype=torch.int64, device=self.device)
        for i, p in enumerate(prompts):
            ids[i, : len(p) - 1] = p[:-1].to(self.device)
        columns = torch.arange(width, device=self.device)
        visible = None  # one prompt has no padding: a causal forward, which SDPA runs without a W x W mask
        if len(prompts) > 1:
            real = columns < lengths[:, None]  # [P, W]
            causal = columns[None, :, None] >= columns[None, None, :]  # [1, W, W]
            # padding rows see only themselves so every softmax row stays finite
            visible = (causal & real[:, None, :]) | (torch.eye(width, dtype=torch.bool, device=self.device) & ~real[:, :, None])
        cache = self.new_cache()
        with prompt_kernels() if self.invariant else contextlib.nullcontext():
            out = self._forward(ids, columns.expand_as(ids), visible, layers, logits_to_keep=1, cache=cache)
        return cache, out.hidden

    def forward_tree(self, tree: DraftTree, layers: tuple[int, ...]) -> TargetOutput:
        n = tree.tokens.shape[1]
        past = self._cache.get_seq_length()
        root_tokens = self._roots
        ids = torch.cat([root_tokens[:, None], tree.tokens.clamp(min=0)], dim=1)  # [B, N+1]
        positions = tree.positions(self._cached)  # root sits at column index = cached length
        # no position passes past + n (the cache is as wide as the longest request, a depth is at
        # most n), so only a tree that could reach the window's end costs the exact check's host sync
        if past + n >= self.max_length and int(positions.max()) >= self.max_length:
            raise ValueError(
                f"the tree reaches position {int(positions.max())}, past the target's context window "
                f"of {self.max_length} tokens"
            )
        if n == 0 and len(self._cached) == 1 and self._window is None:
            # plain decoding of a lone request: its row sees every cached column (a lone cache has no
            # padding), which SDPA computes without a mask; a masked call takes a slower kernel
            return self._forward(ids, positions, None, layers, logits_to_keep=0)
        past_visible = torch.arange(past, device=self.device) < self._cached[:, None]  # [B, C]
        visible = torch.cat([past_visible[:, None, :].expand(-1, n + 1, -1), tree.ancestor_mask], dim=2)
        return self._forward(ids, positions, visible, layers, logits_to_keep=0)

    def commit(self, tree: DraftTree, result: VerifyResult) -> None:
        n = tree.tokens.shape[1]
        start = self._cache.get_seq_length() - (n + 1)  # column of every request's root row
        cached = self._cached + result.num_accepted + 1  # [B] + root + accepted path
        # the commit's one host read: the longest accepted path (no column past it moves) and the
        # cache's new width; a step that accepts nothing moves only the batch's root rows
        accepted, width = torch.stack([result.num_accepted.max(), cached.max()]).tolist()
        source = start + torch.cat([torch.zeros_like(cached)[:, None], result.accepted_nodes[:, :accepted] + 1], 1)
        target = self._cached[:, None] + torch.arange(1 + accepted, device=self.device)  # [B, 1 + accepted]
        if len(cached) == 1:  # a lone request's cache has no padding columns: its root row is in place
            source, target = source[:, 1:], target[:, 1:]
        if target.shape[1]:  # plain decoding of one request moves nothing (the copy is a visible share of its step)
            self._move_columns(source.clamp(min=start), target)
        self._cached, self._roots = cached, result.next_token
        self._crop(width)

    def _move_columns(self, source: Tensor, target: Tensor) -> None:
        """Copy each request's cache columns ``source`` [B, R] to columns ``target`` [B, R] in every
        layer; rows past a request's kept path land past its new length, where they are never read."""
        index = {}  # by (heads, head size): the gather/scatter indices are shared by layers of one shape
        for layer in self._cache.layers:
            for name in ("keys", "values"):
                tensor = getattr(layer, name)  # [B, H, C, D]
                shape = (tensor.shape[1], tensor.shape[3])
                if shape not in index:
                    index[shape] = (_column_index(source, tensor), _column_index(target, tensor))
                tensor.scatter_(2, index[shape][1], tensor.gather(2, index[shape][0]))

    def retain(self, rows: Tensor) -> None:
        for layer in self._cache.layers:
            layer.keys, layer.values = layer.keys[rows], layer.values[rows]
        self._cached, self._roots = self._cached[rows], self._roots[rows]
        self._crop()

    @property
    def cached_lengths(self) -> Tensor:  # [B] committed tokens in the cache (all but the root)
        return self._cached

    @property
    def roots(self) -> Tensor:  # [B] last committed token, fed as row 0 of the next tree
        return self._roots

    @property
    def kv_cache(self):
        """The transformers DynamicCache of committed tokens (request b owns columns
        [0, cached_lengths[b]) of every layer), for drafters that share layers with the target.
        Whatever a drafter appends to it must be gone before the target's next forward."""
        return self._cache

    def forward_layers(
        self,
        layers: Sequence[int],
        cache,
        input_ids: Tensor,  # [B, Q] int64
        positions: Tensor,  # [B, Q] int64
        visible: Tensor,  # [B, Q, C+Q] bool, C = columns already in `cache` (0 without one)
        logits_to_keep: int = 0,
    ) -> Tensor:  # [B, Q or logits_to_keep, V] float32
        """Logits of the target reduced to decoder ``layers`` (increasing indices), then its final
        norm and LM head: self-speculation without extra weights. ``cache`` is a transformers Cache
        whose entry i serves decoder layer i (it may hold this target's own entries: the caller
        must restore them), or None. ``logits_to_keep`` > 0 computes only the last rows' logits.
        Hidden states are not captured."""
        layers = tuple(layers)
        if layers not in self._layer_views:
            self._layer_views[layers] = layer_subset(self.model, layers)
        self._wanted = ()  # the capture hooks sit on the shared layers: keep draft rows out
        with torch.no_grad():
            out = self._layer_views[layers](
                input_ids=input_ids,
                position_ids=positions,
                attention_mask=self._attention_mask(visible),
                use_cache=cache is not None,
                logits_to_keep=logits_to_keep,
                **{self._cache_arg: cache},
            )
        return out.logits.float()

    def rewind(self, cached: Tensor, roots: Tensor) -> None:
        """Forget cached columns past ``cached`` [B] (each <= its current length) and set the
        roots [B]; how a draft model drops the draft tokens the target rejected."""
        if bool((cached > self._cached).any()):
            raise ValueError("rewind can only shorten the cache")
        self._cached, self._roots = cached, roots
        self._crop()

    def _crop(self, width: int | None = None) -> None:
        """Drop the cache's columns past ``width`` (default: the longest request's length)."""
        if width is None:
            width = int(self._cached.max()) if self._cached.numel() else 0
        # a negative crop removes that many columns in every transformers 5.x version
        surplus = self._cache.get_seq_length() - width
        if surplus > 0:
            self._cache.crop(-surplus)


def _additive(visible: Tensor, dtype: torch.dtype) -> Tensor:  # [B, Q, K] bool -> [B, 1, Q, K]
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min)[:, None]


def _sliding_window(config) -> tuple[int | None, tuple[str, ...] | None]:
    """(window, per-layer kinds): (None, None) without sliding attention, (w, None) when every
    layer slides, (w, layer_types) when sliding and global layers alternate."""
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None)
    if kinds is None:
        return window, None
    unknown = set(kinds) - {"full_attention", "sliding_attention"}
    if unknown:
        raise ValueError(
            f"{config.model_type} has {sorted(unknown)} layers; HFTarget builds masks for full and "
            f"sliding-window attention only"
        )
    if "sliding_attention" not in kinds:
        return None, None
    return window, tuple(kinds)


def _column_index(columns: Tensor, like: Tensor) -> Tensor:  # [B, K] -> [B, H, K, D] for gather/scatter on dim 2
    return columns[:, None, :, None].expand(-1, like.shape[1], -1, like.shape[3])


def _stack_caches(caches: list[DynamicCache]) -> DynamicCache:
    """The rows of several DynamicCaches, in order, in the first one, each padded to the widest
    one's columns; padding columns lie past every request's length, so they stay masked."""
    first = caches[0]
    if len(caches) == 1:  # a first admission of one group: nothing to pad or append
        return first
    for index, layer in enumerate(first.layers):
        for name in ("keys", "values"):  # [B_i, H, C_i, D] each
            setattr(layer, name, cat_padded([getattr(cache.layers[index], name) for cache in caches], 2))
    return first


def _layers_path(model) -> tuple[str, ...]:
    """Attribute names from the causal LM down to its stack of decoder blocks: the shallowest
    ModuleList under the base model with one entry per hidden layer (Llama/Qwen: model.layers,
    GPT-2: transformer.h, GPT-NeoX: gpt_neox.layers, OPT: model.decoder.layers)."""
    count = model.config.num_hidden_layers
    found = [name for name, module in model.base_model.named_modules()
             if isinstance(module, torch.nn.ModuleList) and len(module) == count]
    if not found:
        raise TypeError(
            f"cannot find the decoder layers of {type(model).__name__}: no ModuleList of "
            f"num_hidden_layers = {count} blocks under model.{model.base_model_prefix}"
        )
    return (model.base_model_prefix, *min(found, key=lambda name: name.count(".")).split("."))


def decoder_layers(model) -> torch.nn.ModuleList:
    """The causal LM's decoder blocks, in order (the modules themselves: training one trains the model)."""
    module = model
    for name in _layers_path(model):
        module = getattr(module, name)
    return module


def layer_subset(model, keep: Sequence[int]) -> torch.nn.Module:
    """A view of a causal LM that runs only decoder layers ``keep`` (increasing indices). No module
    is copied, only the containers on the path to the layer list, so every weight is shared; each
    kept layer keeps its own index into a KV cache."""
    layers = decoder_layers(model)
    keep = list(keep)
    if keep != sorted(set(keep)) or not all(0 <= i < len(layers) for i in keep):
        raise ValueError(
            f"layers to keep must be distinct increasing indices in [0, {len(layers)}); got {keep}"
        )
    *containers, last = _layers_path(model)
    view = copy.copy(model)
    view._modules = dict(model._modules)
    parent, original = view, model
    for name in containers:
        original = original._modules[name]
        child = copy.copy(original)
        child._modules = dict(original._modules)
        parent._modules[name] = child
        parent = child
    parent._modules[last] = torch.nn.ModuleList([layers[i] for i in keep])
    kinds = getattr(model.config, "layer_types", None)
    if kinds is not None:
        # the base model looks a layer's attention kind up by its place in the list; the list keeps
        # its length because a cache built from this config is indexed by the layers' own indices
        base = view._modules[model.base_model_prefix]
        base.config = copy.copy(model.config)
        base.config.layer_types = [kinds[i] for i in keep] + list(kinds[len(keep) :])
    return view


def final_norm(model) -> torch.nn.Module:
    """The norm between the last block and the LM head, on the base model or beside the layer
    list (Llama/Qwen: norm; GPT-NeoX/OPT: final_layer_norm; GPT-2: ln_f; Phi: final_layernorm)."""
    owner = model
    owners = []
    for name in _layers_path(model)[:-1]:
        owner = getattr(owner, name)
        owners.append(owner)
    names = ("norm", "final_layer_norm", "ln_f", "final_layernorm")
    for owner in owners:
        norm = next((getattr(owner, n) for n in names if isinstance(getattr(owner, n, None), torch.nn.Module)), None)
        if norm is None:
            continue
        if getattr(owner, "project_out", None) is not None:
            raise TypeError(
                f"{type(model).__name__} projects its final hidden state (project_out) before the LM "
                f"head; HFTarget needs the final norm's output to be the LM head's input"
            )
        return norm
    raise TypeError(f"cannot find the final norm of {type(model).__name__} (looked for {', '.join(names)})")
