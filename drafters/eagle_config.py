"""The configuration every EAGLE head shares, native (drafters.eagle) and published
(drafters.eagle_published): a leaf, so the head modules and the layouts in drafters.formats read it
without importing each other."""

from __future__ import annotations

from dataclasses import dataclass

from drafters.heads import target_shape
from specdec.protocols import HeadTarget

ARCHS = ("native", "eagle1", "eagle3")


@dataclass(frozen=True)
class EagleConfig:
    hidden_size: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    feature_layers: tuple[int, ...]  # target layers fused into the input (EAGLE-1: final norm only)
    draft_vocab_size: int  # tokens the head may draft (EAGLE-3's reduced vocabulary; = vocab_size for all)
    target_num_layers: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    target: str = ""  # where the target came from, for error messages
    # which function the head computes: "native" (EagleHead, every bundled head) or a published
    # architecture computed exactly as its reference code does (PublishedEagleHead): "eagle1" (EAGLE-1/2)
    # or "eagle3" (EAGLE-3); only the published ones have a layout serving engines load (specdec-export)
    arch: str = "native"
    num_kv_heads: int = 0  # published heads may share keys/values between query heads; 0 = num_heads
    head_dim: int = 0  # 0 = hidden_size // num_heads
    fc_bias: bool = False  # EAGLE-1's published fc has a bias
    norm_before_residual: bool = False  # an EAGLE-3 variant vLLM reads: the residual is the normed feature
    rope_scaling: dict | None = None  # as the published config gives it: None or {"rope_type": "llama3", ...}
    own_embedding: bool = False  # the head embeds tokens with its own table (a published one differing from the target's)
    max_position_embeddings: int = 0  # the target's, written into exported configs; 0 = unknown
    qk_norm: bool = False  # per-head RMSNorm of queries and keys before RoPE (a Qwen3 decoder layer)
    # native heads: an RMSNorm on the feature input after the fusion, as the published EAGLE-3 layer's
    # hidden_norm, for targets whose layers are far from unit scale (Gemma 3's middle layers)
    feature_norm: bool = False

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch={self.arch!r}: choose one of {', '.join(ARCHS)}")
        if self.arch == "native" and (self.num_kv_heads not in (0, self.num_heads) or self.fc_bias or self.own_embedding
                                      or self.rope_scaling or self.norm_before_residual or self.qk_norm):
            raise ValueError("arch=native heads have no grouped keys, fc bias, own embedding, RoPE scaling, "
                             "norm_before_residual or q/k norms; those belong to the published architectures (eagle1, eagle3)")
        if self.arch != "native" and self.feature_norm:
            raise ValueError(f"feature_norm belongs to arch=native heads; arch={self.arch} normalises its features itself")
        if self.arch == "eagle3" and len(self.feature_layers) != 3:
            raise ValueError(f"arch=eagle3 fuses exactly 3 target layers (its fc is 3 x hidden wide); "
                             f"got {self.feature_layers}")

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def width(self) -> int:  # one attention head's size
        return self.head_dim or self.hidden_size // self.num_heads

    @staticmethod
    def for_target(target: HeadTarget, feature_layers: tuple[int, ...] | None = None, draft_vocab_size: int | None = None,
                   arch: str = "native", feature_norm: bool = False) -> EagleConfig:
        return EagleConfig(
            **target_shape(target),
            feature_layers=tuple(feature_layers or (target.num_layers + 1,)),
            draft_vocab_size=draft_vocab_size or target.vocab_size,
            arch=arch,
            feature_norm=feature_norm,
            fc_bias=arch == "eagle1",  # as EAGLE-1 publishes its heads (SGLang reads the bias, vLLM drops it)
            max_position_embeddings=int(getattr(target.model.config, "max_position_embeddings", 0) or 0),
        )


