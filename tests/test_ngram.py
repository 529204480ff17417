"""N-gram drafting from the request's own context: the incremental index finds what a plain scan
finds, frequency ranking, exactness with ragged and continuous batches, and lookup cost that does
not grow with the context."""

from __future__ import annotations

import random
import time

import pytest
import torch
from tiny_models import greedy_outputs, sharp_llama

from drafters.base import build
from drafters.ngram import NgramDrafter, NgramIndex
from specdec.decode import SpecDecoder
from specdec.noise import RequestRNG
from specdec.protocols import DraftContext
from specdec.sampling import SamplingParams
from verifiers import reference

PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [3], [9, 10, 11, 9, 10, 11, 12, 9, 10]]


def scanned_continuations(sequence: list[int], num_draft: int, min_ngram: int, max_ngram: int) -> list[list[int]]:
    """Ground truth by a plain scan: every earlier occurrence of the longest suffix n-gram that
    has one, the tokens after it, most recent first."""
    length = len(sequence)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = sequence[length - n :]
        starts = [p for p in range(n, length) if sequence[p - n : p] == suffix]
        if starts:
            return [sequence[p : p + num_draft] for p in reversed(starts)]
    return []


def test_incremental_index_finds_what_a_scan_finds():
    rng = random.Random(0)
    for trial in range(200):
        sequence = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        index = NgramIndex(1, 3)
        cut = rng.randrange(len(sequence) + 1)
        index.extend(sequence[:cut])  # in two pieces, as tokens arrive step by step
        index.extend(sequence[cut:])
        found = [draft for draft, _ in index.continuations(num_draft=4, max_matches=1000)]
        assert found == scanned_continuations(sequence, 4, 1, 3), (trial, sequence)


def test_recency_and_frequency_ranking():
    # after "1 2": 9 8 twice long ago, 7 6 most recently
    sequence = [1, 2, 9, 8, 1, 2, 9, 8, 1, 2, 7, 6, 1, 2]
    index = NgramIndex(1, 2)
    index.extend(sequence)
    recency = NgramDrafter(num_draft=2, max_branches=2, rank="recency")
    frequency = NgramDrafter(num_draft=2, max_branches=2, rank="frequency")
    assert recency.branches(index)[0] == [[7, 6], [9, 8]]
    # confidence: the share of the 3 occurrences of "1 2" that went on through each token
    assert frequency.branches(index) == ([[9, 8], [7, 6]], [[2 / 3, 2 / 3], [1 / 3, 1 / 3]])
    assert NgramDrafter(num_draft=2, max_branches=2, rank="frequency", max_matches=1).branches(index) == ([[7, 6]], [[1.0, 1.0]])


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="rank must be one of recency, frequency"):
        NgramDrafter(rank="popular")
    with pytest.raises(ValueError, match="max_matches must be >= 1"):
        NgramDrafter(max_matches=0)


target = pytest.fixture(scope="module", name="target")(sharp_llama)


@pytest.fixture(scope="module")
def plain(target):
    return greedy_outputs(target, PROMPTS, 24)


@pytest.mark.parametrize(
    "options",
    [{}, {"max_branches": 3}, {"rank": "frequency", "max_branches": 3, "max_ngram": 4, "num_draft": 4}],
    ids=["chain", "recency-tree", "frequency-tree"],
)
@pytest.mark.parametrize("prompts,max_batch", [(PROMPTS[:1], None), (PROMPTS, None), (PROMPTS, 2)],
                         ids=["batch1", "ragged3", "admitted"])
def test_greedy_equals_plain_decoding(target, plain, options, prompts, max_batch):
    drafter = build("ngram", target, **options)
    out = SpecDecoder(target, drafter, reference.verify).generate(prompts, 24, SamplingParams(0.0), max_batch=max_batch)
    assert out.outputs == plain[: len(prompts)]
    assert out.stats.tau > 1.0  # the tiny model repeats itself: its own text drafts for it


def test_lookup_cost_does_not_grow_with_a_16k_context():
    rng = random.Random(0)
    phrases = [[rng.randrange(100) for _ in range(8)] for _ in range(20)]
    text = [token for _ in range(2048) for token in rng.choice(phrases)]  # 16384 tokens, many repeats
    tokens = torch.tensor([text + [0] * 200])
    drafter = NgramDrafter(num_draft=5, max_ngram=4, max_branches=4, rank="frequency")
    drafter.reset(1, tokens.shape[1])

    def propose(length: int):
        ctx = DraftContext(tokens, torch.tensor([length]), (), torch.tensor([1]), SamplingParams(0.0),
                           RequestRNG(torch.tensor([0]), 1))
        return drafter.propose(ctx)

    start = time.perf_counter()
    tree = propose(len(text))  # indexes the whole context once
    first = time.perf_counter() - start
    assert tree.num_nodes.item() >= 5
    start = time.perf_counter()
    for step in range(200):  # one new token per step, as in decoding
        tokens[0, len(text) + step] = text[step]
        propose(len(text) + step + 1)
    per_lookup = (time.perf_counter() - start) / 200
    # ~0.1 ms here; a scan of the context costs far more and grows with it. Generous for busy machines.
    assert per_lookup < 0.005, f"{per_lookup * 1e3:.2f} ms per lookup on a 16k context"
    assert first < 2.0, f"indexing 16k tokens took {first:.2f} s"
