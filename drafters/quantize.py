"""Quantization of a drafter's own weights (``drafter_quant``): does acceptance survive an int8,
int4 or fp8 drafter, and what does a low-bit drafter really cost (study e)?

int8, int4, fp8 are fake quantization: every weight matrix of the modules a drafter declares as its
own (``DrafterBase.quantizable``) is rounded to the scheme's grid with one symmetric scale per output
row and stored back in its own dtype, so the drafts are exactly those a weight-only low-bit kernel
would produce from these weights, at the cost of the unquantized drafter.

int8_kernels runs real int8 GEMMs: each of those modules' nn.Linear layers becomes torch's
dynamically quantized linear (the weights on the int8 grid above, stored as int8; the activations
quantized per call, which moves the drafts a little further than weight-only rounding). A CPU
float32 drafter only, as torch's quantized kernels are; its drafter time is what int8 costs here.

Weights the drafter shares with the target (the frozen embeddings and LM head rows of
EAGLE/MTP/Medusa/Domino, a layer-skip drafter's layers) stay as they are: quantizing them would
change the target.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.ao.nn.quantized.dynamic import Linear as Int8Linear

from drafters.base import DrafterBase
from specdec.protocols import HeadTarget

SCHEMES = ("none", "int8", "int4", "fp8", "int8_kernels")
_LEVELS = {"int8": 127.0, "int4": 7.0}  # symmetric integer grids
_FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclass(frozen=True)
class QuantReport:
    scheme: str
    tensors: int  # weight matrices quantized
    parameters: int
    relative_error: float  # ||W - Q(W)|| / ||W|| over all of them (weights only)


def row_scales(w: Tensor, top: float) -> Tensor:  # [R, C] float32 -> [R, 1]
    """One symmetric scale per row mapping its max |w| to ``top`` (1 for an all-zero row)."""
    peak = w.abs().amax(1, keepdim=True)
    return torch.where(peak > 0, peak / top, torch.ones_like(peak))


def quantize_rows(weight: Tensor, scheme: str) -> Tensor:  # [R, ...] -> same shape and dtype
    """Round each row (output channel) of ``weight`` to the ``scheme`` grid scaled to its max |w|."""
    if scheme not in _LEVELS and scheme != "fp8":
        raise ValueError(f"unknown quantization scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    w = weight.float().reshape(weight.shape[0], -1)
    top = _LEVELS.get(scheme, _FP8_MAX)
    scale = row_scales(w, top)
    if scheme == "fp8":
        grid = (w / scale).to(torch.float8_e4m3fn).float()
    else:
        grid = (w / scale).round().clamp(-top, top)
    return (grid * scale).reshape(weight.shape).to(weight.dtype)


def quantize_drafter(drafter: DrafterBase, target: HeadTarget, scheme: str) -> QuantReport:
    """Quantize, in place, every weight matrix (2-D or more) of ``drafter.quantizable()`` but those
    it shares with the target (a draft model given the target's own model object), which must stay
    as they are for the output to stay exact."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    if scheme == "none":
        return QuantReport("none", 0, 0, 0.0)
    shared = {p.data_ptr() for p in target.model.parameters()}
    if scheme == "int8_kernels":
        return int8_kernels(drafter, shared)
    owned = {id(p): p for module in drafter.quantizable() for p in module.parameters()
             if p.dim() >= 2 and p.data_ptr() not in shared}
    if not owned:
        raise ValueError(
            f"drafter {type(drafter).__name__} has no weights of its own to quantize (it drafts with the "
            f"target's weights or none); drafter_quant applies to trained heads and draft models"
        )
    squared_error = squared_norm = 0.0
    with torch.no_grad():
        for p in owned.values():
            q = quantize_rows(p, scheme)
            squared_error += float((p.float() - q.float()).pow(2).sum())
            squared_norm += float(p.float().pow(2).sum())
            p.copy_(q)
    parameters = sum(p.numel() for p in owned.values())
    return QuantReport(scheme, len(owned), parameters, (squared_error / max(squared_norm, 1e-30)) ** 0.5)


def int8_linear(linear: nn.Linear) -> Int8Linear:
    """``linear`` (an nn.Linear or a subclass such as cpu_kernels.PackedLinear) as torch's dynamically
    quantized int8 linear, its weight rounded per row as quantize_rows(..., "int8") rounds it."""
    w = linear.weight.detach().float()  # [out, in]
    scale = row_scales(w, _LEVELS["int8"]).squeeze(1)  # [out]
    zero = torch.zeros(w.shape[0], dtype=torch.long)  # [out]: symmetric
    # quantizing the values already on the grid lands on the same integers whatever rounding
    # torch's own quantizer uses (each is within an ulp of an integer multiple of its row's scale)
    on_grid = quantize_rows(w, "int8")  # [out, in]
    quantized = Int8Linear(linear.in_features, linear.out_features, bias_=linear.bias is not None, dtype=torch.qint8)
    bias = None if linear.bias is None else linear.bias.detach().float()
    quantized.set_weight_bias(torch.quantize_per_channel(on_grid, scale.double(), zero, 0, torch.qint8), bias)
    return quantized


def int8_kernels(drafter: DrafterBase, shared: set[int]) -> QuantReport:
    """Swap every nn.Linear of ``drafter.quantizable()`` whose weight is not the target's (its
    data pointer not in ``shared``) for int8_linear; only a float32 CPU drafter has these kernels."""
    swaps = [
        (parent, name, child)
        for module in drafter.quantizable()
        for parent in module.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear) and child.weight.data_ptr() not in shared
    ]
    if not swaps:
        raise ValueError(
            f"drafter {type(drafter).__name__} has no linear layers of its own for drafter_quant=int8_kernels"
        )
    weights = [child.weight for _, _, child in swaps]
    if any(w.device.type != "cpu" or w.dtype != torch.float32 for w in weights):
        raise ValueError(
            "drafter_quant=int8_kernels runs torch's int8 CPU kernels, which take a float32 drafter on a CPU; "
            "use drafter_quant=int8 (weights rounded, drafter kept in its dtype) for others"
        )
    squared_error = squared_norm = 0.0
    for parent, name, child in swaps:
        quantized = int8_linear(child)
        w = child.weight.detach().float()
        squared_error += float((w - quantized.weight().dequantize()).pow(2).sum())
        squared_norm += float(w.pow(2).sum())
        setattr(parent, name, quantized)
    parameters = sum(w.numel() for w in weights)
    return QuantReport("int8_kernels", len(swaps), parameters, (squared_error / max(squared_norm, 1e-30)) ** 0.5)
