"""Target weights in their exact block-quantised form, for the GPU staging (experiments.train.device.stage).

SmolLM2 here is the fp32 dequantisation of a Q4_1/Q8_0 GGUF, so each block of 32 weights is exactly
d * q + m (or d * q) for fp16 d, m and 4-bit (8-bit) q: stored that way it is about a fifth of its
fp32 size and decodes to the same bits (checked by a digest of every tensor). A tensor that is not
such blocks is stored as it is.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

BLOCK = 32  # weights per quantisation block (GGUF Q4_1 and Q8_0)



def _fit_blocks(blocks, kind: str):
    """Scales (and minima) that rebuild every block of ``blocks`` [N, 32] float32 bit for bit as
    d * q + m (q4_1: q in 0..15) or q * d (q8_0: q in -127..127), d and m float16; None if some block
    is not of that form. The stored d is within a few float16 steps of the range / levels."""
    import torch

    if kind == "q4_1":
        low, high = blocks.min(1).values, blocks.max(1).values
        minimum = low.half()
        if not torch.equal(minimum.float(), low):
            return None
        first, levels, offset = ((high - low) / 15).half(), (0, 15), minimum.float()[:, None]
    else:
        minimum, first, levels, offset = None, (blocks.abs().max(1).values / 127).half(), (-127, 127), 0.0
    scale = torch.zeros_like(first)
    codes = torch.zeros(blocks.shape, dtype=torch.int16)
    found = torch.zeros(len(blocks), dtype=torch.bool)
    for step in (0, -1, 1, -2, 2):
        todo = (~found).nonzero().squeeze(1)  # [n] blocks no earlier candidate rebuilt
        if len(todo) == 0:
            break
        part = blocks[todo]
        candidate = (first[todo].view(torch.int16) + step).view(torch.float16).abs()
        d = candidate.float()[:, None]
        shift = offset[todo] if kind == "q4_1" else 0.0
        q = torch.where(d > 0, torch.round((part - shift) / d.clamp(min=1e-30)), torch.zeros_like(part)).clamp(*levels)
        q = q.to(torch.int16).float()  # as the stored integer codes decode: no -0.0
        rebuilt = q * d + shift if kind == "q4_1" else q * d
        fits = (rebuilt.view(torch.int32) == part.view(torch.int32)).all(1)
        scale[todo[fits]], codes[todo[fits]] = candidate[fits], q[fits].to(torch.int16)
        found[todo[fits]] = True
    if not bool(found.all()):
        return None
    return scale, minimum, codes


def encode_weights(state: dict) -> dict:
    """{name: tensor} -> the flat dict of tensors a safetensors file holds: ``q4_1/NAME/{codes,scale,min}``,
    ``q8_0/NAME/{codes,scale}`` for float32 matrices whose rows are such blocks, ``raw/NAME`` for the rest."""
    import torch

    encoded = {}
    for name, tensor in state.items():
        fitted = None
        if tensor.dtype == torch.float32 and tensor.ndim == 2 and tensor.shape[1] % BLOCK == 0:
            blocks = tensor.reshape(-1, BLOCK)
            for kind in ("q4_1", "q8_0"):
                fitted = _fit_blocks(blocks, kind)
                if fitted is not None:
                    break
        if fitted is None:
            encoded[f"raw/{name}"] = tensor.contiguous()
            continue
        scale, minimum, codes = fitted
        rows = tensor.shape[0]
        if kind == "q4_1":
            nibbles = codes.to(torch.uint8).view(rows, -1)
            encoded[f"q4_1/{name}/codes"] = (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).contiguous()  # [R, C/2]
            encoded[f"q4_1/{name}/min"] = minimum.view(rows, -1)  # [R, C/32] float16
        else:
            encoded[f"q8_0/{name}/codes"] = codes.to(torch.int8).view(rows, -1)  # [R, C]
        encoded[f"{kind}/{name}/scale"] = scale.view(rows, -1)  # [R, C/32] float16
    return encoded


def decode_weights(encoded: dict) -> dict:
    """The inverse of encode_weights, on the CPU: the same float32 products and sums (no fused
    multiply-add), so the weights come back bit for bit."""
    import torch

    state = {}
    for key, tensor in encoded.items():
        kind, name = key.split("/", 1)
        if kind == "raw":
            state[name] = tensor
            continue
        name, part = name.rsplit("/", 1)
        if part != "codes":
            continue
        rows = tensor.shape[0]
        d = encoded[f"{kind}/{name}/scale"].float().reshape(-1, 1)  # [N, 1]
        if kind == "q4_1":
            q = torch.stack([tensor & 0x0F, tensor >> 4], -1).reshape(-1, BLOCK).float()  # [N, 32]
            state[name] = (q * d + encoded[f"{kind}/{name}/min"].float().reshape(-1, 1)).reshape(rows, -1)
        else:
            state[name] = (tensor.float().reshape(-1, BLOCK) * d).reshape(rows, -1)
    return state


def weights_digest(state: dict) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order."""
    import torch

    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def read_weights(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"--model {model_dir}: no *.safetensors weights (save the model with save_pretrained)")
    state = {}
    for file in files:
        state.update(load_file(str(file)))
    return state
