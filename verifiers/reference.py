"""Reference tree verifier in plain torch: the ground truth, and the CPU path.

Terms: p' is the *residual target distribution* at the current node (starts as the target's
processed distribution there), q' the *residual draft distribution* of the sibling group being
tried. The walk goes down from the root; at each node the children are tried in index order:

- SAMPLED_IID (Leviathan/Chen chain, SpecInfer multi-round tree): accept x if u * q'(x) < p'(x);
  on rejection p' <- norm(relu(p' - q')); q' stays q (siblings are i.i.d.).
- SAMPLED_WOR (Sequoia / RSD): same test; on rejection p' <- norm(relu(p' - q')) and then
  q' <- norm(q' with x zeroed), because the next sibling was drawn without replacement.
  ``draft_probs`` of every sibling holds the unmodified q(.|parent path).
- DETERMINISTIC and greedy (q is a point mass): accept x with probability p'(x); on rejection
  p'(x) <- 0, renormalise. A duplicate sibling then has p'(x) = 0 and is never accepted, which is
  the correct de-duplication (counting it twice is the bias negative controls check for). Greedy is
  this rule applied to the one-hot argmax target, so it needs no path of its own.
- A sampled sibling with q'(x) = 0 (a WOR group drawn past q's support) was not drawn from q', so it
  is tried as a point mass, which stays exact because its choice never depends on the coins.
- A point-mass rejection of an x with p'(x) = 0 already (a duplicate sibling, a DETERMINISTIC
  mismatch outside p's support, every greedy rejection) removes no mass: zeroing x changes neither
  p' nor q' (q'(x) = 0 is what made it a point mass), so both are left as they are rather than
  renormalised, which would change only rounding bits.
- A rejection that leaves relu(p' - q') without mass (p' = q' up to rounding, as when a model
  drafts for itself: the rejection had probability ~0 and only rounding made it happen) keeps p'
  as it was, as ``verifiers.block`` and ``verifiers.traversal`` do; a draw from an empty residual
  would emit token 0.

When no child is accepted (or the node has none) the next token is drawn from p' with the request's
final uniform by :func:`draw_from` (inverse CDF down the pairwise-sum tree), so the bonus and the
correction are one operation. With u in (0, 1) the strict test ``u * q < p`` accepts with
probability exactly min(1, p / q).

p itself is ``specdec.sampling.target_probabilities``, computed for the rows a walk visits (the
root's, and each accepted node's): a softmax of single IEEE operations whose mass, like every
normalising mass here, is a :func:`~specdec.sampling.pairwise_sum`, a reduction order fixed by
definition, so that ``verifiers.triton_tree`` can compute the same rows from the logits and
reproduce every decision, bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from specdec.noise import VerifyNoise
from specdec.protocols import VerifyResult
from specdec.sampling import SamplingParams, pairwise_sum, target_probabilities
from specdec.tree import DraftTree, SiblingMode


def verify(
    tree: DraftTree,
    target_logits: Tensor,  # [B, N+1, V]
    sampling: SamplingParams,
    noise: VerifyNoise,
) -> VerifyResult:
    batch, num_slots = tree.tokens.shape
    if sampling.greedy and num_slots == 0:
        # plain decoding's step: no node to try, and the draw from the root's one-hot p is its argmax;
        # the walk below would build that one-hot over the vocabulary in float64 to read it back
        return VerifyResult(tree.tokens.new_full((batch, 0), -1), tree.tokens.new_zeros(batch),
                            target_logits[:, 0].float().argmax(-1))
    deterministic = sampling.greedy or tree.mode is SiblingMode.DETERMINISTIC
    without_replacement = tree.mode is SiblingMode.SAMPLED_WOR
    valid = tree.node_valid()  # [B, N]
    rows = torch.arange(batch, device=target_logits.device)

    residual = target_probabilities(target_logits[:, 0], sampling)  # [B, V] p'
    draft_residual = torch.zeros_like(residual)  # [B, V] q' of the group being tried
    group_is_new = torch.ones(batch, dtype=torch.bool, device=residual.device)  # [B]
    current = torch.full((batch,), -1, dtype=torch.int64, device=residual.device)  # [B]
    num_accepted = torch.zeros(batch, dtype=torch.int64, device=residual.device)  # [B]
    accepted_nodes = torch.full((batch, num_slots), -1, dtype=torch.int64, device=residual.device)

    # parents precede children and siblings are in rank order, so one pass over node indices
    # visits every node in the order the walk would try it
    for i in range(num_slots):
        is_candidate = valid[:, i] & (tree.parents[:, i] == current)  # [B]
        token = tree.tokens[:, i : i + 1].clamp(min=0)  # [B, 1]
        p_x = residual.gather(1, token)[:, 0]
        if deterministic:
            q = None
            point_mass = torch.ones_like(is_candidate)
        else:
            q = torch.where(group_is_new[:, None], tree.draft_probs[:, i].double(), draft_residual)
            q_x = q.gather(1, token)[:, 0]
            point_mass = q_x == 0  # q' exhausted (WOR past its support): x did not come from q'
        q_x = torch.ones_like(p_x) if q is None else torch.where(point_mass, 1.0, q_x)
        accept = is_candidate & (noise.uniforms[:, i] * q_x < p_x)
        reject = is_candidate & ~accept
        changes = reject & ~(point_mass & (p_x == 0))  # else p' and q' stay (see the docstring)

        # a rewrite costs several passes over the vocabulary: skip it where no row needs one
        if changes.any():
            removed = residual.scatter(1, token, 0.0)
            if q is not None:
                removed = torch.where(point_mass[:, None], removed, (residual - q).clamp(min=0.0))
            residual = torch.where(changes[:, None], normalise(removed, empty=residual), residual)
        if q is not None:
            next_q = q
            if without_replacement and changes.any():
                next_q = torch.where(changes[:, None], normalise(q.scatter(1, token, 0.0)), q)
            draft_residual = torch.where(reject[:, None], next_q, draft_residual)

        accepted_nodes[rows[accept], num_accepted[accept]] = i
        num_accepted += accept
        current = torch.where(accept, i, current)
        if accept.any():  # p at the accepted node, for the rows that accepted it: only rows a walk visits
            residual = residual.index_put((accept,), target_probabilities(target_logits[accept, i + 1], sampling))
        group_is_new = (group_is_new | accept) & ~reject

    return VerifyResult(accepted_nodes, num_accepted, final_token(residual, sampling, noise))


def normalise(x: Tensor, empty: Tensor | None = None) -> Tensor:  # [B, V]
    """Each row divided by its pairwise_sum, the sum whose rounding no device or thread count changes.
    A row with no mass becomes its row of ``empty`` ([B, V]; default: it stays as it is)."""
    total = pairwise_sum(x)
    return torch.where(total > 0, x / total.clamp(min=torch.finfo(x.dtype).tiny), x if empty is None else empty)


def final_token(residual: Tensor, sampling: SamplingParams, noise: VerifyNoise) -> Tensor:  # [B, V] -> [B]
    """The correction or bonus token, drawn from the residual with the final uniform. Greedy's
    residual is one-hot, and a draw from it is its one: the argmax finds it in one pass."""
    return residual.argmax(dim=-1) if sampling.greedy else draw_from(residual, noise.final)


def draw_from(weights: Tensor, u: Tensor) -> Tensor:  # [B, V] >= 0, [B] in (0, 1) -> [B] int64
    """A token per row with probability weights / their sum, from one uniform: inverse CDF taken
    down the tree of :func:`pairwise_sum`. The target u * total starts at the root; at each node it
    goes to the right child, less the left child's mass, iff it is at least that mass and the right
    child has mass, else to the left, so it ends on a token with mass (a row without mass gives
    token 0). Every node's mass is a sum of that fixed tree and each step one subtraction, so the
    Triton kernel, which descends the same tree tile by tile, draws the same token bit for bit.

    Why not the exponential race argmax(weights / E): it needs a float64 Exp(1) row over the
    vocabulary per request (hashing V numbers and a log each), and a log the kernel computes
    exactly as torch does; this needs one uniform and additions. It runs in numpy, whose
    element-wise IEEE operations round as torch's do: the descent is a few tiny operations per
    level, each costing a torch call several times what numpy's does (on CUDA tensors, the
    reference being the fallback there, it costs one copy to the host)."""
    w = weights.detach().cpu().numpy()
    batch, width = w.shape
    level = np.zeros((batch, 1 << (width - 1).bit_length()), dtype=w.dtype)  # leaves, zero-padded
    level[:, :width] = w
    levels = [level]
    while levels[-1].shape[-1] > 1:
        levels.append(levels[-1][:, 0::2] + levels[-1][:, 1::2])
    target = u.detach().cpu().numpy() * levels[-1][:, 0]  # [B]
    rows = np.arange(batch)
    index = np.zeros(batch, dtype=np.int64)  # [B] node at the current level
    for level in reversed(levels[:-1]):
        left, right = level[rows, 2 * index], level[rows, 2 * index + 1]
        go_right = (target >= left) & (right > 0)
        target = np.where(go_right, target - left, target)
        index = 2 * index + go_right
    return torch.from_numpy(index).to(weights.device)
