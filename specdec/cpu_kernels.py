"""CPU-side changes to a Hugging Face model that make verifying a few tree rows cheaper, so
T(n)/T(1) comes closer to what the weights' memory traffic allows, or that keep a half-precision
model's outputs independent of how many rows a forward holds. They keep the model's parameters,
state dict and outputs (to float rounding); none forks modeling code.

1. ``pack_linears``: MKL's fp32 GEMM slows down markedly once a linear layer sees a few rows, while
   oneDNN's GEMM on a weight reordered once into its blocked layout stays close to the
   weight-read bound; which is faster for one row depends on the CPU, so a packed linear keeps
   both and picks by row count, from a threshold timed at load (``fastest_packed_from``). The
   timings: docs/RESULTS.md, "T(n): the target's forward cost per tree size"; the reasons:
   docs/NOTES.md, "CPU kernels without forking modeling code".
2. ``use_grouped_query_attention``: for more than one query row, transformers' SDPA path copies
   every key and value head ``num_key_value_groups`` times (repeat_kv) in every layer and step. Folding
   the query heads that share a key/value head into extra query rows computes the same attention
   without that copy (transformers already does this for one query row).
3. ``make_invariant``: a forward whose result for a row does not depend on the other rows, on
   masked keys or on where its keys sit in the cache, to the precision of the model's dtype.
   Greedy speculative decoding equals plain decoding only if a token's logits are the same
   whether it was computed alone (plain decoding) or as one row of a tree or a batch. In bfloat16
   neither stock kernel is: SDPA's output for a row moves by a rounding step with the row count
   and key layout, and GEMM kernels change with the row count, at counts that depend on the CPU
   (docs/NOTES.md, "Half precision: invariant targets" and "Kernels that depend on the CPU"; the
   greedy divergences of stock kernels: docs/RESULTS.md, "CPU-2, bfloat16 with invariant
   kernels"). Here every linear layer takes the packed GEMM in calls of at most 32 rows, checked
   at construction on the machine at hand for every layer shape (``check_rows_invariant``); only a
   shape whose one-row calls drift computes a lone row beside a copy of itself, since padding
   every layer slows plain decoding (docs/RESULTS.md, "CPU-2-AMD, float32 and bfloat16"), and
   attention runs in float64 (``invariant_sdpa``): bfloat16 products are exact in float64 and
   their sums nearly always are, so a row's result differs between layouts only by float64 rounding
   (~1e-16), far below what rounding to the model's dtype can see. A prompt's prefill needs
   none of this: it is computed in a forward of its own (HFTarget.admit), whose shapes depend on
   the prompt alone, so stock kernels give it the same bits in every decoder and batch;
   ``prompt_kernels`` switches them on for that forward (docs/RESULTS.md, "Prefill of one prompt
   (invariant bfloat16 target)").
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

GROUPED_ATTENTION = "specdec_grouped_sdpa"
INVARIANT_ATTENTION = "specdec_invariant_sdpa"
# the most rows per GEMM call in the invariant mode: oneDNN may switch kernels past it (AMX Xeons do
# in bfloat16), so make_invariant checks every call size up to it on the machine it runs on
INVARIANT_ROWS = 32
# attention arguments that change more than the mask (a per-head bias, logit softcapping,
# attention sinks): with any of them set, grouped_sdpa leaves the work to transformers
_PER_HEAD_EXTRAS = ("position_bias", "softcap", "s_aux")
# grouped_sdpa folds at most this many query rows (a tree's): a prompt's rows fill SDPA's kernel
# without folding, and the folded mask, copied once per query head of a group, then costs more
# than folding saves (docs/NOTES.md, "A busy machine, recomputable intervals, and the baseline against generate()")
FOLD_ROWS = 64
# inside prompt_kernels(): invariant layers take the fast kernels (the forward's shape is fixed)
_FIXED_SHAPE = ContextVar("specdec_fixed_shape", default=False)


@contextmanager
def prompt_kernels() -> Iterator[None]:
    """Within it, an invariant model's layers run stock-speed kernels (one packed GEMM at any row
    count, grouped SDPA): for a forward whose every shape is fixed by its input, such as one
    prompt's prefill, which then gives the same bits whenever it is computed (module docstring)."""
    token = _FIXED_SHAPE.set(True)
    try:
        yield
    finally:
        _FIXED_SHAPE.reset(token)


class PackedLinear(nn.Linear):
    """An nn.Linear that also holds its weight in oneDNN's blocked layout and uses it for inputs of
    at least ``from_rows`` rows. The weight Parameter is shared with the original module (tied
    embeddings stay tied); the packed copy is rebuilt at the first call after the weight changed in
    place (an optimizer step, load_state_dict: the tensor's version counter moved), so a drafter
    head can be evaluated between training steps."""

    def __init__(self, linear: nn.Linear, from_rows: int, call_rows: int | None = None, pad_single: bool = False) -> None:
        """call_rows, pad_single: the invariant mode (make_invariant): every packed GEMM call gets at
        most ``call_rows`` rows, and with ``pad_single`` at least 2, a lone row being computed beside
        a copy of itself, for CPUs whose one-row kernel gives other bits than larger calls
        (docs/NOTES.md, "Kernels that depend on the CPU")."""
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.from_rows, self.call_rows, self.pad_single = from_rows, call_rows, pad_single
        self._pack()

    def _pack(self) -> None:
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        self._packed_version = self.weight._version

    def forward(self, x: Tensor) -> Tensor:  # [..., in_features] -> [..., out_features]
        if x.numel() < self.from_rows * self.in_features or torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        if self.weight._version != self._packed_version:
            self._pack()
        rows = x.numel() // self.in_features
        if self.call_rows is None or _FIXED_SHAPE.get() or 1 < rows <= self.call_rows or (rows == 1 and not self.pad_single):
            return self._gemm(x)  # the common cases, without the reshape, split and copy below
        if rows == 1:
            return self._call(x.reshape(1, self.in_features)).reshape(*x.shape[:-1], self.out_features)
        chunks = x.reshape(-1, self.in_features).split(self.call_rows)
        return torch.cat([self._call(chunk) for chunk in chunks]).reshape(*x.shape[:-1], self.out_features)

    def _call(self, rows: Tensor) -> Tensor:  # [R, in_features], R <= call_rows -> [R, out_features]
        if len(rows) > 1 or not self.pad_single:
            return self._gemm(rows)
        return self._gemm(torch.cat([rows, rows]))[:1]

    def _gemm(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(
    model: nn.Module, from_rows: int, call_rows: int | None = None, pad_single: frozenset[tuple[int, int]] = frozenset()
) -> int:
    """Replace every nn.Linear of a CPU model by a PackedLinear; returns how many were replaced (0
    for a model on another device, a torch without oneDNN or a dtype this CPU's oneDNN has no
    packed GEMM for, such as float16 without AVX512-FP16 / AVX-NE-CONVERT: the option only
    concerns speed). call_rows and pad_single (the (in, out) shapes whose lone rows are padded): the
    invariant mode, see PackedLinear."""
    if from_rows < 1:
        raise ValueError(f"from_rows must be >= 1 (rows from which the packed GEMM is used); got {from_rows}")
    parameter = next(model.parameters())
    if parameter.device.type != "cpu" or not packed_gemm_available(parameter.dtype):
        return 0
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child, from_rows, call_rows, (child.in_features, child.out_features) in pad_single))
    return len(swaps)


def fastest_packed_from(model: nn.Module, max_rows: int = 8, repeats: int = 5, round_s: float = 1e-3) -> int | None:
    """The row count from which a PackedLinear should take the packed GEMM on this machine: the
    threshold that minimises the time of ``model``'s linear layers (each shape weighted by how
    often a forward calls it) summed over calls of 1..max_rows rows, timed here with the kernels
    taking turns; max_rows + 1 where the stock kernel wins throughout, None off a CPU or without
    oneDNN. It is timed rather than fixed because which kernel wins depends on the CPU, and a fixed
    threshold skewed speedups by the tree's width (docs/NOTES.md, "Kernels that depend on the CPU";
    docs/RESULTS.md, "CPU-2-AMD, float32 and bfloat16"). Each kernel's cost is the fastest of
    ``repeats`` rounds, a round being as many back-to-back calls as last about ``round_s``: a
    shared machine only ever adds time to a round, whereas a median of single calls once picked the
    slow kernel (docs/MEASURING.md, "Noise on our machines")."""
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    parameter = next(model.parameters())
    if not linears or parameter.device.type != "cpu" or not packed_gemm_available(parameter.dtype):
        return None
    counts = Counter((m.in_features, m.out_features) for m in linears)
    first = {(m.in_features, m.out_features): m for m in reversed(linears)}
    stock, packed = [0.0] * max_rows, [0.0] * max_rows  # seconds of a forward's linears at 1..max_rows rows
    with torch.no_grad():
        for shape, count in counts.items():
            layer = PackedLinear(first[shape], from_rows=1)
            for rows in range(1, max_rows + 1):
                x = torch.randn(rows, shape[0], dtype=parameter.dtype)
                times: dict[bool, list[float]] = {False: [], True: []}
                calls = 1  # the first round (one call of each kernel) warms them up and sizes the rounds
                for _ in range(repeats + 1):
                    for use_packed in (False, True):
                        begin = time.perf_counter()
                        for _ in range(calls):
                            layer(x) if use_packed else F.linear(x, layer.weight, layer.bias)
                        times[use_packed].append((time.perf_counter() - begin) / calls)
                    calls = max(1, round(round_s / max(min(times[False][-1], times[True][-1]), 1e-9)))
                stock[rows - 1] += count * min(times[False][1:])
                packed[rows - 1] += count * min(times[True][1:])
    totals = {start: sum(stock[: start - 1]) + sum(packed[start - 1 :]) for start in range(1, max_rows + 2)}
    return min(totals, key=totals.get)


def set_packed_from(model: nn.Module, from_rows: int | None) -> None:
    """Move the threshold of every PackedLinear of ``model`` (None: stock kernels at any row count),
    e.g. to A/B the two kernels on one loaded model."""
    for module in model.modules():
        if isinstance(module, PackedLinear):
            module.from_rows = 1 << 62 if from_rows is None else from_rows


@functools.cache
def packed_gemm_available(dtype: torch.dtype) -> bool:
    """Whether this torch and CPU have oneDNN's packed GEMM for ``dtype`` (private ops that torch's
    inductor uses for CPU linears; float16 needs AVX512-FP16 or AVX-NE-CONVERT, which AMD's Zen 4
    lacks)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), None)
    except (AttributeError, RuntimeError):
        return False
    return True


def grouped_sdpa(
    module: nn.Module,
    query: Tensor,  # [B, Hq, Q, D]
    key: Tensor,  # [B, Hkv, C, D]
    value: Tensor,  # [B, Hkv, C, D]
    attention_mask: Tensor | None,  # [B, 1, Q, C] additive or bool
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[Tensor, None]:  # [B, Q, Hq, D]
    """SDPA with the query heads of one key/value head folded into its query rows, for forwards of
    2 to FOLD_ROWS rows. Only an explicit mask shared by all heads carries over to folded rows, so
    without one (a causal flag instead), with per-head extras such as position biases, or at other
    row counts, this defers to transformers' own SDPA path."""
    # transformers: ~16 s to import cold; drafters.heads imports this module without it
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    key, value = keys_under_mask(attention_mask, key, value)
    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, rows, dim = query.shape
    shared_mask = attention_mask is not None and attention_mask.shape[1] == 1
    if (groups == 1 or not 1 < rows <= FOLD_ROWS or not shared_mask
            or any(kwargs.get(k) is not None for k in _PER_HEAD_EXTRAS)):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    # query head h = kv * groups + g, so [B, Hkv, G * Q, D] is a view; row g * Q + q keeps mask row q
    folded = query.reshape(batch, heads // groups, groups * rows, dim)
    mask = attention_mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(attention_mask.shape[0], 1, groups * rows, -1)
    out = F.scaled_dot_product_attention(folded, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.reshape(batch, heads, rows, dim).transpose(1, 2).contiguous(), None


def invariant_sdpa(
    module: nn.Module,
    query: Tensor,  # [B, Hq, Q, D]
    key: Tensor,  # [B, Hkv, C, D]
    value: Tensor,  # [B, Hkv, C, D]
    attention_mask: Tensor | None,  # [B, 1, Q, C] additive or bool; None = every key visible
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[Tensor, None]:  # [B, Q, Hq, D]
    """Attention computed in float64, one code path for any number of rows (module docstring)."""
    if _FIXED_SHAPE.get():
        return grouped_sdpa(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    key, value = keys_under_mask(attention_mask, key, value)
    if any(kwargs.get(k) is not None for k in _PER_HEAD_EXTRAS) or (attention_mask is None and query.shape[2] > 1):
        raise ValueError(
            "invariant attention takes an explicit mask shared by all heads and no per-head extras "
            "(position biases, softcapping, sinks); use the grouped attention for this model"
        )
    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, rows, dim = query.shape
    folded = query.reshape(batch, heads // groups, groups * rows, dim).double()
    scores = folded @ key.double().transpose(-1, -2) * (dim**-0.5 if scaling is None else scaling)  # [B, Hkv, G*Q, C]
    if attention_mask is not None:
        mask = attention_mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(attention_mask.shape[0], 1, groups * rows, -1)
        scores = scores.masked_fill(~mask, -torch.inf) if mask.dtype == torch.bool else scores + mask.double()
    top = scores.amax(-1, keepdim=True)
    weights = torch.exp(scores - torch.where(torch.isfinite(top), top, 0.0))  # masked keys: exactly 0
    out = (weights @ value.double()) / weights.sum(-1, keepdim=True)
    return out.to(query.dtype).reshape(batch, heads, rows, dim).transpose(1, 2).contiguous(), None


def keys_under_mask(
    attention_mask: Tensor | None,  # [B, 1, Q, K'] additive or bool
    key: Tensor,  # [B, Hkv, C, D]
    value: Tensor,  # [B, Hkv, C, D]
) -> tuple[Tensor, Tensor]:  # [B, Hkv, K', D] each
    """The keys and values a mask covers: a mask narrower than the cache covers its last columns.
    HFTarget cuts a sliding-window layer's mask to the columns some row can see, so that its
    attention reads no column every row masks (a long context would otherwise cost a sliding layer
    as much as a global one); only the attention functions here know that convention, so HFTarget
    cuts masks only for models switched to them."""
    if attention_mask is None or attention_mask.shape[-1] >= key.shape[2]:
        return key, value
    return key[:, :, -attention_mask.shape[-1] :], value[:, :, -attention_mask.shape[-1] :]


def uses_own_attention(model: nn.Module) -> bool:
    """Whether ``model`` runs one of the attention functions here (grouped or invariant SDPA)."""
    return getattr(model.config, "_attn_implementation", None) in (GROUPED_ATTENTION, INVARIANT_ATTENTION)


def use_grouped_query_attention(model: nn.Module) -> bool:
    """Switch a model that uses transformers' SDPA attention to ``grouped_sdpa``; returns whether
    it did (models on another attention implementation, or a transformers that cannot switch a
    loaded model, are left alone)."""
    return _switch_attention(model, GROUPED_ATTENTION, grouped_sdpa)


def make_invariant(model: nn.Module) -> None:
    """Packed GEMMs in calls of at most INVARIANT_ROWS rows for every linear layer (a lone row
    padded to two for layer shapes whose one-row kernel differs) and float64 attention, so a row's outputs do not depend on the rest of the forward (module docstring).
    CPU models on transformers' SDPA attention only, and only where this machine's kernels give
    every layer shape the same bits at every call size (``check_rows_invariant``): raises
    ValueError otherwise, before changing the model."""
    parameter = next(model.parameters())
    stock = "; or set invariant=false for stock kernels (greedy output may then drift from plain decoding)"
    if parameter.device.type != "cpu":
        raise ValueError(f"an invariant target runs on oneDNN's CPU kernels; this model is on {parameter.device}{stock}")
    if not packed_gemm_available(parameter.dtype):
        raise ValueError(
            f"this CPU's oneDNN has no packed GEMM for {parameter.dtype}, which an invariant target needs "
            f"(float16 needs AVX512-FP16 or AVX-NE-CONVERT){stock}"
        )
    projections = sorted({type(m).__name__ for m in model.modules() if type(m).__name__ == "Conv1D"})
    extras = [name for name in ("attn_logit_softcapping",) if getattr(model.config, name, None) is not None]
    if projections or extras:
        raise ValueError(
            f"an invariant target covers nn.Linear layers and plain masked attention; this model has "
            f"{', '.join(projections + extras)}{stock}"
        )
    if getattr(model.config, "_attn_implementation", None) != "sdpa" or not hasattr(model, "set_attn_implementation"):
        raise ValueError(
            f"an invariant target replaces transformers' SDPA attention, but this model uses "
            f"{getattr(model.config, '_attn_implementation', None)!r}; load it with attn_implementation='sdpa'{stock}"
        )
    shapes = {(m.in_features, m.out_features): m for m in model.modules() if type(m) is nn.Linear}
    pad_single = set()  # shapes whose one-row calls take another kernel than larger calls (AMD's Zen 4)
    for shape, linear in shapes.items():
        if not check_rows_invariant(PackedLinear(linear, 1, INVARIANT_ROWS)):
            continue
        drift = check_rows_invariant(PackedLinear(linear, 1, INVARIANT_ROWS, pad_single=True))
        if drift:
            raise ValueError(
                f"on this CPU oneDNN's packed {parameter.dtype} GEMM gives a row of a {shape[0]} -> {shape[1]} "
                f"layer other bits in calls of {drift} rows than alone, so rows cannot be computed as if alone "
                f"here{stock}"
            )
        pad_single.add(shape)
    _switch_attention(model, INVARIANT_ATTENTION, invariant_sdpa)
    pack_linears(model, 1, INVARIANT_ROWS, frozenset(pad_single))


def check_rows_invariant(linear: PackedLinear) -> list[int]:
    """The row counts at which ``linear`` gives some row other bits than when that row is its only
    input; [] when there are none. Every call size of 2 .. call_rows is tried (larger inputs are
    split into such calls), and two inputs that are split; a lone row is computed as the layer
    computes it (padded where ``pad_single``). Which kernel oneDNN picks depends on
    the CPU and the shapes, not on the weights' values, so random rows in the layer's dtype probe it
    (a changed summation order flips some bfloat16 roundings among the ~10^4 outputs of a call)."""
    sizes = [*range(2, linear.call_rows + 1), linear.call_rows + 1, 2 * linear.call_rows + 1]
    rows = torch.randn(sizes[-1], linear.in_features, generator=torch.Generator().manual_seed(0)).to(linear.weight.dtype)
    with torch.no_grad():
        alone = torch.cat([linear(row[None]) for row in rows])
        return [n for n in sizes if not torch.equal(linear(rows[:n]), alone[:n])]


def _switch_attention(model: nn.Module, name: str, function) -> bool:
    # transformers: ~16 s to import cold; drafters.heads imports this module without it
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if getattr(model.config, "_attn_implementation", None) != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return False
    AttentionInterface.register(name, function)
    # without a mask function of its own, transformers would build no mask at all for a custom
    # attention (padding and sliding windows lost in direct calls of the model)
    AttentionMaskInterface.register(name, sdpa_mask)
    model.set_attn_implementation(name)
    return True
