"""Tree verifier as one Triton kernel launch: the same decisions as ``verifiers.reference``.

Terms (as in the reference): x is a candidate node's token and u its coin (``noise.uniforms``);
p' is the *residual target distribution* at the current node, q' the *residual draft distribution*
of the sibling group being tried. A *source* is where p' or q' lives: a row of an input (the
target's logits, or ``draft_probs``) until a rejection changes it, then one of the request's two
fp64 *scratch* rows. Keeping the source lazy means an accepted node costs two passes over its own
row of logits (the row's max, then its mass) and a handful of scalar loads; only a rejection
rewrites a row.

p is computed here, for the rows the walk visits (the root's and each accepted node's), from the
logits: the weights of ``specdec.sampling.target_weights`` (the logits times 1 / T, the float32
``exp_weight`` of their distance to the row's max, zero where top-k's or top-p's cut drops them)
over their pairwise mass. The other rows of a wide tree are never read. Top-k and top-p rank the
whole row, so their cuts come from a torch pre-pass over every row, two numbers per row
(``keep_thresholds``); plain temperature sampling has no pre-pass.

A visited row's statistics (its max and mass; greedy: its argmax) come either from the walk's own
passes over it, in the request's one block, or, with ``split``, from ``verifiers.triton_rows``'
pre-pass, which reads every row with V split across blocks so small batches use the whole device;
``triton_rows.splits`` picks by batch and tree size. The values are the same either way.

One program walks one request. Per candidate node it loads p'(x) and q'(x) and tests
``u * q'(x) < p'(x)``; on rejection it rewrites p' (and q' for SAMPLED_WOR) in ONE pass over the
vocabulary in tiles of BLOCK_V, so V = 151,936 never sits in one block: the pass writes the
unnormalised residual and sums its mass as it goes, and every later read divides by that mass,
which is the very division the reference's ``normalise`` does once, so the values are the same
bit for bit. The new residual goes to the other of two scratch rows, so p' is still there when
the new one has no mass. A point-mass rejection of an x with p'(x) = 0 rewrites nothing, as in the
reference. The final token is drawn from p' with the request's final uniform, down the pairwise
tree as the reference's ``draw_from``: the tile masses, then the tree over them, then the tree
within the chosen tile.

The noise a run draws (``HashedNoise``) reaches the kernel as each request's key and counter: the
walk hashes the coin of each node it tries, and the final uniform, in registers (``uniform``, the
same integer hash and the same two float roundings as ``specdec.noise.uniforms_at``), so no noise
tensor is built or read. Fixed noise (``GivenNoise``) is read from its tensors.

Greedy (T = 0) computes no probabilities at all: the target of a visited row is its argmax, one
pass over that row's logits, and a one-hot p' is never rewritten (x outside it removes no mass, x
itself leaves none, and an empty residual keeps p'), so a candidate costs a comparison with the
argmax and the next token is the argmax of the row the walk ends on.

The tree's width N is a runtime argument that Triton does not specialise on, so a run compiles one
kernel per (sampling rule, sibling mode, vocabulary, logits dtype, split or not), all in its untimed warm-up
pass, and never again when the drafter's tree changes size.

Exactness, by construction: on the same (tree, logits, sampling, noise), on one device, the
outputs equal the reference's bit for bit (``torch.equal``), because every float64 value a decision
reads is the result of the same IEEE operations on the same operands, in the same order:

- p: the reference's rows are ``specdec.sampling.target_probabilities``, whose every step is one
  IEEE operation that ``verifiers.triton_arith`` repeats (the scaling, the subtraction of the max,
  each step of ``exp_weight``, the keep comparisons with the same thresholds, the widening, the
  pairwise mass, the division); a max is exact in any order. Greedy's argmax is the first index
  of the row's max, as torch's argmax in ``probabilities`` (widening bf16 changes no order);
- element-wise: the widening to float64, p' - q', the relu, zeroing x, the division by the mass
  (correctly rounded: ``div.rn.f64``; clamped as the reference clamps), ``u * q'(x) < p'(x)`` and
  u * total are each one rounding, and the kernel is compiled with ``enable_fp_fusion=False``, so
  no product and sum (u * total - left, in the final draw) fuse into one multiply-add;
- sums: every normalising mass is the reference's ``pairwise_sum``: the tree within each aligned
  tile of BLOCK_V (a power of two), then the same tree over the tile sums, their count zero-padded
  to a power of two, which is that tree over the row zero-padded to a power of two (masked loads
  read 0.0 past V, where the reference pads with 0.0; a zero subtree adds exactly nothing);
  ``triton_arith.pairwise_sum`` says why Triton's reshape and sum keep the tree;
- the rules: the same point-mass test, the same skipped rewrite for a point mass with p'(x) = 0,
  the same p' kept where a rejection leaves no mass, and the same descent for the final token
  (every node's mass a pairwise sum, every step one comparison and one subtraction).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from specdec.noise import HashedNoise, VerifyNoise
from specdec.protocols import VerifyResult
from specdec.sampling import SamplingParams, inverse_temperature, keep_thresholds
from specdec.tree import DraftTree, SiblingMode
from verifiers.triton_arith import exact_log2, pairwise_sum, scaled_logits, target_weights, uniform
from verifiers.triton_rows import row_statistics, split_row_argmax, split_row_stats, splits


@triton.jit
def _load_draft(row_ptr, scratch_ptr, from_scratch, mass, offsets, mask):
    """fp64 values of q', held either in a row of draft_probs (any float dtype) or, unnormalised,
    in scratch with its mass: the division happens here, at each read, as ``_normalised`` would
    have done once, so the value is the same bit for bit."""
    # the interpreter computes bf16 wrongly: widen right after the load
    row = tl.load(row_ptr + offsets, mask=mask & ~from_scratch, other=0.0).to(tl.float32)
    own = tl.load(scratch_ptr + offsets, mask=mask & from_scratch, other=0.0)
    return tl.where(from_scratch, _normalised(own, mass, own), row.to(tl.float64))


@triton.jit
def _load_target(
    logits, residual_row, V, inverse_temperature, row_max, least_logit, least_weight, scratch_ptr, mass, offsets, mask
):
    """fp64 values of p', either row ``residual_row`` of the target (its weights, computed here
    from the logits) or, when residual_row < 0, unnormalised in scratch; over its mass either way,
    divided at each read as the reference's ``target_probabilities`` and ``normalise`` divide once."""
    from_scratch = residual_row < 0
    row_ptr = logits + tl.maximum(residual_row, 0) * V
    weights = target_weights(
        row_ptr, inverse_temperature, row_max, least_logit, least_weight, offsets, mask & ~from_scratch
    ).to(tl.float64)
    own = tl.load(scratch_ptr + offsets, mask=mask & from_scratch, other=0.0)
    values = tl.where(from_scratch, own, weights)
    return _normalised(values, mass, values)


@triton.jit
def _row_argmax(row_ptr, V, BLOCK_V: tl.constexpr):
    """The first index of a row's largest logit (as torch's argmax, which ``probabilities`` takes
    for greedy): each tile's first maximum, and a later tile wins only if strictly larger. Widening
    bf16 to float32 changes no order."""
    best = tl.full((), -float("inf"), tl.float32)
    choice = tl.zeros((), tl.int64)
    for start in range(0, V, BLOCK_V):
        offsets = start + tl.arange(0, BLOCK_V)
        values = tl.load(row_ptr + offsets, mask=offsets < V, other=-float("inf")).to(tl.float32)
        tile_best = tl.max(values, axis=0)
        better = tile_best > best
        choice = tl.where(better, start + tl.argmax(values, axis=0, tie_break_left=True).to(tl.int64), choice)
        best = tl.where(better, tile_best, best)
    return choice


@triton.jit
def _argmax_at(logits, tile_best, tile_first, index, V, SPLIT: tl.constexpr, BLOCK_V: tl.constexpr,
               NUM_TILES: tl.constexpr):
    """Greedy's target at row ``index``: its argmax, from its tiles' when SPLIT, else one pass."""
    if SPLIT:
        choice = split_row_argmax(tile_best, tile_first, index, V, BLOCK_V, NUM_TILES)
    else:
        choice = _row_argmax(logits + index * V, V, BLOCK_V)
    return choice


@triton.jit
def _enter_row(logits, least_logit_ptr, least_weight_ptr, inverse_temperature, tile_best, tile_mass, index, V,
               SPLIT: tl.constexpr, BLOCK_V: tl.constexpr, NUM_TILES: tl.constexpr):
    """p at row ``index``: its keep thresholds, max and mass, the reference's
    ``target_probabilities`` for that row. From its tiles' statistics when SPLIT, else two passes
    over its logits (the max, then the pairwise sum of its weights, tile by tile as
    pairwise_sum). Returns (its max, its two thresholds, its mass)."""
    least_logit, least_weight = tl.load(least_logit_ptr + index), tl.load(least_weight_ptr + index)
    if SPLIT:
        row_max, mass = split_row_stats(tile_best, tile_mass, index, V, BLOCK_V, NUM_TILES)
    else:
        row_ptr = logits + index * V
        row_max = tl.full((), -float("inf"), tl.float32)
        for start in range(0, V, BLOCK_V):
            offsets = start + tl.arange(0, BLOCK_V)
            scaled = scaled_logits(row_ptr, inverse_temperature, offsets, offsets < V)
            row_max = tl.maximum(row_max, tl.max(scaled, axis=0))
        tiles = tl.arange(0, NUM_TILES)
        masses = tl.zeros((NUM_TILES,), tl.float64)
        for start in range(0, V, BLOCK_V):
            offsets = start + tl.arange(0, BLOCK_V)
            weights = target_weights(
                row_ptr, inverse_temperature, row_max, least_logit, least_weight, offsets, offsets < V
            ).to(tl.float64)
            masses = tl.where(tiles == start // BLOCK_V, pairwise_sum(weights), masses)
        mass = pairwise_sum(masses)
    return row_max, least_logit, least_weight, mass


@triton.jit
def _normalised(values, total, empty):
    # as the reference's normalise, which clamps the mass to the smallest normal float64; rows
    # without mass become ``empty``
    tiny = tl.full((), 2.2250738585072014e-308, tl.float64)
    return tl.where(total > 0, values / tl.maximum(total, tiny), empty)


@triton.jit
def _reject(
    logits, residual_row, inverse_temperature, row_max, least_logit, least_weight, residual, mass, rewritten,
    drafts, draft_row, draft_residual, draft_mass, token, point_mass, V, DETERMINISTIC: tl.constexpr,
    WITHOUT_REPLACEMENT: tl.constexpr, BLOCK_V: tl.constexpr, NUM_TILES: tl.constexpr,
):
    """One pass over the vocabulary: writes the unnormalised p'' = relu(p' - q') (p' with x zeroed
    for a point mass) into ``rewritten``, the other scratch row than p''s own, so p' survives if
    p'' has no mass; for SAMPLED_WOR also q'' = q' with x zeroed, in place. Returns both masses:
    the pairwise sum of each tile (zero past V), then of the tile sums (zero past the last tile)."""
    tiles = tl.arange(0, NUM_TILES)
    masses = tl.zeros((NUM_TILES,), tl.float64)
    draft_masses = tl.zeros((NUM_TILES,), tl.float64)
    for start in range(0, V, BLOCK_V):
        offsets = start + tl.arange(0, BLOCK_V)
        mask = offsets < V
        p = _load_target(
            logits, residual_row, V, inverse_temperature, row_max, least_logit, least_weight, residual, mass, offsets,
            mask,
        )
        zeroed = tl.where(offsets == token, 0.0, p)
        new_p = zeroed
        if not DETERMINISTIC:
            q = _load_draft(
                drafts + tl.maximum(draft_row, 0) * V, draft_residual, draft_row < 0, draft_mass, offsets, mask
            )
            new_p = tl.where(point_mass, zeroed, tl.maximum(p - q, 0.0))
            if WITHOUT_REPLACEMENT:
                # read and written by the same thread, element by element: in place is safe
                new_q = tl.where(offsets == token, 0.0, q)
                tl.store(draft_residual + offsets, new_q, mask=mask)
                draft_masses = tl.where(tiles == start // BLOCK_V, pairwise_sum(new_q), draft_masses)
        tl.store(rewritten + offsets, new_p, mask=mask)
        masses = tl.where(tiles == start // BLOCK_V, pairwise_sum(new_p), masses)
    # the next scalar load of p'(x) or q'(x) may read an element another thread just wrote
    tl.debug_barrier()
    return pairwise_sum(masses), pairwise_sum(draft_masses)


@triton.jit(do_not_specialize=["N"])
def _verify_tree_kernel(
    logits_ptr,  # [B, N+1, V] any float dtype, the target's logits
    least_logit_ptr,  # [B, N+1] float32, each row's top-k threshold (keep_thresholds; not read when GREEDY)
    least_weight_ptr,  # [B, N+1] float32, each row's top-p threshold (keep_thresholds; not read when GREEDY)
    tile_best_ptr,  # [B, N+1, NUM_TILES] float32, each tile's largest (scaled) logit (triton_rows; read when SPLIT)
    tile_first_ptr,  # [B, N+1, NUM_TILES] int64, the first index of it (triton_rows; read when SPLIT and GREEDY)
    tile_mass_ptr,  # [B, N+1, NUM_TILES] float64, each tile's mass (triton_rows; read when SPLIT, not GREEDY)
    inverse_temperature,  # float32, 1 / T rounded (not read when GREEDY)
    draft_probs_ptr,  # [B, N, V] float32 or bf16, q per node (never read when DETERMINISTIC)
    tokens_ptr,  # [B, N] int64
    parents_ptr,  # [B, N] int64, -1 = root
    num_nodes_ptr,  # [B] int64
    uniforms_ptr,  # [B, N] float64, one coin per node (GivenNoise; not read when GREEDY or HASHED)
    final_ptr,  # [B] float64 in (0, 1), the final token's uniform (GivenNoise; not read when GREEDY or HASHED)
    keys_ptr,  # [B] int64, each request's noise key (HashedNoise; read only when HASHED)
    counters_ptr,  # [B] int64, the draw of its coins; the final uniform's is the next (read only when HASHED)
    residual_ptr,  # [B, 2, V] float64 scratch: two rows for the unnormalised p' (not read when GREEDY)
    draft_residual_ptr,  # [B, V] float64 scratch for the unnormalised q' (SAMPLED_WOR only)
    accepted_nodes_ptr,  # [B, N] int64, out, pre-filled with -1
    num_accepted_ptr,  # [B] int64, out
    next_token_ptr,  # [B] int64, out
    N,  # not specialised: a tree of a new width must not compile a new kernel in the middle of a run
    V,
    GREEDY: tl.constexpr,  # the target is the one-hot argmax of each row (implies DETERMINISTIC)
    HASHED: tl.constexpr,  # the coins and the final uniform are hashed here from keys and counters
    DETERMINISTIC: tl.constexpr,
    WITHOUT_REPLACEMENT: tl.constexpr,
    SPLIT: tl.constexpr,  # each visited row's statistics come from triton_rows' pre-pass, not from passes here
    BLOCK_V: tl.constexpr,  # vocabulary tile, a power of two
    NUM_TILES: tl.constexpr,  # cdiv(V, BLOCK_V) rounded up to a power of two
):
    b = tl.program_id(0).to(tl.int64)
    logits = logits_ptr + b * (N + 1) * V
    least_logits = least_logit_ptr + b * (N + 1)
    least_weights = least_weight_ptr + b * (N + 1)
    tile_best = tile_best_ptr + b * (N + 1) * NUM_TILES
    tile_first = tile_first_ptr + b * (N + 1) * NUM_TILES
    tile_mass = tile_mass_ptr + b * (N + 1) * NUM_TILES
    drafts = draft_probs_ptr + b * N * V
    scratch = residual_ptr + b * 2 * V
    draft_residual = draft_residual_ptr + b * V
    num_nodes = tl.load(num_nodes_ptr + b)

    current = tl.full((), -1, tl.int64)  # node whose children are being tried, -1 = root
    num_accepted = tl.zeros((), tl.int64)
    residual_row = tl.zeros((), tl.int64)  # p' source: a row of the target, or -1 = scratch
    own_row = tl.zeros((), tl.int64)  # which of the two scratch rows holds p' when it is in scratch
    # the target row's max scaled logit and keep thresholds, and p''s mass (of the row or scratch)
    row_max = tl.zeros((), tl.float32)
    least_logit = tl.zeros((), tl.float32)
    least_weight = tl.zeros((), tl.float32)
    mass = tl.full((), 1.0, tl.float64)
    row_choice = tl.zeros((), tl.int64)  # greedy: the argmax of p''s row
    if GREEDY:
        row_choice = _argmax_at(logits, tile_best, tile_first, residual_row, V, SPLIT, BLOCK_V, NUM_TILES)
    else:
        row_max, least_logit, least_weight, mass = _enter_row(
            logits, least_logits, least_weights, inverse_temperature, tile_best, tile_mass, residual_row, V, SPLIT,
            BLOCK_V, NUM_TILES,
        )
    draft_row = tl.full((), -1, tl.int64)  # q' source once the group has a rejection: row or -1
    draft_mass = tl.full((), 1.0, tl.float64)  # q''s mass when in scratch
    group_is_new = tl.full((), 1, tl.int1)  # no sibling of this group rejected yet: q' = own q
    # parents precede children and siblings are in rank order, so one pass over node indices
    # visits every node in the order the walk would try it
    for i in range(0, num_nodes):
        node = tl.cast(i, tl.int64)
        if tl.load(parents_ptr + b * N + node) == current:
            # clamped as in the reference; the upper clamp only keeps a bad token inside memory
            token = tl.minimum(tl.maximum(tl.load(tokens_ptr + b * N + node), 0), V - 1)
            if GREEDY:
                # the one-hot p'(x); no rejection changes a one-hot p' (x outside it removes no
                # mass, x itself leaves none, and an empty residual keeps p'), so it stays a row
                p_x = tl.where(row_choice == token, 1.0, 0.0).to(tl.float64)
            else:
                p_x = _load_target(
                    logits, residual_row, V, inverse_temperature, row_max, least_logit, least_weight,
                    scratch + own_row * V, mass, token, True,
                )
            if DETERMINISTIC:
                q_row = node  # DETERMINISTIC has no q: _reject never reads this row
                point_mass = tl.full((), 1, tl.int1)
                q_x = tl.full((), 1.0, tl.float64)
            else:
                q_row = tl.where(group_is_new, node, draft_row)
                q_x = _load_draft(drafts + tl.maximum(q_row, 0) * V, draft_residual, q_row < 0, draft_mass, token, True)
                # q'(x) = 0: a WOR group drawn past q's support, so x is tried as a point mass
                point_mass = q_x == 0
                q_x = tl.where(point_mass, 1.0, q_x)
            if GREEDY:
                u = tl.full((), 0.5, tl.float64)  # with a one-hot p', p'(x) alone decides: any coin in (0, 1)
            elif HASHED:
                u = uniform(tl.load(keys_ptr + b), tl.load(counters_ptr + b), node)
            else:
                u = tl.load(uniforms_ptr + b * N + node)
            if u * q_x < p_x:
                tl.store(accepted_nodes_ptr + b * N + num_accepted, node)
                num_accepted += 1
                current = node
                residual_row = node + 1
                group_is_new = tl.full((), 1, tl.int1)
                # p at the accepted node: the only rows whose argmax or softmax is computed
                if GREEDY:
                    row_choice = _argmax_at(logits, tile_best, tile_first, residual_row, V, SPLIT, BLOCK_V, NUM_TILES)
                else:
                    row_max, least_logit, least_weight, mass = _enter_row(
                        logits, least_logits, least_weights, inverse_temperature, tile_best, tile_mass, residual_row,
                        V, SPLIT, BLOCK_V, NUM_TILES,
                    )
            else:
                # a point-mass rejection of an x with p'(x) = 0 (and q'(x) = 0) removes no mass: p'
                # and q' keep their sources, as in the reference. Every greedy rejection is of this
                # kind (a one-hot p' accepts x unless p'(x) = 0, as u < 1): greedy rewrites nothing.
                if not GREEDY:
                    if (p_x > 0) | ~point_mass:
                        total, draft_total = _reject(
                            logits, residual_row, inverse_temperature, row_max, least_logit, least_weight,
                            scratch + own_row * V, mass, scratch + (1 - own_row) * V, drafts, q_row, draft_residual, draft_mass, token, point_mass, V,
                            DETERMINISTIC, WITHOUT_REPLACEMENT, BLOCK_V, NUM_TILES,
                        )
                        # p'' becomes p' only if it has mass; else p' stays (as the reference)
                        if total > 0:
                            residual_row = tl.full((), -1, tl.int64)
                            own_row = 1 - own_row
                            mass = total
                        if WITHOUT_REPLACEMENT:
                            q_row = tl.full((), -1, tl.int64)
                            draft_mass = draft_total
                # q' for the group's next sibling: q itself for i.i.d. siblings (and unchanged by
                # a rejection that removed nothing), scratch after a WOR rewrite
                draft_row = q_row
                group_is_new = tl.full((), 0, tl.int1)
    tl.store(num_accepted_ptr + b, num_accepted)

    if GREEDY:
        # a draw from a one-hot p' is its one, whatever the uniform
        tl.store(next_token_ptr + b, row_choice)
    else:
        # a draw from p' with the final uniform, as the reference's draw_from: the mass of each tile
        # (the tree within it), then down the tree over the tile masses, then within the chosen tile
        masses = tl.zeros((NUM_TILES,), tl.float64)
        tiles = tl.arange(0, NUM_TILES)
        for start in range(0, V, BLOCK_V):
            offsets = start + tl.arange(0, BLOCK_V)
            p = _load_target(
                logits, residual_row, V, inverse_temperature, row_max, least_logit, least_weight,
                scratch + own_row * V, mass, offsets, offsets < V,
            )
            masses = tl.where(tiles == start // BLOCK_V, pairwise_sum(p), masses)
        if HASHED:
            final = uniform(tl.load(keys_ptr + b), tl.load(counters_ptr + b) + 1, tl.zeros((), tl.int64))
        else:
            final = tl.load(final_ptr + b)
        target = final * pairwise_sum(masses)
        tile, target = _descend(masses, target, NUM_TILES)
        offsets = tile * BLOCK_V + tl.arange(0, BLOCK_V)
        p = _load_target(
            logits, residual_row, V, inverse_temperature, row_max, least_logit, least_weight,
            scratch + own_row * V, mass, offsets, offsets < V,
        )
        index, _ = _descend(p, target, BLOCK_V)
        tl.store(next_token_ptr + b, tile * BLOCK_V + index)


@triton.jit
def _descend(values, target, SIZE: tl.constexpr):
    """One descent of ``draw_from`` over a block of SIZE (a power of two) values whose tree is the
    pairwise one: a node's mass is the pairwise sum of its aligned range with the rest zeroed, which
    adds only exact zeros to the same tree. Returns (index in the block, what is left of target)."""
    positions = tl.arange(0, SIZE)
    index = tl.zeros((), tl.int64)
    for level in tl.static_range(exact_log2(SIZE)):
        half = SIZE >> (level + 1)
        left = pairwise_sum(tl.where((positions >= index) & (positions < index + half), values, 0.0))
        right = pairwise_sum(tl.where((positions >= index + half) & (positions < index + 2 * half), values, 0.0))
        go_right = (target >= left) & (right > 0)
        target = tl.where(go_right, target - left, target)
        index = tl.where(go_right, index + half, index)
    return index, target


def given_coins(noise: VerifyNoise, max_nodes: int) -> Tensor:  # [B, N] float64, contiguous
    """Node i's coin is column i, as the torch verifiers read it; the kernel reads row b at b * N, so
    wider noise is cut to N columns, and narrower noise (nodes without a coin) is refused."""
    if noise.uniforms.shape[1] < max_nodes:
        raise ValueError(f"the noise has coins for {noise.uniforms.shape[1]} of the tree's {max_nodes} slots: "
                         "draw it with VerifyNoise.draw(rng, tree.max_nodes)")
    return noise.uniforms[:, :max_nodes].contiguous()


# triton decides at decoration time, from TRITON_INTERPRET, whether kernels run interpreted
_INTERPRETED = isinstance(_verify_tree_kernel, InterpretedFunction)


def verify(
    tree: DraftTree,
    target_logits: Tensor,  # [B, N+1, V]
    sampling: SamplingParams,
    noise: VerifyNoise,
    block_v: int = 2048,  # vocabulary tile, a power of two: 4096 spills registers on sm_90 at T > 0
    split: bool | None = None,  # the rows' statistics from a pre-pass with V split across blocks; None: ``splits``
) -> VerifyResult:
    if block_v < 1 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two; got {block_v}")
    if target_logits.device.type != "cuda" and not _INTERPRETED:
        raise RuntimeError(
            "the Triton verifier needs CUDA tensors; on CPU use verifiers.reference.verify, or set "
            "TRITON_INTERPRET=1 before triton is imported to run the kernel in the interpreter"
        )
    batch, max_nodes = tree.tokens.shape
    vocab = target_logits.shape[-1]
    device = target_logits.device
    greedy = sampling.greedy
    deterministic = greedy or tree.mode is SiblingMode.DETERMINISTIC
    without_replacement = not deterministic and tree.mode is SiblingMode.SAMPLED_WOR
    accepted_nodes = torch.full((batch, max_nodes), -1, dtype=torch.int64, device=device)
    num_accepted = torch.empty(batch, dtype=torch.int64, device=device)
    next_token = torch.empty(batch, dtype=torch.int64, device=device)
    # greedy reads no noise, so it has one variant; unused pointers get a tensor of the right type,
    # never read (torch.empty launches nothing on a GPU)
    hashed = isinstance(noise, HashedNoise) and not greedy
    unused, unused_int = (torch.empty(1, dtype=dtype, device=device) for dtype in (torch.float64, torch.int64))
    uniforms, final = (unused, unused) if hashed or greedy else (given_coins(noise, max_nodes), noise.final.contiguous())
    keys, counters = (noise.keys.contiguous(), noise.counters.contiguous()) if hashed else (unused_int, unused_int)
    # the kernel computes p (greedy: the argmax) from the logits, for the rows its walk visits
    logits = target_logits.contiguous()  # [B, N+1, V]
    if greedy:
        # the one-hot target of a row is its argmax: no probabilities and no scratch
        least_logit = least_weight = draft_probs = residual = draft_residual = unused
        scale = 1.0
    else:
        # the kernel computes p from the logits for the rows its walk visits; top-k and top-p need
        # the whole row ranked, so their cuts come from torch, two numbers per row
        least_logit, least_weight = (t.contiguous() for t in keep_thresholds(target_logits, sampling))  # [B, N+1, 1]
        scale = inverse_temperature(sampling)
        draft_probs = unused if deterministic else tree.draft_probs.contiguous()  # [B, N, V]; DETERMINISTIC has no q
        residual = torch.empty(batch, 2, vocab, dtype=torch.float64, device=device)  # [B, 2, V]
        draft_residual = torch.empty(batch, vocab, dtype=torch.float64, device=device) if without_replacement else residual
    block_v = min(block_v, triton.next_power_of_2(vocab))
    num_tiles = triton.next_power_of_2(triton.cdiv(vocab, block_v))
    if split is None:
        split = splits(batch, max_nodes, device)
    tile_best, tile_first, tile_mass = unused, unused_int, unused
    if split:
        tile_best, tile_second = row_statistics(logits, least_logit, least_weight, scale, greedy, block_v, num_tiles)
        tile_first, tile_mass = (tile_second, unused) if greedy else (unused_int, tile_second)
    _verify_tree_kernel[(batch,)](
        logits,
        least_logit,
        least_weight,
        tile_best,
        tile_first,
        tile_mass,
        scale,
        draft_probs,
        tree.tokens.contiguous(),
        tree.parents.contiguous(),
        tree.num_nodes.contiguous(),
        uniforms,
        final,
        keys,
        counters,
        residual,
        draft_residual,
        accepted_nodes,
        num_accepted,
        next_token,
        max_nodes,
        vocab,
        GREEDY=greedy,
        HASHED=hashed,
        DETERMINISTIC=deterministic,
        WITHOUT_REPLACEMENT=without_replacement,
        SPLIT=split,
        BLOCK_V=block_v,
        NUM_TILES=num_tiles,
        num_warps=8,
        enable_fp_fusion=False,  # every product is rounded before it is added (the module docstring)
    )
    return VerifyResult(accepted_nodes, num_accepted, next_token)
