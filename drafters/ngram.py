"""Prompt lookup (n-gram) drafting: continue the text the way it continued before.

For each request the longest suffix n-gram (max_ngram down to min_ngram tokens) that occurred
earlier in the prompt + generated text is looked up; the tokens that followed its most recent
occurrences are the draft. Up to ``max_branches`` distinct continuations (most recent first) are
merged into a trie, so repeated contexts yield a tree. Candidates are a deterministic function of
the text, so the tree is DETERMINISTIC and verified exactly by the point-mass rule at any temperature.
"""

from __future__ import annotations

import torch
from torch import Tensor

from drafters.base import DraftContext, DraftTree, SiblingMode, VerifyResult, register


@register("ngram")
class NgramDrafter:
    target_layers: tuple[int, ...] = ()

    def __init__(
        self, target=None, num_draft: int = 5, max_ngram: int = 3, min_ngram: int = 1, max_branches: int = 1
    ) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram; got {min_ngram}, {max_ngram}")
        if num_draft < 1 or max_branches < 1:
            raise ValueError(f"num_draft and max_branches must be >= 1; got {num_draft}, {max_branches}")
        self.num_draft, self.max_ngram, self.min_ngram = num_draft, max_ngram, min_ngram
        self.max_branches = max_branches

    def reset(self, batch_size: int, max_length: int) -> None:
        pass

    def propose(self, ctx: DraftContext) -> DraftTree:
        tries = [
            self._trie(ctx.tokens[b, :length]) for b, length in enumerate(ctx.lengths.tolist())
        ]
        width = max(1, max(len(tokens) for tokens, _ in tries))
        device = ctx.tokens.device
        tokens = torch.zeros(len(tries), width, dtype=torch.int64, device=device)
        parents = torch.full((len(tries), width), -1, dtype=torch.int64, device=device)
        for b, (node_tokens, node_parents) in enumerate(tries):
            tokens[b, : len(node_tokens)] = torch.tensor(node_tokens, dtype=torch.int64)
            parents[b, : len(node_parents)] = torch.tensor(node_parents, dtype=torch.int64)
        num_nodes = torch.tensor([len(t) for t, _ in tries], dtype=torch.int64, device=device)
        return DraftTree(tokens, parents, None, num_nodes, SiblingMode.DETERMINISTIC)

    def continuations(self, sequence: Tensor) -> list[list[int]]:  # [L] int64 -> distinct drafts
        length = sequence.numel()
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            # windows that end before the last token, so each has at least one token after it
            windows = sequence[:-1].unfold(0, n, 1)  # [L - n, n]
            starts = (windows == sequence[-n:]).all(1).nonzero()[:, 0].flip(0) + n  # most recent first
            found: list[list[int]] = []
            for start in starts.tolist():
                draft = sequence[start : start + self.num_draft].tolist()
                if draft not in found:
                    found.append(draft)
                if len(found) == self.max_branches:
                    break
            if found:
                return found
        return []

    def _trie(self, sequence: Tensor) -> tuple[list[int], list[int]]:
        tokens: list[int] = []
        parents: list[int] = []
        children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        for draft in self.continuations(sequence):
            node = -1
            for token in draft:
                if (node, token) not in children:
                    children[(node, token)] = len(tokens)
                    tokens.append(token)
                    parents.append(node)
                node = children[(node, token)]
        return tokens, parents

    def commit(self, tree: DraftTree, result: VerifyResult) -> None:
        pass

    def retain(self, rows: Tensor) -> None:
        pass
