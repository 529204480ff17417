"""Medusa-1 drafter: extra heads on the target's last feature, one per future position, and a
static tree of their top-k candidates.

Terms. f_t is the target's final-norm feature after reading x_t, the last token in the target's KV
cache; the root (the last committed token) is x_{t+1}, the target's own choice from f_t. Head k
(k = 0..K-1) reads only f_t and predicts x_{t+2+k}: the token k + 1 positions after the root. A
head is one residual block, h_k = SiLU(W_k f_t + b_k) + f_t, followed by the LM head.

Published heads. The Medusa reference heads (and vLLM's) stack ``num_layers`` such blocks per head
(x <- SiLU(W_kj x + b_kj) + x) and give each head its own LM head; ``MedusaConfig.num_layers`` and
``own_lm_heads`` describe that variant, which drafters/formats/medusa.py loads from their layouts
(``checkpoint=DIR`` takes either). The defaults (one block, the shared target LM head below) are
what this project trains and what every bundled checkpoint holds.

LM head sharing: every head shares the target's frozen LM head, restricted to a reduced draft
vocabulary (``draft_ids``: the most frequent target choices in the training data, as for EAGLE).
A separate trainable LM head per head, as in the Medusa paper, costs vocab x hidden parameters
each (as many as the target's own embeddings): a few heads would not fit a checkpoint small enough
to bundle, and on a CPU each full-vocabulary product costs a sizeable part of a target forward.
W_k starts at zero, so an untrained head is the target's own next-token predictor.

Tree. Heads are independent of each other and of the path, so node tokens depend only on (depth,
sibling rank): a path (r_1, ..., r_d) is head 0's rank-r_1 candidate, then head 1's rank-r_2, ...
Which paths to keep comes from MEASURED accuracies: acc[k][r] = P(head k's rank-r candidate is the
target's choice) on held-out data. Treating depths as independent, a path is accepted with
probability prod_j acc[j][r_j]; :func:`build_tree` adds, one node at a time, the path whose parent
is already in the tree and whose product is largest (the best prefix-closed set of that size, since
a child never scores above its parent). The accuracies and the tree are stored in the checkpoint's
config, so the drafter needs no extra argument.

A published head carries no measured accuracies: without them it drafts the top-1 chain through its
heads (what vLLM drafts with Medusa heads), ``depth`` long at most, unless ``tree`` names the paths
(e.g. the sparse tree its authors published for it, in Medusa's ``medusa_choices`` format).

The tree is DETERMINISTIC (top-k candidates, which never depend on the verification coins), so the
default verifier keeps decoding exact at any temperature.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from drafters.base import DraftContext, DraftTree, SiblingMode, StatelessDrafter
from drafters.heads import draft_lm_head, load_checkpoint, register_draft_ids, save_head, target_name
from specdec.protocols import HeadTarget
from specdec.tree import parents_from_paths, sorted_paths, tree_from_parents

RankPath = tuple[int, ...]  # sibling ranks from the root, one per depth
TARGET_FOLDER = "target"  # a Medusa-2 checkpoint's subfolder: the target fine-tuned with its heads


@dataclass(frozen=True)
class MedusaConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int
    draft_vocab_size: int  # tokens the heads may draft (the reduced vocabulary)
    target_num_layers: int
    target: str = ""  # where the target came from, for error messages
    # measured on held-out data after training: accuracies[k][r] = P(head k's rank-r candidate is
    # the target's choice); empty until then
    accuracies: tuple[tuple[float, ...], ...] = ()
    tree: tuple[RankPath, ...] = ()  # the static tree built from the accuracies
    num_layers: int = 1  # residual blocks per head (published Medusa heads may stack several)
    own_lm_heads: bool = False  # one LM head per head over draft_ids (published layout), not the target's

    @staticmethod
    def for_target(target: HeadTarget, num_heads: int, draft_vocab_size: int | None = None) -> MedusaConfig:
        return MedusaConfig(
            hidden_size=target.hidden_size,
            vocab_size=target.vocab_size,
            num_heads=num_heads,
            draft_vocab_size=draft_vocab_size or target.vocab_size,
            target_num_layers=target.num_layers,
            target=target_name(target),
        )


class MedusaHeads(nn.Module):
    """K heads of L residual blocks over one feature: [..., H] -> [..., K, H]. The shared target LM
    head is applied by the caller (over ``draft_ids`` only); heads with ``own_lm_heads`` apply
    theirs with :meth:`logits`."""

    def __init__(self, config: MedusaConfig, draft_ids: Tensor | None = None) -> None:
        super().__init__()
        if config.num_heads < 1 or config.num_layers < 1:
            raise ValueError(f"num_heads and num_layers must be >= 1; got {config.num_heads}, {config.num_layers}")
        self.config = config
        register_draft_ids(self, draft_ids, config.draft_vocab_size)  # [D]
        k, h = config.num_heads, config.hidden_size
        # block j of head k is rows j*H..(j+1)*H: with one block per head this is the [K, H, H] every
        # checkpoint holds, so the variant leaves their format unchanged
        self.weight = nn.Parameter(torch.zeros(k, config.num_layers * h, h))  # [K, L*H, H] zero: identity blocks
        self.bias = nn.Parameter(torch.zeros(k, config.num_layers * h))  # [K, L*H]
        if config.own_lm_heads:
            self.lm_heads = nn.Parameter(torch.zeros(k, config.draft_vocab_size, h))  # [K, D, H] rows for draft_ids

    def forward(self, features: Tensor) -> Tensor:  # [..., H] -> [..., K, H]
        k, h = self.config.num_heads, self.config.hidden_size
        weight, bias = self.weight.view(k, -1, h, h), self.bias.view(k, -1, h)  # [K, L, H, H], [K, L, H]
        # the first block of every head reads the same feature: one product for all heads
        x = F.silu(torch.einsum("...h,kgh->...kg", features, weight[:, 0]) + bias[:, 0]) + features[..., None, :]
        for layer in range(1, weight.shape[1]):
            x = F.silu(torch.einsum("...kh,kgh->...kg", x, weight[:, layer]) + bias[:, layer]) + x
        return x

    def logits(self, out: Tensor) -> Tensor:  # [..., J, H] (the first J heads' outputs) -> [..., J, D]
        """The heads' own LM heads (``own_lm_heads`` only) over the draft vocabulary."""
        return torch.einsum("...kh,kdh->...kd", out, self.lm_heads[: out.shape[-2]])


def build_tree(accuracies: list[list[float]] | tuple[tuple[float, ...], ...], total_tokens: int,
               max_depth: int | None = None) -> list[RankPath]:
    """Greedy static tree from measured accuracies (see the module docstring): up to
    ``total_tokens`` paths of length <= max_depth (default: one per head). Paths whose product is 0
    are never added (they could not be accepted on the held-out data)."""
    if total_tokens < 1:
        raise ValueError(f"total_tokens must be >= 1; got {total_tokens}")
    depth_limit = min(max_depth or len(accuracies), len(accuracies))
    if depth_limit < 1:
        raise ValueError(f"the tree needs at least one head (max_depth={max_depth}, {len(accuracies)} measured)")
    # a max-heap of (-score, path): ties go to the lexicographically smaller path, so the tree is reproducible
    frontier = [(-float(a), (r,)) for r, a in enumerate(accuracies[0])]
    heapq.heapify(frontier)
    tree: list[RankPath] = []
    while frontier and len(tree) < total_tokens:
        negative_score, path = heapq.heappop(frontier)
        if negative_score >= 0:
            break
        tree.append(path)
        if len(path) < depth_limit:
            for rank, accuracy in enumerate(accuracies[len(path)]):
                heapq.heappush(frontier, (negative_score * float(accuracy), path + (rank,)))
    return tree


def expected_accepted(accuracies, tree: list[RankPath]) -> float:
    """Expected accepted tokens per step under the independence assumption (sum of path scores)."""
    total = 0.0
    for path in tree:
        score = 1.0
        for depth, rank in enumerate(path):
            score *= accuracies[depth][rank]
        total += score
    return total


def save_heads(heads: MedusaHeads, directory: str | Path, extra: dict | None = None) -> None:
    save_head(heads, directory, extra, kind="medusa")


def parse_config(raw: dict) -> MedusaConfig:
    """A MedusaConfig from its JSON form (lists where the config holds tuples)."""
    raw = {**raw, "accuracies": tuple(tuple(float(a) for a in row) for row in raw["accuracies"]),
           "tree": tuple(tuple(int(r) for r in path) for path in raw["tree"])}
    return MedusaConfig(**raw)


def load_heads(directory: str | Path, target: HeadTarget) -> MedusaHeads:
    """Load Medusa heads and check they fit ``target``; clear errors for a foreign, corrupt or
    unmeasured checkpoint."""
    heads = load_checkpoint(directory, target, "medusa", parse_config, MedusaHeads, label="Medusa")
    config = heads.config
    if bool((heads.draft_ids < 0).any()) or bool((heads.draft_ids >= config.vocab_size).any()):
        raise ValueError(f"the Medusa checkpoint at {directory} is corrupt: draft_ids outside the vocabulary")
    check_measured(config, directory)
    return heads


def check_measured(config: MedusaConfig, directory: str | Path) -> None:
    if not config.tree:
        raise ValueError(
            f"the Medusa checkpoint at {directory} has no measured tree (its export did not finish); "
            f"export it again with specdec-train train=medusa"
        )
    check_tree(config, config.tree)


def check_tree(config: MedusaConfig, tree) -> None:
    if not tree:
        raise ValueError(
            "the Medusa tree is empty: every measured accuracy was 0 (the heads never predicted the "
            "target on held-out data); train longer or on more data"
        )
    parents_from_paths(list(tree))  # raises TreeError for an empty path or a missing prefix
    bad = [list(p) for p in tree if len(p) > config.num_heads or max(p) >= config.draft_vocab_size]
    if bad:
        raise ValueError(
            f"tree paths must be at most num_heads={config.num_heads} deep and use ranks below "
            f"draft_vocab_size={config.draft_vocab_size}; got {bad[:3]}"
        )


class MedusaDrafter(StatelessDrafter):
    """Proposes the static tree filled with the heads' top-k candidates. Stateless: each proposal
    reads only the last row of the target features that arrived with the DraftContext."""

    def __init__(self, target: HeadTarget, heads: MedusaHeads, tree: list[RankPath] | tuple[RankPath, ...]) -> None:
        check_tree(heads.config, tree)
        self.heads = heads  # one batched einsum for all heads: no linear layers to pack
        self.max_depth = heads.config.num_heads  # head k drafts depth k + 1
        self.target_layers = (target.num_layers + 1,)  # the final-norm output
        # [..., K, H] -> [..., K, D]: the heads' own LM heads, else the target's shared one over draft_ids
        self.draft_lm_head = heads.logits if heads.config.own_lm_heads else draft_lm_head(target, heads.draft_ids)
        ordered = sorted_paths(list(tree))  # node i = ordered[i], parents precede children
        self.parents = torch.tensor(parents_from_paths(ordered), dtype=torch.int64, device=target.device)  # [N]
        self.node_head = torch.tensor([len(p) - 1 for p in ordered], device=target.device)  # [N] depth - 1
        self.node_rank = torch.tensor([p[-1] for p in ordered], device=target.device)  # [N]
        # [N, N]: 1 where node j lies on node i's path (itself included), to sum log-probabilities along it
        self.on_path = torch.tensor([[float(p[: len(q)] == q) for q in ordered] for p in ordered], device=target.device)
        self.num_heads_used = max(len(p) for p in ordered)
        self.top_k = max(p[-1] for p in ordered) + 1

    def quantizable(self) -> list[nn.Module]:
        return [self.heads]  # the LM head rows are the target's

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> DraftTree:
        hidden = ctx.new_hidden[0]  # [B, R, H]
        batch, n = ctx.tokens.shape[0], len(self.parents)
        # a request with no new feature (a one-token prompt) drafts nothing this step
        num_nodes = torch.where(ctx.num_new > 0, n, 0)
        if hidden.shape[1] == 0:
            tokens = torch.zeros(batch, n, dtype=torch.int64, device=ctx.tokens.device)
            return tree_from_parents(tokens, self.parents, SiblingMode.DETERMINISTIC, None, num_nodes)
        last = (ctx.num_new - 1).clamp(min=0)[:, None, None].expand(-1, 1, hidden.shape[-1])
        feature = hidden.gather(1, last)[:, 0].to(self.heads.bias.dtype)  # [B, H] f_t
        out = self.heads(feature)[:, : self.num_heads_used]  # [B, K, H]
        logits = self.draft_lm_head(out)  # [B, K, D]
        log_probs, index = torch.log_softmax(logits.float(), -1).topk(self.top_k, -1)  # [B, K, top_k]
        tokens = self.heads.draft_ids[index][:, self.node_head, self.node_rank]  # [B, N] target ids
        # confidence: the heads' probability of each node's path (for budgeted unions)
        confidence = (log_probs[:, self.node_head, self.node_rank] @ self.on_path.T).exp()  # [B, N]
        return tree_from_parents(tokens, self.parents, SiblingMode.DETERMINISTIC, None, num_nodes, confidence)


def tree_for(config: MedusaConfig, total_tokens: int | None, depth: int | None,
             tree: list[list[int]] | None = None) -> list[RankPath]:
    """``tree`` when given; else the stored tree, or one rebuilt from the stored accuracies for
    another node budget or depth; a head with no measured accuracies (a published one) drafts the
    top-1 chain through its heads, ``depth`` long at most."""
    if tree is not None:
        if total_tokens is not None or depth is not None:
            raise ValueError("give either tree (the paths themselves) or total_tokens / depth (a tree built from "
                             "the measured accuracies), not both")
        if not isinstance(tree, (list, tuple)) or not all(isinstance(p, (list, tuple)) for p in tree):
            raise ValueError(f"tree must be a list of rank paths such as [[0], [0, 0], [1]]; got {tree!r}")
        return [tuple(int(rank) for rank in path) for path in tree]
    if not config.accuracies:
        if total_tokens is not None:
            raise ValueError(
                f"these Medusa heads ({config.target or 'a published checkpoint'}) carry no measured accuracies to "
                f"build a {total_tokens}-node tree from; pass tree=[[0], [0, 0], [1], ...] (e.g. the medusa_choices "
                f"published with them), or leave total_tokens unset for the top-1 chain"
            )
        return [(0,) * length for length in range(1, min(depth or config.num_heads, config.num_heads) + 1)]
    if total_tokens is None and depth is None:
        return list(config.tree)
    return build_tree(config.accuracies, total_tokens or len(config.tree), depth)


def with_tree(heads: MedusaHeads, accuracies: list[list[float]], tree: list[RankPath]) -> MedusaHeads:
    """Record measured accuracies and the tree built from them in the heads' config (saved with them)."""
    heads.config = replace(
        heads.config, accuracies=tuple(tuple(float(a) for a in row) for row in accuracies), tree=tuple(tree)
    )
    return heads
