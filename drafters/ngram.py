"""N-gram drafting from the request's own context (prompt lookup, and self-speculation on the text
generated so far): continue the text the way it continued before.

For each request the longest suffix n-gram (max_ngram down to min_ngram tokens) that occurred
earlier in the prompt + generated text is looked up; the ``num_draft`` tokens that followed its
occurrences are candidate continuations. The ``max_branches`` best distinct continuations are
merged into a trie, so a context that continued in several ways yields a tree. Ranking:

- ``rank=recency``: most recent occurrence first (classic prompt lookup);
- ``rank=frequency``: by how many of the last ``max_matches`` occurrences agree with the
  continuation's first token, then its first two tokens, and so on (recency breaks ties), so the
  most common way the context went on is tried first.

Lookup cost does not grow with the context: each request keeps a hashed index n-gram -> positions
where its continuation starts, extended by the tokens committed since the last proposal (each
token is indexed once), and a lookup reads at most ``max_matches`` positions per n.

Candidates are a deterministic function of the text, so the tree is DETERMINISTIC and verified
exactly by the point-mass rule at any temperature.
"""

from __future__ import annotations

from collections import defaultdict

from torch import Tensor

from drafters.base import BudgetKnobs, DraftContext, DraftTree, DrafterBase, VerifyResult, register
from specdec.protocols import Target
from specdec.tree import token_trie

RANKS = ("recency", "frequency")


class NgramIndex:
    """One request's committed tokens and, for every n in [min_ngram, max_ngram], the positions p
    (increasing) where an n-gram ends, i.e. ``tokens[p - n : p]`` is that n-gram and ``p`` is where
    what followed it starts."""

    def __init__(self, min_ngram: int, max_ngram: int) -> None:
        self.tokens: list[int] = []
        self.sizes = range(min_ngram, max_ngram + 1)
        self.positions: dict[int, defaultdict[tuple[int, ...], list[int]]] = {n: defaultdict(list) for n in self.sizes}

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens)
            for n in self.sizes:
                if end >= n:
                    self.positions[n][tuple(self.tokens[end - n : end])].append(end)

    def continuations(self, num_draft: int, max_matches: int) -> list[tuple[list[int], int]]:
        """(continuation, start) of the last ``max_matches`` earlier occurrences of the longest
        suffix n-gram that has any, most recent first; empty if none has."""
        length = len(self.tokens)
        for n in reversed(self.sizes):
            if n >= length:
                continue
            starts = self.positions[n].get(tuple(self.tokens[length - n :]), [])
            # the last entry is the suffix itself (start == length): nothing followed it yet
            found = [
                (self.tokens[start : start + num_draft], start)
                for start in reversed(starts[-max_matches - 1 :])
                if start < length
            ][:max_matches]
            if found:
                return found
        return []


@register("ngram", budget=BudgetKnobs(depth="num_draft"))
class NgramDrafter(DrafterBase):
    def __init__(
        self,
        target: Target | None = None,
        num_draft: int = 5,
        max_ngram: int = 3,
        min_ngram: int = 1,
        max_branches: int = 1,
        rank: str = "recency",
        max_matches: int = 64,
    ) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram; got {min_ngram}, {max_ngram}")
        if num_draft < 1 or max_branches < 1 or max_matches < 1:
            raise ValueError(
                f"num_draft, max_branches and max_matches must be >= 1; got {num_draft}, {max_branches}, {max_matches}"
            )
        if rank not in RANKS:
            raise ValueError(f"rank must be one of {', '.join(RANKS)}; got {rank!r}")
        self.num_draft, self.max_ngram, self.min_ngram = num_draft, max_ngram, min_ngram
        self.max_branches, self.rank, self.max_matches = max_branches, rank, max_matches
        self._indexes: list[NgramIndex] = []  # one per batch row

    def reset(self, batch_size: int, max_length: int) -> None:
        self._indexes = [NgramIndex(self.min_ngram, self.max_ngram) for _ in range(batch_size)]

    def admit(self, count: int, max_length: int) -> None:
        self._indexes += [NgramIndex(self.min_ngram, self.max_ngram) for _ in range(count)]

    def commit(self, tree: DraftTree, result: VerifyResult) -> None:
        pass  # the committed tokens reach the index through the next DraftContext

    def retain(self, rows: Tensor) -> None:
        self._indexes = [self._indexes[row] for row in rows.tolist()]

    def propose(self, ctx: DraftContext) -> DraftTree:
        if len(self._indexes) != ctx.tokens.shape[0]:
            raise RuntimeError(
                f"the drafter tracks {len(self._indexes)} requests but the context has "
                f"{ctx.tokens.shape[0]}; call reset/admit/retain as the batch changes"
            )
        drafts, scores = [], []
        for b, (index, length) in enumerate(zip(self._indexes, ctx.lengths.tolist())):
            index.extend(ctx.tokens[b, len(index.tokens) : length].tolist())  # only what is new
            paths, shares = self.branches(index)
            drafts.append(paths)
            scores.append(shares)
        return token_trie(drafts, ctx.tokens.device, scores)

    def branches(self, index: NgramIndex) -> tuple[list[list[int]], list[list[float]]]:
        """The ``max_branches`` best distinct continuations, best first, and for each of their
        tokens the share of the found occurrences that continued through it (its confidence)."""
        found = index.continuations(self.num_draft, self.max_matches)
        distinct: dict[tuple[int, ...], int] = {}  # continuation -> its most recent start
        for draft, start in found:
            distinct.setdefault(tuple(draft), start)
        ranked = list(distinct)  # most recent first
        support: defaultdict[tuple[int, ...], int] = defaultdict(int)  # prefix -> occurrences through it
        for draft, _ in found:
            for depth in range(1, len(draft) + 1):
                support[tuple(draft[:depth])] += 1
        if self.rank == "frequency":
            weights = {d: [support[d[:depth]] for depth in range(1, len(d) + 1)] for d in ranked}
            ranked.sort(key=lambda d: [-w for w in weights[d]])  # stable: recency breaks ties
        kept = ranked[: self.max_branches]
        shares = [[support[d[:depth]] / len(found) for depth in range(1, len(d) + 1)] for d in kept]
        return [list(d) for d in kept], shares
