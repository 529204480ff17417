"""EAGLE heads of the published architectures, computed exactly as their reference code computes
them (SafeAILab/EAGLE cnets1.py / cnets.py, the vLLM and SGLang llama_eagle*.py models):
``EagleConfig.arch`` eagle1 (EAGLE-1/2) and eagle3 (EAGLE-3, SpecForge). drafters.formats.eagle
reads them from published checkpoints and writes them for serving engines; drafters.eagle drafts
with them through the same EagleDrafter as its native head.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from drafters.eagle_config import EagleConfig
from drafters.heads import RMSNorm, causal_rows, draft_lm_head, register_draft_ids
from specdec.protocols import HeadTarget


class LlamaNorm(RMSNorm):
    """RMSNorm computed in float32 and cast back before the weight, as the published heads' code does
    (identical to RMSNorm in float32; in bfloat16 it rounds where their code rounds)."""

    def forward(self, x: Tensor) -> Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rope_frequencies(width: int, theta: float, scaling: dict | None) -> Tensor:  # [width / 2] float32
    """RoPE inverse frequencies of a head of ``width``, with Llama-3 frequency scaling when
    ``scaling`` says rope_type llama3: wavelengths longer than the original context divided by
    low_freq_factor slow down by ``factor``, those shorter than it / high_freq_factor stay, and
    those between are interpolated linearly in the inverse wavelength."""
    half = width // 2
    frequencies = 1.0 / theta ** (torch.arange(half, dtype=torch.float32) / half)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return frequencies
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelengths = 2 * math.pi / frequencies
    blend = ((context / wavelengths - low) / (high - low)).clamp(0, 1)  # 0: slowed fully, 1: unchanged
    scaled = (1 - blend) * frequencies / factor + blend * frequencies
    slowed = torch.where(wavelengths > context / low, frequencies / factor, scaled)
    return torch.where(wavelengths < context / high, frequencies, slowed)


def rotate_with(x: Tensor, positions: Tensor, frequencies: Tensor) -> Tensor:  # [B, h, R, D], [B, R], [D/2]
    """rotate() with given inverse frequencies (the half-split Llama layout)."""
    half = x.shape[-1] // 2
    angles = positions[:, None, :, None].float() * frequencies.to(x.device)  # [B, 1, R, D/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], -1)


class PublishedEagleHead(nn.Module):
    """A published EAGLE head computing exactly what its reference code computes (SafeAILab/EAGLE
    cnets1.py / cnets.py, the vLLM and SGLang llama_eagle*.py models). Parameters are named as in the
    published checkpoints, less their layer prefix (drafters.formats.eagle maps the names).

    - arch eagle1: fc(cat(embedding, feature)) with a bias, then a Llama layer WITHOUT an input norm
      (residual = the fc output); its output h goes through the target's LM head as it is.
    - arch eagle3: fc fuses 3 target layers into one feature f (the head's own h, fed back when
      drafting, skips fc); attention reads cat(input_layernorm(embedding), hidden_norm(f)) (2H wide),
      the residual is f (hidden_norm(f) with norm_before_residual); the head has its own final norm and
      LM head over its draft vocabulary; h, before that norm, is what is fed back.
    Both: grouped keys/values (num_kv_heads), SwiGLU MLP behind post_attention_layernorm; with
    qk_norm (a Qwen3 decoder layer, as speculators builds eagle3 heads for Qwen3 targets) each query
    and key head is RMS-normed over its width before RoPE."""

    def __init__(self, config: EagleConfig, draft_ids: Tensor | None = None) -> None:
        super().__init__()
        if config.arch not in ("eagle1", "eagle3"):
            raise ValueError(f"PublishedEagleHead computes arch eagle1 or eagle3, not {config.arch!r}")
        self.config = config
        register_draft_ids(self, draft_ids, config.draft_vocab_size)
        h, c, eps = config.hidden_size, config, config.rms_eps
        self.eagle3 = config.arch == "eagle3"
        if self.eagle3:
            self.fc = nn.Linear(h * len(c.feature_layers), h, bias=False)
            self.input_layernorm, self.hidden_norm = LlamaNorm(h, eps), LlamaNorm(h, eps)
        else:
            self.fc = nn.Linear(2 * h, h, bias=c.fc_bias)
        attention_in = 2 * h if self.eagle3 else h
        self.q_proj = nn.Linear(attention_in, c.num_heads * c.width, bias=False)
        self.k_proj = nn.Linear(attention_in, c.kv_heads * c.width, bias=False)
        self.v_proj = nn.Linear(attention_in, c.kv_heads * c.width, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.width, h, bias=False)
        if c.qk_norm:
            self.q_norm, self.k_norm = LlamaNorm(c.width, eps), LlamaNorm(c.width, eps)
        self.post_attention_layernorm = LlamaNorm(h, eps)
        self.gate_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, h, bias=False)
        if self.eagle3:
            self.norm = LlamaNorm(h, eps)
            self.lm_head = nn.Linear(h, c.draft_vocab_size, bias=False)
        if c.own_embedding:
            self.embed_tokens = nn.Embedding(c.vocab_size, h)
        # a plain float32 attribute, not a buffer: casting the head to 16 bits must not round the frequencies
        self.frequencies = rope_frequencies(c.width, c.rope_theta, c.rope_scaling)  # [width / 2]

    def rows(self, features: Tensor, embeddings: Tensor, positions: Tensor, keys: Tensor | None, values: Tensor | None,
             mask: Tensor, write: Tensor | None = None) -> Tensor:  # [B, R, H]
        """As EagleHead.rows: features [B, R, 3H] (target layers, eagle3), [B, R, H] (a feature or the
        head's own h), embeddings [B, R, H]; the cache holds kv_heads heads."""
        if self.eagle3:
            if features.shape[-1] != embeddings.shape[-1]:
                features = self.fc(features)
            normed = self.hidden_norm(features)
            residual = normed if self.config.norm_before_residual else features
            x = torch.cat([self.input_layernorm(embeddings), normed], -1)  # [B, R, 2H]
        else:
            x = residual = self.fc(torch.cat([embeddings, features], -1))
        c, (b, r, _) = self.config, x.shape
        q = self.q_proj(x).view(b, r, c.num_heads, c.width).transpose(1, 2)
        k = self.k_proj(x).view(b, r, c.kv_heads, c.width).transpose(1, 2)
        v = self.v_proj(x).view(b, r, c.kv_heads, c.width).transpose(1, 2)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate_with(q, positions, self.frequencies), rotate_with(k, positions, self.frequencies)
        if keys is None:
            keys, values = k, v
        else:
            index = write[:, None, :, None].expand(-1, c.kv_heads, -1, c.width)
            keys.scatter_(2, index, k)
            values.scatter_(2, index, v)
        groups = c.num_heads // c.kv_heads
        if groups > 1:  # query head i reads key/value head i // groups
            keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
        attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None])  # [B, heads, R, D]
        h = residual + self.o_proj(attended.transpose(1, 2).reshape(b, r, c.num_heads * c.width))
        normed = self.post_attention_layernorm(h)
        return h + self.down_proj(F.silu(self.gate_proj(normed)) * self.up_proj(normed))

    def forward_sequence(self, features: Tensor, embeddings: Tensor) -> Tensor:
        """Training: as EagleHead.forward_sequence."""
        return self.rows(features, embeddings, *causal_rows(features))

    def draft_logits(self, h: Tensor) -> Tensor:  # [..., H] -> [..., K]
        """eagle3: the head's own final norm and LM head over its draft vocabulary."""
        return self.lm_head(self.norm(h))

    def logits_module(self, target: HeadTarget) -> nn.Module:
        """h [..., H] -> draft logits [..., K]: eagle3's own norm + LM head, eagle1 the target's rows."""
        if self.eagle3:
            return nn.Sequential(self.norm, self.lm_head)
        return draft_lm_head(target, self.draft_ids)
