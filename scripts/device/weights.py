"""Target weights in their exact block-quantised form, for the GPU staging (scripts/device/stage.py).

A packaged target here is the fp32 dequantisation of a GGUF, so its matrices are blocks rebuilt by
one or two float32 operations from small integer codes; stored as codes and scales they are a
fraction of their fp32 size and decode to the same bits (checked by a digest of every tensor):

- SmolLM2 (Q4_1 / Q8_0) and Gemma 3's Q8_0 and Q5_0 tensors: each block of 32 weights is
  d * q + m (q4_1, q in 0..15) or q * d (q8_0; Q5_0 is the same with q in -16..16), d and m
  float16, found from the weights alone.
- Gemma 3's Q4_K and Q6_K tensors ("k-quants"): each 32 (Q4_K) or 16 (Q6_K) weights are
  q * s - o or q * s, with s = d * scale and o = dmin * min float32 products of a float16 and a
  6- or 8-bit integer. Those cannot be told from the weights alone, so they are read from the
  GGUF's blocks (``gguf_kquant_scales``) and matched to the model's tensors by content.

A tensor of no such form is stored as it is.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

BLOCK = 32  # weights per quantisation block (GGUF Q4_1, Q8_0, Q5_0; a Q4_K sub-block)
KQUANT_BLOCK = {"q4_k": 32, "q6_k": 16}  # weights per k-quant sub-block, each with its own scale
KQUANT_LEVELS = {"q4_k": (0, 15), "q6_k": (-32, 31)}


def _fit_blocks(blocks, kind: str):
    """Scales (and minima) that rebuild every block of ``blocks`` [N, 32] float32 bit for bit as
    d * q + m (q4_1: q in 0..15) or q * d (q8_0: q in -127..127; q5_0: -16..16), d and m float16; None if some block
    is not of that form. The stored d is within a few float16 steps of the range / levels."""
    import torch

    if kind == "q4_1":
        low, high = blocks.min(1).values, blocks.max(1).values
        minimum = low.half()
        if not torch.equal(minimum.float(), low):
            return None
        first, levels, offset = ((high - low) / 15).half(), (0, 15), minimum.float()[:, None]
    else:  # q8_0: q in -127..127; q5_0: (q - 16) * d with d of either sign, so |q| <= 16
        top = 127 if kind == "q8_0" else 16
        minimum, first, levels, offset = None, (blocks.abs().max(1).values / top).half(), (-top, top), 0.0
    scale = torch.zeros_like(first)
    codes = torch.zeros(blocks.shape, dtype=torch.int16)
    found = torch.zeros(len(blocks), dtype=torch.bool)
    # a negative d (Q5_0's and Q8_0's may be) decodes a zero code to -0.0, which a positive one cannot rebuild
    signs = (1.0,) if kind == "q4_1" else (1.0, -1.0)
    for sign, step in [(sign, step) for sign in signs for step in (0, -1, 1, -2, 2)]:
        todo = (~found).nonzero().squeeze(1)  # [n] blocks no earlier candidate rebuilt
        if len(todo) == 0:
            break
        part = blocks[todo]
        candidate = (first[todo].view(torch.int16) + step).view(torch.float16).abs() * sign
        d = candidate.float()[:, None]
        shift = offset[todo] if kind == "q4_1" else 0.0
        q = torch.where(d != 0, torch.round((part - shift) / torch.where(d != 0, d, 1.0)), torch.zeros_like(part)).clamp(*levels)
        q = q.to(torch.int16).float()  # as the stored integer codes decode: no -0.0
        rebuilt = q * d + shift if kind == "q4_1" else q * d
        fits = (rebuilt.view(torch.int32) == part.view(torch.int32)).all(1)
        scale[todo[fits]], codes[todo[fits]] = candidate[fits], q[fits].to(torch.int16)
        found[todo[fits]] = True
    if not bool(found.all()):
        return None
    return scale, minimum, codes


def _pack_nibbles(codes):
    """[R, C] codes in 0..15 -> [R, C/2] uint8, two a byte (the lower one first)."""
    import torch

    nibbles = codes.to(torch.uint8)
    return (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).contiguous()


def _unpack_nibbles(packed, size: int):
    """The inverse of _pack_nibbles, as float32 codes in blocks of ``size`` ([N, size])."""
    import torch

    return torch.stack([packed & 0x0F, packed >> 4], -1).reshape(-1, size).float()


def gguf_kquant_scales(path: Path) -> dict:
    """The Q4_K / Q6_K tensors of the GGUF at ``path``: the sha256 of each one's float32
    dequantisation (the bytes a converted model folder holds) -> (kind, scale [R, C/S] float32,
    offset [R, C/S] float32 or None), S = KQUANT_BLOCK[kind]."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, GGUFReader, quants

    found = {}
    for tensor in GGUFReader(str(path)).tensors:
        if tensor.tensor_type not in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K):
            continue
        raw = np.asarray(tensor.data).view(np.uint8)  # [R, bytes per row]
        values = np.ascontiguousarray(quants.dequantize(raw, tensor.tensor_type), dtype=np.float32)  # [R, C]
        if tensor.tensor_type == GGMLQuantizationType.Q4_K:  # 144-byte blocks: d, dmin, 12 bytes of 6-bit scales/mins, codes
            blocks = raw.reshape(-1, 144)
            sc, mins = quants.Q4_K.get_scale_min(blocks[:, 4:16])  # [N, 8] each
            d, dmin = (blocks[:, a:a + 2].copy().view(np.float16).astype(np.float32) for a in (0, 2))  # [N, 1]
            kind, scale, offset = "q4_k", d * sc.astype(np.float32), dmin * mins.astype(np.float32)
        else:  # 210-byte blocks: codes (192 bytes), 16 int8 scales, d
            blocks = raw.reshape(-1, 210)
            d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)  # [N, 1]
            kind, scale, offset = "q6_k", d * blocks[:, 192:208].copy().view(np.int8).astype(np.float32), None
        rows = values.shape[0]
        found[hashlib.sha256(values.tobytes()).hexdigest()] = (
            kind, torch.from_numpy(scale.reshape(rows, -1)), None if offset is None else torch.from_numpy(offset.reshape(rows, -1)))
    return found


def _fit_kquant(tensor, kind: str, scale, offset):
    """Codes q with q * scale - offset (q4_k) or q * scale (q6_k) equal to ``tensor`` [R, C] bit for
    bit, per sub-block of KQUANT_BLOCK[kind] weights; None where some weight is not."""
    import torch

    size = KQUANT_BLOCK[kind]
    if tensor.shape[1] != scale.shape[1] * size:
        return None
    blocks = tensor.reshape(-1, size)
    s = scale.reshape(-1, 1)
    o = offset.reshape(-1, 1) if offset is not None else 0.0
    # a zero sub-scale (a 0 in the GGUF's 6- or 8-bit scales) decodes a negative code to -0.0
    zero = torch.where(blocks.signbit(), -1.0, 0.0) if offset is None else 0.0
    q = torch.where(s != 0, torch.round((blocks + o) / torch.where(s != 0, s, 1.0)), zero).clamp(*KQUANT_LEVELS[kind])
    q = q.to(torch.int16).float()  # as the stored integer codes decode: no -0.0
    rebuilt = q * s - o if offset is not None else q * s
    if not torch.equal(rebuilt.view(torch.int32), blocks.view(torch.int32)):
        return None
    return q.to(torch.int16).reshape(tensor.shape)


def encode_weights(state: dict, kquants: dict | None = None) -> dict:
    """{name: tensor} -> the flat dict of tensors a safetensors file holds: ``q4_1/NAME/{codes,scale,min}``,
    ``q8_0/NAME/{codes,scale}`` for float32 matrices whose rows are such blocks (Q5_0's too),
    ``q4_k/NAME/{codes,scale,offset}`` and ``q6_k/NAME/{codes,scale}`` for those ``kquants``
    (gguf_kquant_scales) describes, ``raw/NAME`` for the rest."""
    import torch

    encoded = {}
    for name, tensor in state.items():
        fitted = None
        if kquants and tensor.dtype == torch.float32 and tensor.ndim == 2:
            known = kquants.get(hashlib.sha256(tensor.contiguous().numpy().tobytes()).hexdigest())
            codes = known and _fit_kquant(tensor, *known)
            if codes is not None:
                kind, scale, offset = known
                if kind == "q4_k":
                    encoded[f"q4_k/{name}/codes"] = _pack_nibbles(codes)  # [R, C/2]
                    encoded[f"q4_k/{name}/offset"] = offset.contiguous()  # [R, C/32] float32
                else:
                    encoded[f"q6_k/{name}/codes"] = codes.to(torch.int8)  # [R, C]
                encoded[f"{kind}/{name}/scale"] = scale.contiguous()  # [R, C/S] float32
                continue
        if tensor.dtype == torch.float32 and tensor.ndim == 2 and tensor.shape[1] % BLOCK == 0:
            blocks = tensor.reshape(-1, BLOCK)
            for kind in ("q4_1", "q8_0", "q5_0"):
                fitted = _fit_blocks(blocks, kind)
                if fitted is not None:
                    break
        if fitted is None:
            encoded[f"raw/{name}"] = tensor.contiguous()
            continue
        scale, minimum, codes = fitted
        rows = tensor.shape[0]
        if kind == "q4_1":
            encoded[f"q4_1/{name}/codes"] = _pack_nibbles(codes.view(rows, -1))  # [R, C/2]
            encoded[f"q4_1/{name}/min"] = minimum.view(rows, -1)  # [R, C/32] float16
        else:
            kind = "q8_0"  # q5_0 blocks are q8_0 blocks with smaller codes
            encoded[f"q8_0/{name}/codes"] = codes.to(torch.int8).view(rows, -1)  # [R, C]
        encoded[f"{kind}/{name}/scale"] = scale.view(rows, -1)  # [R, C/32] float16
    return encoded


def decode_weights(encoded: dict) -> dict:
    """The inverse of encode_weights, on the CPU: the same float32 products and sums (no fused
    multiply-add), so the weights come back bit for bit."""
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
        if kind in KQUANT_BLOCK:
            if kind == "q4_k":
                q = _unpack_nibbles(tensor, KQUANT_BLOCK[kind])  # [N, 32]
                state[name] = (q * d - encoded[f"{kind}/{name}/offset"].reshape(-1, 1)).reshape(rows, -1)
            else:
                state[name] = (tensor.float().reshape(-1, KQUANT_BLOCK[kind]) * d).reshape(rows, -1)
        elif kind == "q4_1":
            q = _unpack_nibbles(tensor, BLOCK)  # [N, 32]
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
