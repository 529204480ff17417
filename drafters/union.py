"""Several drafters' proposals verified as one tree (``union``): for example EAGLE-3's top
candidates plus the request's own n-gram continuation, which catches repeated spans the head
misses at the price of a few more verified rows.

Every member proposes from the same DraftContext (restricted to the target layers it asked for);
their trees are merged into one DETERMINISTIC token trie, members in order, so a continuation that
two members drafted is verified once. Merging is exact for deterministic drafts only (a point-mass
q per node, any sibling order), so a member that samples its drafts is refused at its first
proposal. Members whose state follows what their own tree accepted (``commit_reads_tree``: a draft
model's or layer skip's own KV cache) cannot be told what another member's accepted branch was,
and are refused up front; every other drafter rebuilds what it needs from the next DraftContext.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from torch import Tensor

from drafters.base import DraftContext, DraftTree, SiblingMode, VerifyResult, build, register
from specdec.tree import token_paths, token_trie


@register("union")
class UnionDrafter:
    def __init__(self, target, members: Sequence[Mapping]) -> None:
        """members: each a drafter config, {"name": ..., its options}, as in configs/drafter/."""
        if len(members) < 2:
            raise ValueError(f"a union needs at least two members; got {len(members)}")
        self.members = []
        for member in members:
            options = dict(member)
            name = options.pop("name", None)
            if name is None or name == "union":
                raise ValueError(f"each union member needs the name of another drafter; got {dict(member)}")
            drafter = build(name, target, **options)
            if getattr(drafter, "commit_reads_tree", False):
                raise ValueError(
                    f"drafter {name!r} keeps state from what its own tree accepted, which a union cannot "
                    f"report when another member's branch wins; use it on its own"
                )
            self.members.append((name, drafter))
        self.target_layers = tuple(sorted({k for _, d in self.members for k in d.target_layers}))
        # member -> where each of its layers sits in this union's new_hidden
        self._layer_index = [tuple(self.target_layers.index(k) for k in d.target_layers) for _, d in self.members]

    def reset(self, batch_size: int, max_length: int) -> None:
        for _, drafter in self.members:
            drafter.reset(batch_size, max_length)

    def admit(self, count: int, max_length: int) -> None:
        for _, drafter in self.members:
            drafter.admit(count, max_length)

    def retain(self, rows: Tensor) -> None:
        for _, drafter in self.members:
            drafter.retain(rows)

    def commit(self, tree: DraftTree, result: VerifyResult) -> None:
        for _, drafter in self.members:  # none of them reads the tree (checked at construction)
            drafter.commit(tree, result)

    def propose(self, ctx: DraftContext) -> DraftTree:
        drafts = [[] for _ in range(ctx.tokens.shape[0])]
        for (name, drafter), layers in zip(self.members, self._layer_index):
            own = dataclasses.replace(ctx, new_hidden=tuple(ctx.new_hidden[i] for i in layers))
            tree = drafter.propose(own)
            if tree.mode is not SiblingMode.DETERMINISTIC:
                raise ValueError(
                    f"union member {name!r} drafted a {tree.mode.value} tree; a union merges deterministic "
                    f"drafts only (set the member's sampling=deterministic)"
                )
            for request, paths in zip(drafts, token_paths(tree)):
                request.extend(paths)
        return token_trie(drafts, ctx.tokens.device)
