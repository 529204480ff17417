"""Weight-only quantization of a drafter's own weights (``drafter_quant``): does acceptance survive
an int8, int4 or fp8 drafter (study e)?

Fake quantization: every weight matrix of the modules a drafter declares as its own
(``DrafterBase.quantizable``) is rounded to the scheme's grid with one symmetric scale per output
row and stored back in its own dtype, so the drafts are exactly those a low-bit kernel would produce
from these weights; the speed of real low-bit kernels is not modelled. Weights the drafter shares
with the target (the frozen embeddings and LM head rows of EAGLE/MTP/Medusa/Domino, a layer-skip
drafter's layers) stay as they are: quantizing them would change the target.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from drafters.base import DrafterBase
from specdec.protocols import HeadTarget

SCHEMES = ("none", "int8", "int4", "fp8")
_LEVELS = {"int8": 127.0, "int4": 7.0}  # symmetric integer grids
_FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclass(frozen=True)
class QuantReport:
    scheme: str
    tensors: int  # weight matrices quantized
    parameters: int
    relative_error: float  # ||W - Q(W)|| / ||W|| over all of them


def quantize_rows(weight: Tensor, scheme: str) -> Tensor:  # [R, ...] -> same shape and dtype
    """Round each row (output channel) of ``weight`` to the ``scheme`` grid scaled to its max |w|."""
    if scheme not in _LEVELS and scheme != "fp8":
        raise ValueError(f"unknown quantization scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    w = weight.float().reshape(weight.shape[0], -1)
    peak = w.abs().amax(1, keepdim=True)
    top = _LEVELS.get(scheme, _FP8_MAX)
    scale = torch.where(peak > 0, peak / top, torch.ones_like(peak))
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
