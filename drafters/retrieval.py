"""Retrieval drafting (REST, He et al., NAACL 2024): continue the context the way a large corpus
continued it.

A *datastore* is a token corpus (documents separated by ``SEPARATOR``) and its suffix array, sorted
by each suffix's first ``SORT_DEPTH`` tokens, so all occurrences of an n-gram form one contiguous
range found by binary search. Each step the longest suffix of the request's context (``min_ngram``
to ``max_ngram`` tokens) that occurs in the corpus is looked up; up to ``max_matches`` of its
occurrences, spread evenly over the range, give the continuations; their ``num_draft``-token trie
is counted, and the nodes that enough occurrences went through (``min_count`` occurrences and a
``min_fraction`` share of them) become the draft tree, most frequent first.

The range is sorted by what follows the n-gram too, so evenly spaced samples are a stratified
sample of the continuations: their shares estimate the corpus's without a full count.

Where this differs from the n-gram drafter (drafters/ngram.py): that one searches the request's
own text and keeps no corpus; this one searches a fixed corpus (by default the ShareGPT answers,
tokenized by the target's tokenizer), which covers phrasing the request has not used yet.

Candidates are a deterministic function of the context, so the tree is DETERMINISTIC and verified
exactly by the point-mass rule at any temperature; a ``union`` member too.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from drafters.base import BudgetKnobs, DraftContext, DraftTree, StatelessDrafter, TargetSizes, register
from specdec import assets, packaged_models
from specdec.files import write_atomically
from specdec.protocols import Target
from specdec.tree import token_trie

SEPARATOR = -1  # between documents: never in a context, so no match or continuation crosses it
SORT_DEPTH = 16  # suffixes are ordered by their first SORT_DEPTH tokens: the longest n-gram searchable
FORMAT_VERSION = 1


def sort_suffixes(tokens: np.ndarray, depth: int = SORT_DEPTH) -> np.ndarray:  # [L] int64
    """Start positions of every suffix of ``tokens`` [L] (int32, SEPARATOR between documents), in
    lexicographic order of their first ``depth`` tokens (ties by position); SEPARATOR and the end
    of the corpus sort first.

    Prefix doubling: after a pass with offset h a suffix's rank orders its first 2h tokens, so
    log2(depth) sorts of L keys do it.
    """
    length = len(tokens)
    if length >= 2**31:
        raise ValueError(f"a datastore holds fewer than 2^31 tokens; got {length}")
    rank = tokens.astype(np.int64) + 1  # SEPARATOR -> 0
    span = 1
    while span < depth:
        following = np.zeros(length, dtype=np.int64)  # past the end sorts like a separator
        following[:-span] = rank[span:]
        key = rank * (int(rank.max()) + 1) + following  # < 2^62 since ranks < 2^31
        order = np.argsort(key, kind="stable")
        sorted_key = key[order]
        rank = np.empty(length, dtype=np.int64)
        rank[order] = np.cumsum(np.concatenate([[0], sorted_key[1:] != sorted_key[:-1]]))
        span *= 2
    return np.argsort(rank, kind="stable")


class Datastore:
    """A corpus and its sorted suffixes (see the module docstring), as loaded from ``save``'s folder."""

    def __init__(self, tokens: np.ndarray, suffixes: np.ndarray, meta: dict, first: np.ndarray | None = None) -> None:
        self.tokens = tokens  # [L] int32, SEPARATOR between documents
        self.suffixes = suffixes  # [L] int32/int64, start positions sorted by their first SORT_DEPTH tokens
        self.meta = meta  # vocab_size, source, tokenizer, ...
        self.vocab_size = int(meta["vocab_size"])
        # a key packs `per_key` tokens (token t as field t + 1, 0 = separator or end) so that
        # numpy's searchsorted narrows a range by several tokens at once
        self._bits = max(1, self.vocab_size.bit_length())
        self._per_key = 64 // self._bits
        # [L] uint64, the first per_key tokens of each suffix, packed
        self.first = self._pack(self.suffixes, 0) if first is None else first

    @classmethod
    def build(cls, documents: Iterable[Sequence[int]], vocab_size: int, meta: dict | None = None) -> Datastore:
        parts = []
        for document in documents:
            if len(document):
                parts += [np.asarray(document, dtype=np.int32), np.array([SEPARATOR], dtype=np.int32)]
        if not parts:
            raise ValueError("a datastore needs at least one non-empty document")
        tokens = np.concatenate(parts)
        if tokens.max() >= vocab_size or (tokens < SEPARATOR).any():
            raise ValueError(f"document tokens must lie in [0, {vocab_size}); found {tokens.min()}..{tokens.max()}")
        suffixes = sort_suffixes(tokens).astype(np.int32)
        return cls(tokens, suffixes, {**(meta or {}), "vocab_size": vocab_size, "format": FORMAT_VERSION})

    def save(self, path: str | Path) -> None:
        """A new folder of .npy arrays + meta.json, written atomically (a folder that exists is complete)."""
        if Path(path).exists():
            raise FileExistsError(f"{path} exists; remove it or save the datastore elsewhere")

        def write(staged: Path) -> None:
            staged.mkdir()
            np.save(staged / "tokens.npy", self.tokens)
            np.save(staged / "suffixes.npy", self.suffixes)
            np.save(staged / "first.npy", self.first)
            (staged / "meta.json").write_text(json.dumps(self.meta, indent=2))

        write_atomically(Path(path), write)

    @classmethod
    def load(cls, path: str | Path) -> Datastore:
        path = Path(path)
        files = [path / name for name in ("tokens.npy", "suffixes.npy", "first.npy", "meta.json")]
        if not all(f.is_file() for f in files):
            raise FileNotFoundError(
                f"{path} is not a datastore folder (needs tokens.npy, suffixes.npy, first.npy, meta.json); build one with "
                f"`python -m experiments.build_datastore --tokenizer TARGET_FOLDER --jsonl FILE --out {path}`"
            )
        meta = json.loads(files[3].read_text())
        if meta.get("format") != FORMAT_VERSION:
            raise ValueError(f"datastore {path} has format {meta.get('format')}, this code reads {FORMAT_VERSION}; rebuild it")
        # memory-mapped: processes using one datastore share its pages
        tokens, suffixes, first = (np.load(f, mmap_mode="r") for f in files[:3])
        return cls(tokens, suffixes, meta, first)

    def __len__(self) -> int:
        return len(self.tokens)

    def _pack(self, starts: np.ndarray, offset: int) -> np.ndarray:  # [M] uint64
        key = np.zeros(len(starts), dtype=np.uint64)
        for j in range(self._per_key):
            at = np.asarray(starts, dtype=np.int64) + offset + j
            inside = at < len(self.tokens)
            field = np.zeros(len(starts), dtype=np.uint64)
            field[inside] = (self.tokens[at[inside]].astype(np.int64) + 1).astype(np.uint64)
            key = (key << np.uint64(self._bits)) | field
        return key

    def _query_bounds(self, chunk: Sequence[int]) -> tuple[np.uint64, np.uint64]:
        """The smallest and largest key of a suffix that starts with ``chunk`` (<= per_key tokens)."""
        low = high = 0
        for j in range(self._per_key):
            field = chunk[j] + 1 if j < len(chunk) else None
            low = (low << self._bits) | (field if field is not None else 0)
            high = (high << self._bits) | (field if field is not None else (1 << self._bits) - 1)
        return np.uint64(low), np.uint64(high)

    def find(self, ngram: Sequence[int]) -> tuple[int, int]:
        """The range [lo, hi) of ``suffixes`` whose suffixes start with ``ngram`` (lo == hi: none)."""
        if not 1 <= len(ngram) <= SORT_DEPTH:
            raise ValueError(f"searchable n-grams have 1..{SORT_DEPTH} tokens; got {len(ngram)}")
        lo, hi = 0, len(self.suffixes)
        for start in range(0, len(ngram), self._per_key):
            keys = self.first[lo:hi] if start == 0 else self._pack(self.suffixes[lo:hi], start)
            low, high = self._query_bounds(ngram[start : start + self._per_key])
            lo, hi = lo + int(np.searchsorted(keys, low, "left")), lo + int(np.searchsorted(keys, high, "right"))
            if lo == hi:
                break
        return lo, hi

    def longest_match(self, context: Sequence[int], min_ngram: int, max_ngram: int) -> tuple[int, int, int] | None:
        """(n, lo, hi) for the longest suffix n-gram of ``context`` with n in [min_ngram, max_ngram]
        that occurs; None if none does. Searched upwards: an n-gram that does not occur has no
        longer extension that does."""
        best = None
        for n in range(min_ngram, min(max_ngram, len(context)) + 1):
            lo, hi = self.find(context[len(context) - n :])
            if lo == hi:
                break
            best = (n, lo, hi)
        return best

    def continuations(self, lo: int, hi: int, n: int, length: int, max_matches: int) -> np.ndarray:  # [M, length]
        """The ``length`` tokens after the n-gram at up to ``max_matches`` occurrences evenly spread
        over [lo, hi); SEPARATOR from the end of a document (or corpus) on."""
        count = min(hi - lo, max_matches)
        picked = self.suffixes[lo + (np.arange(count, dtype=np.int64) * (hi - lo)) // count]
        at = picked.astype(np.int64)[:, None] + n + np.arange(length)
        following = np.where(at < len(self.tokens), self.tokens[np.minimum(at, len(self.tokens) - 1)], SEPARATOR)
        ended = np.cumsum(following == SEPARATOR, axis=1) > 0
        return np.where(ended, SEPARATOR, following)


NO_TOKENIZER = ("drafter=retrieval's default datastore is ShareGPT's answers in the target's own tokens, and {} has "
                "no tokenizer folder; build one (python -m experiments.build_datastore) and pass drafter.datastore=FOLDER")


def sharegpt_datastore(target: Target | None = None) -> Path:
    """The default datastore: every assistant answer of the packaged ShareGPT records, tokenized by
    the tokenizer in the folder a model target was loaded from (SmolLM2's without a target); built
    on first use, then cached per folder, so each target drafts from text in its own tokens."""
    loaded_from = target.folder if target is not None and target.kind == "model" else None
    if target is None:
        folder, vocab_size = packaged_models.smollm2_path(), None
    elif loaded_from is not None and loaded_from.is_dir():
        folder, vocab_size = loaded_from, target.vocab_size
    else:
        raise ValueError(NO_TOKENIZER.format(f"a {type(target).__name__} not loaded from a model folder"))
    folder = folder.resolve()
    digest = hashlib.sha256(str(folder).encode()).hexdigest()[:8]
    destination = packaged_models.cache_dir() / "datastores" / f"{folder.name}-{digest}-sharegpt-answers"
    if not destination.is_dir():
        from transformers import AutoTokenizer  # transformers: ~16 s to import cold, for building this datastore alone

        tokenizer = AutoTokenizer.from_pretrained(folder)
        ids = sharegpt_answer_ids(tokenizer)
        meta = {"source": "sharegpt assistant answers", "tokenizer": str(folder), "documents": len(ids)}
        Datastore.build(ids, vocab_size or len(tokenizer), meta).save(destination)
    return destination


def check_datastore(options: Mapping[str, Any], target: TargetSizes) -> None:
    """What the drafter refuses, before the target loads: a default datastore for a target without a
    tokenizer, or a datastore folder tokenized with a larger vocabulary than the target's."""
    datastore = options.get("datastore")
    if datastore is None:
        if target.kind != "model":
            raise ValueError(NO_TOKENIZER.format(target.name))
        return
    try:
        meta = json.loads((Path(str(datastore)) / "meta.json").read_text())
        vocab_size = int(meta["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return  # Datastore.load names what is missing or damaged when the drafter is built
    if vocab_size > target.vocab_size:
        raise ValueError(foreign_vocabulary(vocab_size, meta.get("tokenizer"), target.vocab_size))


def foreign_vocabulary(store: int, tokenizer: str | None, target: int) -> str:
    return (f"the datastore was tokenized with a {store}-token vocabulary ({tokenizer or 'tokenizer not recorded'}) but "
            f"the target has {target} tokens; build one with the target's tokenizer (experiments/build_datastore.py)")


def sharegpt_answer_ids(tokenizer) -> list[list[int]]:
    """Every non-blank assistant answer of the packaged ShareGPT records, one token list each."""
    answers = [text for conversation in assets.load_sharegpt_conversations(user_first=False)
               for role, text in conversation.turns if role == "assistant" and text.strip()]
    return tokenizer(answers, add_special_tokens=False)["input_ids"]


@register("retrieval", budget=BudgetKnobs(depth="num_draft", nodes="max_nodes"), check=check_datastore)
class RetrievalDrafter(StatelessDrafter):
    def __init__(
        self,
        target: Target | None = None,
        datastore: str | Path | Datastore | None = None,
        num_draft: int = 4,
        max_ngram: int = 8,
        min_ngram: int = 2,
        max_matches: int = 256,
        min_count: int = 2,
        min_fraction: float = 0.1,
        max_nodes: int = 6,
    ) -> None:
        """datastore: a folder written by ``Datastore.save`` (experiments/build_datastore.py), or a
        loaded Datastore; None = the ShareGPT answers in the target's own tokens (`sharegpt_datastore`)."""
        if not 1 <= min_ngram <= max_ngram <= SORT_DEPTH:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram <= {SORT_DEPTH}; got {min_ngram}, {max_ngram}")
        if num_draft < 1 or max_matches < 1 or min_count < 1 or max_nodes < 1:
            raise ValueError(
                f"num_draft, max_matches, min_count and max_nodes must be >= 1; "
                f"got {num_draft}, {max_matches}, {min_count}, {max_nodes}"
            )
        if not 0.0 <= min_fraction <= 1.0:
            raise ValueError(f"min_fraction is a share of the matches, in [0, 1]; got {min_fraction}")
        if isinstance(datastore, Datastore):
            self.store = datastore
        else:
            self.store = Datastore.load(sharegpt_datastore(target) if datastore is None else datastore)
        if target is not None and self.store.vocab_size > target.vocab_size:
            raise ValueError(foreign_vocabulary(self.store.vocab_size, self.store.meta.get("tokenizer"), target.vocab_size))
        self.num_draft, self.min_ngram, self.max_ngram = num_draft, min_ngram, max_ngram
        self.max_matches, self.min_count, self.min_fraction, self.max_nodes = max_matches, min_count, min_fraction, max_nodes

    def propose(self, ctx: DraftContext) -> DraftTree:
        drafts, scores = [], []
        for b, length in enumerate(ctx.lengths.tolist()):
            paths, confidence = self.drafts(ctx.tokens[b, max(0, length - self.max_ngram) : length].tolist())
            drafts.append(paths)
            scores.append(confidence)
        return token_trie(drafts, ctx.tokens.device, scores)

    def drafts(self, context: Sequence[int]) -> tuple[list[list[int]], list[list[float]]]:
        """The kept trie nodes' token paths, most frequent first (a parent before its children),
        and each path token's confidence: its share of the sampled occurrences, shrunk by
        occurrences / (occurrences + 3) so that a continuation seen once or twice in the whole
        corpus does not look certain."""
        match = self.store.longest_match(context, self.min_ngram, self.max_ngram)
        if match is None:
            return [], []
        n, lo, hi = match
        following = self.store.continuations(lo, hi, n, self.num_draft, self.max_matches)
        through: Counter[tuple[int, ...]] = Counter()  # trie node -> sampled occurrences through it
        for row in following.tolist():
            for depth in range(len(row)):
                if row[depth] == SEPARATOR:
                    break
                through[tuple(row[: depth + 1])] += 1
        share = {node: count / len(following) for node, count in through.items()}
        occurrences = {node: share[node] * (hi - lo) for node in through}
        kept = [node for node in through if occurrences[node] >= self.min_count and share[node] >= self.min_fraction]
        # a child never has more occurrences than its parent, so this order keeps the set closed under ancestors
        kept = sorted(kept, key=lambda node: (-through[node], len(node)))[: self.max_nodes]

        def confidence(node: tuple[int, ...]) -> float:
            return share[node] * occurrences[node] / (occurrences[node] + 3)

        return [list(node) for node in kept], [[confidence(node[:d]) for d in range(1, len(node) + 1)] for node in kept]
