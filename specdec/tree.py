"""Draft trees: what a drafter proposes and the verifier walks.

Terms used throughout:
- the *root* is the last committed token (not yet in the target's KV cache); it is row 0 of every
  per-row tensor ("rows" = root + nodes, so row i+1 is node i);
- nodes are stored in topological order: ``parents[b, i] < i``, and siblings in the order the
  drafter ranks them (the verifier tries them in that order);
- a node's *depth* is 1 for children of the root.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor


class SiblingMode(enum.Enum):
    """How the children of one node were produced; decides which exact acceptance rule applies."""

    SAMPLED_IID = "sampled_iid"  # each child drawn i.i.d. from q(.|path); a chain is the 1-child case
    SAMPLED_WOR = "sampled_wor"  # children drawn without replacement from q (Gumbel-top-k)
    DETERMINISTIC = "deterministic"  # top-k / argmax / lookup: q is a point mass, draft_probs unused


class TreeError(ValueError):
    """A DraftTree that breaks the contract (shapes, topology, vocabulary)."""


@dataclass(frozen=True)
class DraftTree:
    tokens: Tensor  # [B, N] int64, node i's token; values beyond num_nodes are ignored
    parents: Tensor  # [B, N] int64, parent node index, -1 = root; parents[b, i] < i
    draft_probs: Tensor | None  # [B, N, V] float32, q(.|path to parent(i)) node i was drawn from
    num_nodes: Tensor  # [B] int64, valid nodes per request (0 = plain decoding step)
    mode: SiblingMode
    # sampled trees: no branch's shape depends on tokens drawn in another branch (a static shape,
    # e.g. every node of a depth expanded); traversal verification is exact only for those
    static_shape: bool = False
    # [B, N] float32 or None: the drafter's own (uncalibrated) score for "node i's path is accepted",
    # higher = likelier; a budgeted union (drafters/union.py) ranks nodes by it, verifiers ignore it
    confidence: Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def max_nodes(self) -> int:
        return self.tokens.shape[1]

    def node_valid(self) -> Tensor:  # [B, N] bool
        return torch.arange(self.max_nodes, device=self.tokens.device) < self.num_nodes[:, None]

    def validate(self, vocab_size: int | None = None) -> DraftTree:
        """Raise TreeError naming the first broken rule; returns self so calls can be chained."""
        validate_tree(self, vocab_size)
        return self

    @cached_property
    def depth(self) -> Tensor:  # [B, N] int64, 1 for children of the root, 0 for padding
        return tree_depth(self.parents, self.node_valid())

    def is_chain(self) -> bool:
        """Whether every request's tree is a chain (node i's parent is node i - 1; a host read)."""
        slots = torch.arange(self.max_nodes, device=self.parents.device)
        return not bool((self.node_valid() & (self.parents != slots - 1)).any())

    def positions(self, root_position: Tensor) -> Tensor:  # [B, N+1] int64
        """Sequence positions of the rows: the root at root_position [B], node i at root + depth."""
        return root_position[:, None] + torch.cat(
            [torch.zeros_like(root_position)[:, None], self.depth], dim=1
        )

    @cached_property
    def ancestor_mask(self) -> Tensor:  # [B, N+1, N+1] bool
        """Row r may attend to row c iff c is r itself or an ancestor of r (the root included).

        Padding rows attend only to themselves and the root so that attention stays finite.
        """
        return ancestor_mask(self.parents, self.node_valid())

    def paths(self) -> list[list[list[int]]]:
        """Root-to-leaf node-index paths per request (host-side; parents and counts move to the
        host once per batch, not per request)."""
        result = []
        counts, all_parents = self.num_nodes.tolist(), self.parents.tolist()
        for b in range(self.batch_size):
            parents = all_parents[b][: counts[b]]
            n = len(parents)
            has_child = {p for p in parents if p >= 0}
            paths = []
            for leaf in range(n):
                if leaf in has_child:
                    continue
                path, node = [], leaf
                while node >= 0:
                    path.append(node)
                    node = parents[node]
                paths.append(path[::-1])
            result.append(paths)
        return result


def tree_depth(parents: Tensor, valid: Tensor) -> Tensor:  # [B, N] int64
    batch, n = parents.shape
    depth = torch.zeros(batch, n, dtype=torch.int64, device=parents.device)
    for i in range(n):  # parents[:, i] < i, so the parent's depth is already final
        parent = parents[:, i]
        # padding may hold any value: clamp so the gather stays in range, then mask it out
        parent_depth = depth.gather(1, parent.clamp(min=0, max=max(i - 1, 0))[:, None])[:, 0]
        depth[:, i] = torch.where(parent >= 0, parent_depth + 1, 1)
    return torch.where(valid, depth, 0)


def ancestor_mask(parents: Tensor, valid: Tensor) -> Tensor:  # [B, N+1, N+1] bool
    batch, n = parents.shape
    mask = torch.zeros(batch, n + 1, n + 1, dtype=torch.bool, device=parents.device)
    mask[:, :, 0] = True
    mask[:, 0, 1:] = False
    eye = torch.eye(n + 1, dtype=torch.bool, device=parents.device)
    rows = torch.arange(batch, device=parents.device)
    for i in range(n):  # node i inherits its parent's row, then sees itself
        parent_row = (parents[:, i] + 1).clamp(min=0) * valid[:, i]
        mask[:, i + 1] = mask[rows, parent_row] | eye[i + 1]
    return mask


def validate_tree(tree: DraftTree, vocab_size: int | None = None) -> None:
    if tree.tokens.dim() != 2 or tree.parents.shape != tree.tokens.shape:
        raise TreeError(
            f"tokens and parents must both be [B, N]; got {tuple(tree.tokens.shape)} and "
            f"{tuple(tree.parents.shape)}"
        )
    b, n = tree.tokens.shape
    if tree.tokens.dtype != torch.int64 or tree.parents.dtype != torch.int64:
        raise TreeError("tokens and parents must be int64 tensors")
    if tree.num_nodes.dtype != torch.int64:
        raise TreeError(f"num_nodes must be an int64 tensor; got {tree.num_nodes.dtype}")
    if tree.num_nodes.shape != (b,):
        raise TreeError(f"num_nodes must be [B={b}]; got {tuple(tree.num_nodes.shape)}")
    if bool((tree.num_nodes < 0).any()) or bool((tree.num_nodes > n).any()):
        raise TreeError(f"num_nodes must lie in [0, N={n}]; got {tree.num_nodes.tolist()}")
    valid = tree.node_valid()
    own = torch.arange(n, device=tree.parents.device).expand(b, n)
    bad = valid & ((tree.parents >= own) | (tree.parents < -1))
    if bool(bad.any()):
        req, node = (int(x) for x in bad.nonzero()[0])
        raise TreeError(
            f"request {req}: node {node} has parent {int(tree.parents[req, node])}; a parent must be "
            f"-1 (root) or an earlier node index (nodes are stored in topological order)"
        )
    if vocab_size is not None:
        bad = valid & ((tree.tokens < 0) | (tree.tokens >= vocab_size))
        if bool(bad.any()):
            req, node = (int(x) for x in bad.nonzero()[0])
            raise TreeError(
                f"request {req}: node {node} has token {int(tree.tokens[req, node])} outside the "
                f"vocabulary [0, {vocab_size})"
            )
    if tree.confidence is not None and tree.confidence.shape != (b, n):
        raise TreeError(f"confidence must be [B={b}, N={n}]; got {tuple(tree.confidence.shape)}")
    if tree.mode is SiblingMode.DETERMINISTIC:
        return
    if tree.draft_probs is None:
        raise TreeError(
            f"mode {tree.mode.name} needs draft_probs (q each node was drawn from); pass them, "
            f"or use SiblingMode.DETERMINISTIC for top-k/argmax/lookup drafts"
        )
    if tree.draft_probs.dtype != torch.float32:
        raise TreeError(f"draft_probs must be float32; got {tree.draft_probs.dtype}")
    if tree.draft_probs.dim() != 3 or tree.draft_probs.shape[:2] != (b, n):
        raise TreeError(f"draft_probs must be [B={b}, N={n}, V]; got {tuple(tree.draft_probs.shape)}")
    if vocab_size is not None and tree.draft_probs.shape[2] != vocab_size:
        raise TreeError(
            f"draft_probs has vocabulary {tree.draft_probs.shape[2]} but the target has {vocab_size}"
        )


def empty_tree(batch_size: int, device: torch.device | str = "cpu") -> DraftTree:
    """No draft at all: verifying it is one step of plain decoding."""
    none = torch.zeros(batch_size, 0, dtype=torch.int64, device=device)
    return DraftTree(
        tokens=none,
        parents=none.clone(),
        draft_probs=None,
        num_nodes=torch.zeros(batch_size, dtype=torch.int64, device=device),
        mode=SiblingMode.DETERMINISTIC,
    )


def chain_tree(
    tokens: Tensor,  # [B, K] int64
    mode: SiblingMode,
    draft_probs: Tensor | None = None,  # [B, K, V] float32
    num_nodes: Tensor | None = None,  # [B] int64, defaults to K
    confidence: Tensor | None = None,  # [B, K] float32, the drafter's own score per node
) -> DraftTree:
    b, k = tokens.shape
    parents = torch.arange(-1, k - 1, device=tokens.device).expand(b, k).contiguous()
    if num_nodes is None:
        num_nodes = torch.full((b,), k, dtype=torch.int64, device=tokens.device)
    return DraftTree(tokens, parents, draft_probs, num_nodes, mode, confidence=confidence)


def parents_from_paths(paths: list[list[int]] | list[tuple[int, ...]]) -> list[int]:
    """Static topology from Medusa-style "choices": each path lists sibling ranks from the root.

    ``[[0], [1], [0, 0], [0, 1]]`` = two children of the root, two children of the first. Every
    prefix of a path must be a path too. Nodes come out sorted by (depth, path) so that parents
    precede children and siblings stay in rank order; node i corresponds to the i-th sorted path.
    """
    ordered = sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))
    if not ordered or any(len(p) == 0 for p in ordered):
        raise TreeError("paths must be non-empty lists of sibling ranks, e.g. [[0], [1], [0, 0]]")
    index = {p: i for i, p in enumerate(ordered)}
    parents = []
    for p in ordered:
        if any(r < 0 for r in p):
            raise TreeError(f"path {list(p)} has a negative sibling rank")
        if len(p) > 1 and p[:-1] not in index:
            raise TreeError(f"path {list(p)} has no parent path {list(p[:-1])}; add it")
        parents.append(index[p[:-1]] if len(p) > 1 else -1)
    return parents


def sorted_paths(paths: list[list[int]] | list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The node order used by parents_from_paths."""
    return sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))


def tree_from_parents(
    tokens: Tensor,  # [B, N] int64
    parents: Tensor | list[int],  # [B, N] int64, or one topology shared by the batch
    mode: SiblingMode,
    draft_probs: Tensor | None = None,  # [B, N, V] float32
    num_nodes: Tensor | None = None,  # [B] int64
    confidence: Tensor | None = None,  # [B, N] float32, the drafter's own score per node
) -> DraftTree:
    b, n = tokens.shape
    parents = torch.as_tensor(parents, dtype=torch.int64, device=tokens.device)
    if parents.shape[-1] != n:
        raise TreeError(f"the topology has {parents.shape[-1]} parents but tokens has N={n} nodes")
    if parents.dim() == 1:
        parents = parents.expand(b, n).contiguous()
    if num_nodes is None:
        num_nodes = torch.full((b,), n, dtype=torch.int64, device=tokens.device)
    return DraftTree(tokens, parents, draft_probs, num_nodes, mode, confidence=confidence)


def token_trie(
    drafts: list[list[list[int]]],  # per request, token sequences continuing the root, best first
    device: torch.device | str = "cpu",
    scores: list[list[list[float]]] | None = None,  # like drafts: a confidence per drafted token
) -> DraftTree:
    """A DETERMINISTIC tree holding every draft of every request once: drafts sharing a prefix
    share its nodes, and nodes keep the order in which the drafts first reach them (siblings best
    first). A request without drafts gets no nodes. With ``scores``, a node's confidence is the
    highest score any draft gave it."""
    tries = []
    for b, request in enumerate(drafts):
        tokens: list[int] = []
        parents: list[int] = []
        confidence: list[float] = []
        children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        for d, draft in enumerate(request):
            node = -1
            for depth, token in enumerate(draft):
                score = scores[b][d][depth] if scores is not None else 0.0
                if (node, token) not in children:
                    children[(node, token)] = len(tokens)
                    tokens.append(token)
                    parents.append(node)
                    confidence.append(score)
                node = children[(node, token)]
                confidence[node] = max(confidence[node], score)
        tries.append((tokens, parents, confidence))
    width = max([1] + [len(tokens) for tokens, _, _ in tries])
    # filled row by row on the host, then moved in one copy per tensor
    tokens = torch.zeros(len(tries), width, dtype=torch.int64, device="cpu")
    parents = torch.full((len(tries), width), -1, dtype=torch.int64, device="cpu")
    confidence = torch.zeros(len(tries), width, dtype=torch.float32, device="cpu")
    for b, (node_tokens, node_parents, node_confidence) in enumerate(tries):
        tokens[b, : len(node_tokens)] = torch.tensor(node_tokens, dtype=torch.int64, device="cpu")
        parents[b, : len(node_parents)] = torch.tensor(node_parents, dtype=torch.int64, device="cpu")
        confidence[b, : len(node_confidence)] = torch.tensor(node_confidence, dtype=torch.float32, device="cpu")
    num_nodes = torch.tensor([len(t) for t, _, _ in tries], dtype=torch.int64, device="cpu")
    return DraftTree(
        tokens.to(device), parents.to(device), None, num_nodes.to(device), SiblingMode.DETERMINISTIC,
        confidence=confidence.to(device) if scores is not None else None,
    )


def token_paths(tree: DraftTree) -> list[list[list[int]]]:
    """Per request, the tokens of every root-to-leaf path, in node order (host-side)."""
    tokens = tree.tokens.tolist()
    return [[[tokens[b][node] for node in path] for path in paths] for b, paths in enumerate(tree.paths())]


def prune_to_depth(tree: DraftTree, max_depth: Tensor) -> DraftTree:
    """Drop nodes deeper than max_depth [B] (0 = no draft), keeping index order and topology.

    The kept set is closed under ancestors, so compacting it preserves parents < own index.
    """
    keep = tree.node_valid() & (tree.depth <= max_depth[:, None])  # [B, N]
    new_index = keep.cumsum(1) - 1  # [B, N] index of each kept node after compaction
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)  # kept nodes first, in order
    num_nodes = keep.sum(1)
    still_valid = torch.arange(tree.max_nodes, device=keep.device) < num_nodes[:, None]
    parents = torch.where(keep, tree.parents, -1).gather(1, order)  # padding parents -> root
    parents = torch.where(parents >= 0, new_index.gather(1, parents.clamp(min=0)), -1)
    parents = torch.where(still_valid, parents, -1)
    draft_probs = None
    if tree.draft_probs is not None:
        draft_probs = tree.draft_probs.gather(1, order[:, :, None].expand_as(tree.draft_probs))
    confidence = None if tree.confidence is None else tree.confidence.gather(1, order)
    return DraftTree(
        tree.tokens.gather(1, order), parents, draft_probs, num_nodes, tree.mode, tree.static_shape, confidence
    )
