"""The core's arithmetic as Triton functions, bit for bit: the noise's integer hash
(``specdec.noise.uniforms_at``), the target softmax's float32 exp (``specdec.sampling.exp_weight``),
its weights (``specdec.sampling.target_weights``) and their pairwise sum
(``specdec.sampling.pairwise_sum``).

Each is the same IEEE operations on the same operands in the same order as its torch original,
so a kernel compiled without fp fusion (``enable_fp_fusion=False``: no product and sum fused into
one multiply-add) computes the same bits on a GPU as torch on any device and as the Triton
interpreter (numpy) on CPU. tests/test_triton_verifier.py compares each with its original through a
test kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

from specdec import sampling

# float32 values (sampling makes each one exactly), so every compiler reads the same number
_EXP_CUTOFF = tl.constexpr(sampling.EXP_CUTOFF)
_LOG2E = tl.constexpr(sampling.LOG2E)
_LN2_HI = tl.constexpr(sampling.LN2_HI)
_LN2_LO = tl.constexpr(sampling.LN2_LO)
_EXP_COEFFICIENTS = tl.constexpr(sampling.EXP_COEFFICIENTS)
_EXP_TERMS = tl.constexpr(len(sampling.EXP_COEFFICIENTS))


@triton.jit
def _mul32(x, constant: tl.constexpr):
    # specdec.noise._mul32: the 32-bit product from two 16-bit halves of the constant, in int64
    return (x * (constant & 0xFFFF) + (((x * (constant >> 16)) & 0xFFFF) << 16)) & tl.full((), 0xFFFFFFFF, tl.int64)


@triton.jit
def _hash32(x):
    # specdec.noise.hash32 on an int64 in [0, 2**32)
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


@triton.jit
def _combine(state, word):
    return _hash32(state ^ (word & tl.full((), 0xFFFFFFFF, tl.int64)))


@triton.jit
def uniform(key, counter, element):
    """``specdec.noise.uniforms_at`` for one (request key, draw counter, element), all int64: the
    hash is integer arithmetic, then ``unit_interval``, so the value is the reference's bit for bit."""
    state = _combine(key, counter)
    state = _combine(state, counter >> 32)
    first = _combine(state, element)
    second = _combine(_hash32(state ^ tl.full((), 0x9E3779B9, tl.int64)), element)
    return unit_interval(first, second)


@triton.jit
def unit_interval(first, second):
    """``specdec.noise.unit_interval``: 26 bits of each word; the two float steps (+ 0.5, then
    * 2**-52) are exact, so the value is in (0, 1) and the reference's bit for bit."""
    mantissa = (first >> 6) * (1 << 26) + (second >> 6)
    return (mantissa.to(tl.float64) + tl.full((), 0.5, tl.float64)) * tl.full((), 1.0 / (1 << 52), tl.float64)


@triton.jit
def exp_weight(x):
    """``specdec.sampling.exp_weight`` of a float32 block (<= 0, -inf allowed): the same steps."""
    clamped = tl.maximum(x, _EXP_CUTOFF)
    k = tl.floor(clamped * _LOG2E + 0.5)
    r = (clamped - k * _LN2_HI) - k * _LN2_LO
    poly = tl.full(r.shape, _EXP_COEFFICIENTS[0], tl.float32)
    for i in tl.static_range(1, _EXP_TERMS):
        poly = poly * r + _EXP_COEFFICIENTS[i]
    scale = ((k.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)  # 2**k, k in [-124, 0]
    return tl.where(x >= _EXP_CUTOFF, poly * scale, 0.0)


@triton.jit
def scaled_logits(row_ptr, inverse_temperature, offsets, mask):
    """The logits times 1 / T (float32), -inf past V."""
    # widened right after the load: the interpreter computes bf16 wrongly
    return tl.load(row_ptr + offsets, mask=mask, other=-float("inf")).to(tl.float32) * inverse_temperature


@triton.jit
def target_weights(row_ptr, inverse_temperature, row_max, least_logit, least_weight, offsets, mask):
    """``specdec.sampling.target_weights`` of a row of logits: exp_weight(scaled - max) where both
    keep thresholds pass, else 0 (and 0 past V)."""
    scaled = scaled_logits(row_ptr, inverse_temperature, offsets, mask)
    weights = exp_weight(scaled - row_max)
    return tl.where((scaled < least_logit) | (weights < least_weight), 0.0, weights)


@triton.constexpr_function
def exact_log2(n):  # of a power of two
    return n.bit_length() - 1


@triton.jit
def pairwise_sum(x):
    """``specdec.sampling.pairwise_sum`` of a 1-D block whose size is a power of two: adjacent
    pairs added, level by level."""
    # reshape keeps the element order (can_reorder=False: numpy's C order in the interpreter), so
    # row i of the [n / 2, 2] view is (x[2i], x[2i + 1]), and a sum over two elements is a single
    # IEEE addition wherever the compiler puts them (in one thread, or across a shuffle): a + b and
    # b + a are the same number, so each level is exactly the reference's x[0::2] + x[1::2].
    # (tl.split would say the same, but compiled it gathers the whole block into every thread.)
    for _ in tl.static_range(exact_log2(x.shape[0])):
        x = tl.sum(tl.reshape(x, (x.shape[0] // 2, 2)), axis=1)
    return tl.reshape(x, ())
