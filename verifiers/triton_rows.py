"""The statistics of every row of the target's logits with V split across blocks, for the tree
kernel to read instead of computing them in its walk (``verifiers.triton_tree``, ``split=True``).

Why: the walk is sequential within a request, so ``triton_tree`` gives each request one block,
which reads each row it visits (the root's and each accepted node's) in passes of BLOCK_V tiles,
one after another. At small batch that leaves most of the device idle. Here one program takes one
(row, tile): every row of every request, all tiles at once, so the reads spread over the whole
device, and the walk is left with a few loads per visited row. The price: every row is read, where
the walk reads only the rows it visits. ``splits`` says which side of that trade a step is on.

What a row's statistics are, with the same values as the walk's own passes (a max is exact in
any order; a sum follows ``specdec.sampling.pairwise_sum``'s tree):
- greedy: each tile's largest logit (widened to float32) and the first index holding it; the
  walk's argmax is the first index of the row's largest (torch's argmax, as ``_row_argmax``);
- T > 0: each tile's largest scaled logit, then, given the row's max over them and its keep
  thresholds, each tile's pairwise mass of ``target_weights``: the walk's row mass is the pairwise
  sum of these tile masses (padded with zeros to a power of two), as ``_enter_row`` sums them.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from verifiers.triton_arith import pairwise_sum, scaled_logits, target_weights

# A walk visits about depth + 1 rows of a request with one block; the split reads all N + 1 rows of
# every request over every multiprocessor. Per multiprocessor the work is equal when B (N + 1) rows
# = multiprocessors x (depth + 1); the walk's single block also leaves each multiprocessor's
# memory pipeline mostly idle, so this rows-per-multiprocessor bound (about the rows an accepted
# path of EAGLE-sized depth visits) is the cautious side of the trade. benchmarks/bench_verify times
# both ways so a GPU can move it.
ROWS_PER_MULTIPROCESSOR = 4


def splits(batch: int, nodes: int, device: torch.device) -> bool:
    """Whether a step of ``batch`` trees of ``nodes`` nodes reads its rows' statistics split
    across blocks (see ROWS_PER_MULTIPROCESSOR); the interpreter counts as one multiprocessor."""
    return batch * (nodes + 1) <= ROWS_PER_MULTIPROCESSOR * _multiprocessors(device)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


@triton.jit
def _tile_best_kernel(
    logits_ptr,  # [R, V] any float dtype, R = B (N + 1) rows
    inverse_temperature,  # float32 (not read when GREEDY)
    tile_best_ptr,  # [R, NUM_TILES] float32, out: each tile's largest (scaled, at T > 0) logit
    tile_first_ptr,  # [R, NUM_TILES] int64, out: the first index of it (written only when GREEDY)
    V,
    GREEDY: tl.constexpr,
    BLOCK_V: tl.constexpr,
    NUM_TILES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    offsets = tile * BLOCK_V + tl.arange(0, BLOCK_V)
    if GREEDY:
        values = tl.load(logits_ptr + row * V + offsets, mask=offsets < V, other=-float("inf")).to(tl.float32)
        first = tile * BLOCK_V + tl.argmax(values, axis=0, tie_break_left=True).to(tl.int64)
        tl.store(tile_first_ptr + row * NUM_TILES + tile, first)
    else:
        values = scaled_logits(logits_ptr + row * V, inverse_temperature, offsets, offsets < V)
    tl.store(tile_best_ptr + row * NUM_TILES + tile, tl.max(values, axis=0))


@triton.jit
def _row_best(tile_best_ptr, row, V, BLOCK_V: tl.constexpr, NUM_TILES: tl.constexpr):
    # the row's largest value over its tiles' (exact in any order); also the tile indices and the
    # mask of the real tiles, which callers need beside it
    tiles = tl.arange(0, NUM_TILES)
    real = tiles < tl.cdiv(V, BLOCK_V)
    best = tl.load(tile_best_ptr + row * NUM_TILES + tiles, mask=real, other=-float("inf"))
    return tl.max(best, axis=0), best, tiles, real


@triton.jit
def _tile_mass_kernel(
    logits_ptr,  # [R, V] any float dtype
    least_logit_ptr,  # [R] float32, each row's top-k threshold (keep_thresholds)
    least_weight_ptr,  # [R] float32, each row's top-p threshold (keep_thresholds)
    inverse_temperature,  # float32
    tile_best_ptr,  # [R, NUM_TILES] float32, from _tile_best_kernel
    tile_mass_ptr,  # [R, NUM_TILES] float64, out: each tile's pairwise mass of target_weights
    V,
    BLOCK_V: tl.constexpr,
    NUM_TILES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    row_max, _, _, _ = _row_best(tile_best_ptr, row, V, BLOCK_V, NUM_TILES)
    offsets = tile * BLOCK_V + tl.arange(0, BLOCK_V)
    weights = target_weights(
        logits_ptr + row * V, inverse_temperature, row_max, tl.load(least_logit_ptr + row),
        tl.load(least_weight_ptr + row), offsets, offsets < V,
    )
    tl.store(tile_mass_ptr + row * NUM_TILES + tile, pairwise_sum(weights.to(tl.float64)))


@triton.jit
def split_row_argmax(tile_best_ptr, tile_first_ptr, row, V, BLOCK_V: tl.constexpr, NUM_TILES: tl.constexpr):
    """The first index of row ``row``'s largest logit, from its tiles': the first tile holding
    the row's largest, its first index (``_row_argmax``'s answer: a later tile wins there only
    if strictly larger)."""
    row_best, best, tiles, real = _row_best(tile_best_ptr, row, V, BLOCK_V, NUM_TILES)
    first = tl.load(tile_first_ptr + row * NUM_TILES + tiles, mask=real, other=0)
    choice = tl.min(tl.where(real & (best == row_best), first, V), axis=0)
    # no tile matches only when the max is NaN (a broken target): stay inside the vocabulary
    return tl.where(choice < V, choice, 0)


@triton.jit
def split_row_stats(tile_best_ptr, tile_mass_ptr, row, V, BLOCK_V: tl.constexpr, NUM_TILES: tl.constexpr):
    """Row ``row``'s max scaled logit and mass, from its tiles' (``_enter_row``'s values)."""
    row_max, _, tiles, real = _row_best(tile_best_ptr, row, V, BLOCK_V, NUM_TILES)
    masses = tl.load(tile_mass_ptr + row * NUM_TILES + tiles, mask=real, other=0.0)
    return row_max, pairwise_sum(masses)


def row_statistics(
    logits: Tensor,  # [B, N+1, V] any float dtype, contiguous
    least_logit: Tensor,  # [B, N+1, 1] float32, contiguous (keep_thresholds; not read when greedy)
    least_weight: Tensor,  # [B, N+1, 1] float32, contiguous (keep_thresholds; not read when greedy)
    inverse_temperature: float,  # not read when greedy
    greedy: bool,
    block_v: int,  # a power of two
    num_tiles: int,  # cdiv(V, block_v) rounded up to a power of two
) -> tuple[Tensor, Tensor]:
    """(tile_best [B, N+1, num_tiles] float32, tile_first [B, N+1, num_tiles] int64) when greedy,
    else (tile_best, tile_mass [B, N+1, num_tiles] float64); the tiles past V are never written
    (the readers mask them)."""
    rows, vocab = logits.shape[0] * logits.shape[1], logits.shape[-1]
    grid = (rows, triton.cdiv(vocab, block_v))
    shape = (*logits.shape[:2], num_tiles)
    tile_best = torch.empty(shape, dtype=torch.float32, device=logits.device)
    second = torch.empty(shape, dtype=torch.int64 if greedy else torch.float64, device=logits.device)
    options = {"num_warps": 8, "enable_fp_fusion": False}  # no fused multiply-add (triton_arith)
    _tile_best_kernel[grid](
        logits, inverse_temperature, tile_best, second, vocab, GREEDY=greedy, BLOCK_V=block_v, NUM_TILES=num_tiles,
        **options,
    )
    if not greedy:
        _tile_mass_kernel[grid](
            logits, least_logit, least_weight, inverse_temperature, tile_best, second, vocab,
            BLOCK_V=block_v, NUM_TILES=num_tiles, **options,
        )
    return tile_best, second
