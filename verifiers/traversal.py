"""Traversal verification of draft trees (Weng et al., "Traversal Verification for Speculative Tree
Decoding", NeurIPS 2025): leaf to root, every path judged jointly, never fewer tokens kept than
token-level verification on the trees it serves.

Written as a recursion (our derivation; docs/NOTES.md), the rule is RRS with a weight per node. A
node reached with weight w and current target P (the target's processed distribution at the node,
then its residual) tries its children in index (= draw) order:

    child c, drawn from Q_c:   w_c = min(1, w P(c) / Q_c(c)), verified recursively
    c's subtree fails:         r = sum_x max(0, w P(x) - Q_c(x)),
                               P <- max(0, w P - Q_c) / r,   w <- r / (1 - w + r)
    no child left:             keep the node with probability w (one coin per node), the next
                               token drawn from P; else the node fails to its parent

The root keeps w = 1 (r / (1 - 1 + r)), so the walk always ends. Q_c is the drafter's q at the
parent for SAMPLED_IID, q with the group's earlier draws removed and renormalised for SAMPLED_WOR,
and a point mass on c for DETERMINISTIC trees, at temperature 0 and for a sampled c outside q's
support (as in verifiers.reference). On a chain this is block verification (verifiers.block) and
on a depth-1 tree it is RRS; at temperature 0 it is greedy decoding.

Exactness needs each subtree to fail with probability 1 - w whatever the LATER branches drew, so a
sampled tree's shape must not depend on tokens drawn in other branches (``DraftTree.static_shape``;
chains and DETERMINISTIC trees always qualify). EAGLE-2's sampled trees pick the groups they
expand across all branches' scores and are refused: ``drafter.shape=static`` drafts them with a
static shape. Tested at sequence level like every verifier (tests/test_traversal_verifier.py),
with two plausible mistakes as negative controls. Torch only, one host pass per request.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from specdec.noise import VerifyNoise
from specdec.protocols import VerifyResult
from specdec.sampling import SamplingParams, target_probabilities
from specdec.tree import DraftTree, SiblingMode
from verifiers.base import UnverifiableTreeError
from verifiers.reference import final_token


def verify(
    tree: DraftTree,
    target_logits: Tensor,  # [B, N+1, V]
    sampling: SamplingParams,
    noise: VerifyNoise,
) -> VerifyResult:
    batch, num_slots = tree.tokens.shape
    device = target_logits.device
    point_masses = sampling.greedy or tree.mode is SiblingMode.DETERMINISTIC or tree.draft_probs is None
    if not point_masses and not tree.static_shape and not tree.is_chain():
        raise UnverifiableTreeError(
            "verifier=traversal is exact for sampled trees only when no branch's shape depends on "
            "tokens drawn in another branch; this sampled tree does not say so (DraftTree."
            "static_shape). Draft it with drafter.shape=static (EAGLE), or use verifier=reference"
        )
    target_probs = target_probabilities(target_logits, sampling)  # [B, N+1, V]
    vocab = target_probs.shape[-1]
    rows = torch.arange(batch, device=device)
    tokens = tree.tokens.clamp(min=0)  # [B, N]
    depth = tree.depth  # [B, N], 1 for children of the root
    levels = int(depth.max()) + 1 if num_slots else 1  # the root is level 0 (an empty tree: plain decoding)
    # [B, 2N]: node entered (>= 0) or left (~node); one host read of the topology
    events = _depth_first_events(tree.parents, tree.num_nodes, num_slots)
    first_child = _first_children(tree.parents, tree.node_valid())  # [B, N]

    # per request, the open path's levels: weight w, current target P, and the q each node was drawn from
    weight = torch.ones(batch, levels, dtype=torch.float64, device=device)  # [B, L]
    target = torch.zeros(batch, levels, vocab, dtype=torch.float64, device=device)  # [B, L, V]
    target[:, 0] = target_probs[:, 0]
    drawn_from = torch.zeros_like(target)  # [B, L, V] Q_c of the node open at each level (one-hot if a point mass)
    group_q = torch.zeros_like(target)  # [B, L, V] what the next child of the node at each level is drawn from
    kept = torch.full((batch,), -1, dtype=torch.int64, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)

    for step in range(events.shape[1]):
        event = events[:, step]
        node = torch.where(event >= 0, event, ~event).clamp(min=0, max=max(num_slots - 1, 0))  # [B]
        live = (event != _NO_EVENT) & ~done
        level = depth[rows, node]  # [B] the node's level; its parent's is level - 1
        token = tokens[rows, node]
        parent_weight, parent_target = weight[rows, level - 1], target[rows, level - 1]
        enter, leave = live & (event >= 0), live & (event < 0)
        if bool(enter.any()):
            one_hot = F.one_hot(token, vocab).double()
            if point_masses:
                q = one_hot
            else:
                own_q = tree.draft_probs[rows, node].double()  # q at the parent, unmodified
                group = torch.where(first_child[rows, node][:, None], own_q, group_q[rows, level - 1])
                group_q[rows, level - 1] = torch.where(enter[:, None], group, group_q[rows, level - 1])
                q = torch.where(group.gather(1, token[:, None]) > 0, group, one_hot)  # outside q's support: a point mass
            q_token = q.gather(1, token[:, None])[:, 0]
            child_weight = _child_weight(parent_weight, parent_target.gather(1, token[:, None])[:, 0], q_token)
            weight[rows, level] = torch.where(enter, child_weight, weight[rows, level])
            target[rows, level] = torch.where(enter[:, None], target_probs[rows, node + 1], target[rows, level])
            drawn_from[rows, level] = torch.where(enter[:, None], q, drawn_from[rows, level])
        if bool(leave.any()):
            keep = leave & (noise.uniforms[rows, node] < weight[rows, level])
            kept, done = torch.where(keep, node, kept), done | keep
            fail = leave & ~keep
            residual = (parent_weight[:, None] * parent_target - drawn_from[rows, level]).clamp(min=0.0)
            mass = residual.sum(-1)
            weight[rows, level - 1] = torch.where(fail, _renewed_weight(parent_weight, mass), parent_weight)
            new_target = torch.where(mass[:, None] > 0, residual / mass.clamp(min=_TINY)[:, None], parent_target)
            target[rows, level - 1] = torch.where(fail[:, None], new_target, parent_target)
            if tree.mode is SiblingMode.SAMPLED_WOR and not point_masses:
                removed = group_q[rows, level - 1].scatter(1, token[:, None], 0.0)
                total = removed.sum(-1, keepdim=True)
                removed = torch.where(total > 0, removed / total.clamp(min=_TINY), removed)
                group_q[rows, level - 1] = torch.where(fail[:, None], removed, group_q[rows, level - 1])

    final_level = torch.where(kept >= 0, depth[rows, kept.clamp(min=0)], 0) if num_slots else kept + 1
    residual = target[rows, final_level]  # [B, V] the kept node's target after its failed children
    next_token = final_token(residual, sampling, noise)
    return VerifyResult(*_path_to(kept, tree.parents, final_level, num_slots), next_token)


def _child_weight(parent_weight: Tensor, p_token: Tensor, q_token: Tensor) -> Tensor:  # [B] each
    """w_c = min(1, w P(c) / Q_c(c)): the running product makes the test joint along the path."""
    return (parent_weight * p_token / q_token).clamp(max=1.0)


def _renewed_weight(parent_weight: Tensor, mass: Tensor) -> Tensor:  # [B] each
    """A node's weight once a child's subtree failed: r / (1 - w + r), the chance that what is left
    (the residual mass r against the child's failure probability 1 - w + r) keeps the node's path.
    0 / 0 only when the child could not fail (w = 1 and P <= Q_c): never reached."""
    denominator = 1.0 - parent_weight + mass
    return torch.where(denominator > 0, mass / denominator.clamp(min=_TINY), 1.0)


_TINY = torch.finfo(torch.float64).tiny
_NO_EVENT = -(1 << 62)  # padding in the event list: ~node for a real leave event is >= -N


def _depth_first_events(parents: Tensor, counts: Tensor, num_slots: int) -> Tensor:  # [B, N], [B] -> [B, 2N]
    """Per request, its nodes in depth-first order, each entered (node) before its children and
    left (~node) after them; siblings in index (draw) order. The traversal decides on leaving.
    Built on the host once per distinct topology (a batch's trees mostly share a few shapes)."""
    slots = torch.arange(num_slots, device=parents.device)
    topology = torch.cat([torch.where(slots < counts[:, None], parents, -2), counts[:, None]], dim=1)  # [B, N+1]
    shapes, which = torch.unique(topology, dim=0, return_inverse=True)
    events = []
    for *own_parents, n in shapes.tolist():
        children: list[list[int]] = [[] for _ in range(n + 1)]  # by parent + 1
        for i, parent in enumerate(own_parents[:n]):
            children[parent + 1].append(i)
        order, stack = [], [(child, False) for child in reversed(children[0])]
        while stack:
            node, leaving = stack.pop()
            if leaving:
                order.append(~node)
                continue
            order.append(node)
            stack.append((node, True))
            stack.extend((child, False) for child in reversed(children[node + 1]))
        events.append(order + [_NO_EVENT] * (2 * num_slots - len(order)))
    table = torch.tensor(events, dtype=torch.int64, device=parents.device).reshape(len(events), 2 * num_slots)
    return table[which]


def _first_children(parents: Tensor, valid: Tensor) -> Tensor:  # [B, N] bool
    """Whether each node is the first of its sibling group (no earlier node has its parent)."""
    n = parents.shape[1]
    earlier = torch.ones(n, n, dtype=torch.bool, device=parents.device).tril(-1)  # [i, j]: j < i
    same_parent = (parents[:, :, None] == parents[:, None, :]) & valid[:, None, :] & earlier
    return valid & ~same_parent.any(-1)


def _path_to(kept: Tensor, parents: Tensor, length: Tensor, num_slots: int) -> tuple[Tensor, Tensor]:
    """accepted_nodes [B, N] (root-to-node path, -1 padded) and num_accepted [B] for kept nodes [B]."""
    accepted = torch.full((kept.shape[0], num_slots), -1, dtype=torch.int64, device=kept.device)
    node = kept
    for position in range(num_slots - 1, -1, -1):  # the path's last node sits at length - 1
        here = (position < length) & (node >= 0)
        accepted[:, position] = torch.where(here, node, accepted[:, position])
        node = torch.where(here, parents.gather(1, node.clamp(min=0)[:, None])[:, 0], node)
    return accepted, length
