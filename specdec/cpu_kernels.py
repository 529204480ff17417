"""Two CPU-side changes to a Hugging Face model that make verifying a few tree rows cheaper, so
T(n)/T(1) comes closer to what the weights' memory traffic allows. Both keep the model's
parameters, state dict and outputs (to float rounding); neither forks modeling code.

1. ``pack_linears``: MKL's fp32 GEMM for a transposed weight switches, on the AVX-512 CPUs we
   measured, to a kernel about 1.8x slower than its GEMV once a linear layer sees 4 or more rows.
   oneDNN's GEMM on a weight reordered once into its blocked layout stays close to the weight-read
   bound for small row counts but is slower than MKL's GEMV for 1-3 rows. A packed linear therefore
   keeps both and picks by row count: plain decoding (1 row) keeps the stock kernel.
2. ``use_grouped_query_attention``: for more than one query row, transformers' SDPA path copies
   every key and value head ``num_key_value_groups`` times (repeat_kv) in every layer and step. Folding
   the query heads that share a key/value head into extra query rows computes the same attention
   without that copy (transformers already does this for one query row).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

GROUPED_ATTENTION = "specdec_grouped_sdpa"
# attention arguments that change more than the mask (a per-head bias, logit softcapping,
# attention sinks): with any of them set, grouped_sdpa leaves the work to transformers
_PER_HEAD_EXTRAS = ("position_bias", "softcap", "s_aux")


class PackedLinear(nn.Linear):
    """An nn.Linear that also holds its weight in oneDNN's blocked layout and uses it for inputs of
    at least ``from_rows`` rows. The weight Parameter is shared with the original module (tied
    embeddings stay tied); the packed copy is a snapshot: repack after changing the weights."""

    def __init__(self, linear: nn.Linear, from_rows: int) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.from_rows = from_rows
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)

    def forward(self, x: Tensor) -> Tensor:  # [..., in_features] -> [..., out_features]
        if x.numel() < self.from_rows * self.in_features or torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module, from_rows: int) -> int:
    """Replace every nn.Linear of a CPU model by a PackedLinear; returns how many were replaced (0
    for a model on another device or a torch without oneDNN: the option only concerns CPUs)."""
    if from_rows < 1:
        raise ValueError(f"from_rows must be >= 1 (rows from which the packed GEMM is used); got {from_rows}")
    if next(model.parameters()).device.type != "cpu" or not _packed_gemm_available():
        return 0
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child, from_rows))
    return len(swaps)


def set_packed_from(model: nn.Module, from_rows: int | None) -> None:
    """Move the threshold of every PackedLinear of ``model`` (None: stock kernels at any row count),
    e.g. to A/B the two kernels on one loaded model."""
    for module in model.modules():
        if isinstance(module, PackedLinear):
            module.from_rows = 1 << 62 if from_rows is None else from_rows


def _packed_gemm_available() -> bool:
    # private ops (torch's inductor uses them for CPU linears): a torch without them keeps MKL
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight, torch.ops.mkldnn._linear_pointwise  # noqa: B018
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
    """SDPA with the query heads of one key/value head folded into its query rows. Only an explicit
    mask shared by all heads carries over to folded rows, so without one (a causal flag instead),
    or with per-head extras such as position biases, this defers to transformers' own SDPA path."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, rows, dim = query.shape
    shared_mask = attention_mask is not None and attention_mask.shape[1] == 1
    if groups == 1 or rows == 1 or not shared_mask or any(kwargs.get(k) is not None for k in _PER_HEAD_EXTRAS):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    # query head h = kv * groups + g, so [B, Hkv, G * Q, D] is a view; row g * Q + q keeps mask row q
    folded = query.reshape(batch, heads // groups, groups * rows, dim)
    mask = attention_mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(attention_mask.shape[0], 1, groups * rows, -1)
    out = F.scaled_dot_product_attention(folded, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.reshape(batch, heads, rows, dim).transpose(1, 2).contiguous(), None


def use_grouped_query_attention(model: nn.Module) -> bool:
    """Switch a model that uses transformers' SDPA attention to ``grouped_sdpa``; returns whether
    it did (models on another attention implementation, or a transformers that cannot switch a
    loaded model, are left alone)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if getattr(model.config, "_attn_implementation", None) != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return False
    AttentionInterface.register(GROUPED_ATTENTION, grouped_sdpa)
    # without a mask function of its own, transformers would build no mask at all for a custom
    # attention (padding and sliding windows lost in direct calls of the model)
    AttentionMaskInterface.register(GROUPED_ATTENTION, sdpa_mask)
    model.set_attn_implementation(GROUPED_ATTENTION)
    return True
