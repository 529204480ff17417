"""Lookahead decoding: the window's Jacobi step and the n-gram pool on a hand example, the merged
tree against token_trie, greedy equality with plain decoding (ragged and continuous batches, and as
a union member), outputs independent of batch neighbours, tau > 1, and the real model (slow).
Exactness at T = 1: tests/test_exactness.py (test_lookahead_is_exact)."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import greedy_outputs, sharp_llama

from drafters.base import build
from drafters.lookahead import LookaheadDrafter, merge_slots
from specdec.decode import SpecDecoder
from specdec.noise import RequestRNG
from specdec.protocols import DraftContext, VerifyResult
from specdec.sampling import SamplingParams
from specdec.synthetic import SyntheticTarget
from specdec.target import HFTarget
from specdec.tree import SiblingMode, prune_to_depth, token_paths, token_trie
from verifiers import reference

GREEDY = SamplingParams(0.0)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [3], [9, 10, 11, 9, 10, 11, 12, 9, 10]]


def context(tokens: list[int]) -> DraftContext:
    return DraftContext(torch.tensor([tokens]), torch.tensor([len(tokens)]), (), torch.tensor([1]), GREEDY,
                        RequestRNG(torch.tensor([0]), 1))


def logits_after(tree, wanted: dict[int, int], vocab: int = 64) -> torch.Tensor:
    """[1, N+1, V] logits whose argmax in row r is wanted[r] (0 elsewhere)."""
    logits = torch.zeros(1, tree.max_nodes + 1, vocab)
    logits[0, :, 0] = 1.0
    for row, token in wanted.items():
        logits[0, row, token] = 2.0
    return logits


def nothing_accepted(tree) -> VerifyResult:
    return VerifyResult(torch.full((1, tree.max_nodes), -1), torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))


def test_the_window_and_the_pool_on_a_hand_example():
    drafter = LookaheadDrafter(window=3, ngram=3, guesses=2)
    drafter.reset(1, 64)
    drafter.propose(context([1, 2, 3, 9]))  # fills the window from the prompt
    drafter._roots = None  # that proposal is not verified: set the window by hand instead
    # root 9; level 0 = [root, 11, 12], level 1 = [21, 22, 23]; the pool knows two continuations of 9
    drafter.levels()[0] = torch.tensor([[0, 11, 12], [21, 22, 23]])
    drafter.pool(0)[9] = [(5, 6), (21, 7)]  # least recently seen first
    tree = drafter.propose(context([1, 2, 3, 9]))
    # guesses most recent first, then each column's trajectory: [21], [11, 22], [11, 12, 23];
    # column 0's trajectory is the first guess's prefix, so they share node 21
    drafts = [[21, 7], [5, 6], [21], [11, 22], [11, 12, 23]]
    expected = token_trie([drafts])
    assert tree.mode is SiblingMode.DETERMINISTIC
    assert tree.num_nodes.tolist() == [8] and tree.tokens.tolist() == expected.tokens.tolist()
    assert tree.parents.tolist() == expected.parents.tolist()
    # confidence: the share of the drafted guesses through a node (1/2 each), 0 for window-only nodes
    assert tree.confidence.tolist() == [[0.5, 0.5, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0]]
    # the columns' last nodes: 21 (node 0, row 1), 22 (node 5, row 6), 23 (node 7, row 8)
    rows, found = drafter.trajectory_rows(tree)
    assert rows.tolist() == [[1, 6, 8]] and found.all()
    drafter.observe(tree, logits_after(tree, {1: 31, 6: 32, 8: 33}), nothing_accepted(tree))
    # the window slides one level; its first Jacobi step collects no n-gram (level 1 came from the prompt)
    assert drafter.levels()[0, :, 1:].tolist() == [[22, 23], [32, 33]] and drafter.levels()[0, 1, 0] == 31
    assert drafter.pool(0) == {9: [(5, 6), (21, 7)]}

    # next step, root 21: no guesses for it; trajectories [31], [22, 32], [22, 23, 33]
    tree = drafter.propose(context([1, 2, 3, 9, 21]))
    assert token_paths(tree) == [[[31], [22, 32], [22, 23, 33]]]
    assert drafter.trajectory_rows(tree)[0].tolist() == [[1, 3, 5]]
    drafter.observe(tree, logits_after(tree, {1: 41, 3: 42, 5: 43}), nothing_accepted(tree))
    # each column's n-gram (first level with the root, level 1, the new token), keyed by its first token
    assert drafter.pool(0) == {9: [(5, 6), (21, 7)], 21: [(31, 41)], 22: [(32, 42)], 23: [(33, 43)]}
    assert drafter.levels()[0, :, 1:].tolist() == [[32, 33], [42, 43]]

    # a tree cut short (max_new_tokens): columns it lacks keep their last token and yield no n-gram
    tree = prune_to_depth(drafter.propose(context([1, 2, 3, 9, 21, 9])), torch.tensor([1]))
    rows, found = drafter.trajectory_rows(tree)
    assert found.tolist() == [[True, False, False]]  # column 0's trajectory [41] has depth 1
    drafter.observe(tree, logits_after(tree, {int(rows[0, 0]): 51}), nothing_accepted(tree))
    assert drafter.levels()[0, 1].tolist() == [51, 42, 43]
    assert drafter.pool(0)[9] == [(5, 6), (21, 7), (41, 51)][-2:]  # LRU: (5, 6) evicted past 2 per key


def test_the_pool_keeps_the_most_recently_seen_per_key():
    drafter = LookaheadDrafter(window=1, ngram=3, guesses=2)
    drafter.reset(1, 16)
    drafter._collect([[[4, 1, 1], [4, 2, 2]]])
    drafter._collect([[[4, 1, 1]]])  # seen again: now the most recent
    assert drafter.pool(0)[4] == [(2, 2), (1, 1)]
    drafter._collect([[[4, 3, 3], [-1, 9, 9]]])  # a full key evicts its least recently seen; key -1 = none
    assert drafter.pool(0) == {4: [(1, 1), (3, 3)]}


def test_merged_slots_equal_the_token_trie():
    rng = random.Random(0)
    for trial in range(100):
        batch, n, g = rng.randrange(1, 4), rng.randrange(1, 4), rng.randrange(0, 4)
        counts = [rng.randrange(g + 1) for _ in range(batch)]
        guesses = [[[rng.randrange(3) for _ in range(n)] for _ in range(g)] for _ in range(batch)]
        tails = [[[rng.randrange(3) for _ in range(rng.randrange(1, 4))]] for _ in range(batch)]  # one more chain
        width = max(len(t[0]) for t in tails)
        tokens = torch.tensor([[token for guess in guesses[b] for token in guess] + tails[b][0] + [0] * (width - len(tails[b][0])) for b in range(batch)])
        valid = torch.tensor([[i < counts[b] for i in range(g) for _ in range(n)] + [k < len(tails[b][0]) for k in range(width)]
                              for b in range(batch)])
        parents = [s - 1 if s % n else -1 for s in range(g * n)] + [g * n + k - 1 if k else -1 for k in range(width)]
        tree = merge_slots(tokens, valid, parents, torch.zeros(tokens.shape))
        expected = token_trie([guesses[b][: counts[b]] + tails[b] for b in range(batch)])
        tree.validate(vocab_size=3)
        assert tree.num_nodes.tolist() == expected.num_nodes.tolist(), trial
        for b in range(batch):
            count = int(expected.num_nodes[b])
            assert tree.tokens[b, :count].tolist() == expected.tokens[b, :count].tolist(), trial
            assert tree.parents[b, :count].tolist() == expected.parents[b, :count].tolist(), trial


def test_a_proposal_is_the_token_trie_of_the_guesses_and_the_trajectories():
    """Random windows and pools over 3 tokens (so paths often coincide): the proposed tree is
    token_trie(guesses most recent first, then each column's trajectory), and trajectory_rows finds
    each column's last node."""
    rng = random.Random(1)
    for trial in range(60):
        window, ngram, guesses = rng.randrange(1, 5), rng.randrange(2, 5), rng.randrange(0, 4)
        batch = rng.randrange(1, 4)
        drafter = LookaheadDrafter(window=window, ngram=ngram, guesses=guesses)
        drafter.reset(batch, 64)
        prompts = [[rng.randrange(3) for _ in range(rng.randrange(1, 6))] for _ in range(batch)]
        tokens = torch.tensor([p + [0] * (6 - len(p)) for p in prompts])
        ctx = DraftContext(tokens, torch.tensor([len(p) for p in prompts]), (), torch.ones(batch, dtype=torch.int64),
                           GREEDY, RequestRNG(torch.arange(batch), 1))
        drafter.propose(ctx)  # fills the windows
        drafter.levels()[:] = torch.randint(0, 3, drafter.levels().shape, generator=torch.Generator().manual_seed(trial))
        for b, prompt in enumerate(prompts):
            drafter.pool(b)[prompt[-1]] = [tuple(rng.randrange(3) for _ in range(ngram - 1)) for _ in range(rng.randrange(guesses + 1))]
        tree = drafter.propose(ctx)
        tree.validate(vocab_size=3)
        levels = drafter.levels().tolist()
        columns = [[[levels[b][0][k] for k in range(1, i + 1)] + [levels[b][j][i] for j in range(1, ngram - 1)]
                    for i in range(window)] for b in range(batch)]
        drafts = [drafter.pool(b)[prompts[b][-1]][::-1] + [c for c in columns[b] if c] for b in range(batch)]
        expected = token_trie([[list(d) for d in request] for request in drafts])
        assert tree.num_nodes.tolist() == expected.num_nodes.tolist(), trial
        for b in range(batch):
            count = int(expected.num_nodes[b])
            assert tree.tokens[b, :count].tolist() == expected.tokens[b, :count].tolist(), trial
            assert tree.parents[b, :count].tolist() == expected.parents[b, :count].tolist(), trial
        rows, found = drafter.trajectory_rows(tree)
        assert found.all(), trial
        node_tokens, node_parents = tree.tokens.tolist(), tree.parents.tolist()
        for b in range(batch):
            for i, column in enumerate(columns[b]):
                path, node = [], int(rows[b, i]) - 1  # the row's token path, root excluded
                while node >= 0:
                    path.insert(0, node_tokens[b][node])
                    node = node_parents[b][node]
                assert path == column, (trial, b, i)


def test_a_one_column_jacobi_window_has_no_rows_of_its_own():
    """window=1, ngram=2: the window is the root itself (no nodes); the pool's bigrams still draft."""
    target = SyntheticTarget(vocab_size=16, order=1, sharpness=4.0, seed=3)
    plain = SpecDecoder(target, None, reference.verify).generate([[1, 2, 3], [4]], 30, GREEDY)
    out = SpecDecoder(target, LookaheadDrafter(target, window=1, ngram=2, guesses=2), reference.verify).generate(
        [[1, 2, 3], [4]], 30, GREEDY)
    assert out.outputs == plain.outputs


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="window >= 1, ngram >= 2 and guesses >= 0"):
        LookaheadDrafter(window=0)
    with pytest.raises(ValueError, match="ngram >= 2"):
        build("lookahead", SyntheticTarget(), ngram=1)


target = pytest.fixture(scope="module", name="target")(sharp_llama)


@pytest.fixture(scope="module")
def plain(target):
    return greedy_outputs(target, PROMPTS, 24)


@pytest.mark.parametrize("options", [{}, {"window": 4, "ngram": 4, "guesses": 4}, {"ngram": 2}],
                         ids=["default", "w4n4g4", "jacobi"])
@pytest.mark.parametrize("prompts,max_batch", [(PROMPTS[:1], None), (PROMPTS, None), (PROMPTS, 2)],
                         ids=["batch1", "ragged3", "admitted"])
def test_greedy_equals_plain_decoding(target, plain, options, prompts, max_batch):
    drafter = build("lookahead", target, **options)
    out = SpecDecoder(target, drafter, reference.verify).generate(prompts, 24, GREEDY, max_batch=max_batch)
    assert out.outputs == plain[: len(prompts)]
    assert out.stats.tau > 1.0  # the tiny model repeats itself: its Jacobi trajectories converge


def test_greedy_union_with_ngram_equals_plain_decoding(target, plain):
    union = build("union", target, members=[{"name": "lookahead", "window": 4, "ngram": 3}, {"name": "ngram"}])
    out = SpecDecoder(target, union, reference.verify).generate(PROMPTS, 24, GREEDY, max_batch=2)
    assert out.outputs == plain
    assert out.stats.tau > 1.0


class Counting(LookaheadDrafter):
    """Counts the guesses it drafts and the window rows that carried them to the pool."""

    guessed = 0

    def _guesses(self, roots, device):
        guesses, counts = super()._guesses(roots, device)
        self.guessed += int(counts.sum())
        return guesses, counts


def test_tau_above_one_on_a_repetitive_synthetic_target():
    """A peaked order-1 synthetic target: its greedy text settles into loops, which the Jacobi
    window learns; the pool's guesses are drafted and accepted."""
    target = SyntheticTarget(vocab_size=16, order=1, sharpness=4.0, seed=3)
    prompts = [[1, 2, 3], [4], [5, 6]]
    plain = SpecDecoder(target, None, reference.verify).generate(prompts, 48, GREEDY)
    drafter = Counting(target, window=4, ngram=3, guesses=3)
    out = SpecDecoder(target, drafter, reference.verify).generate(prompts, 48, GREEDY, max_batch=2)
    assert out.outputs == plain.outputs
    assert out.stats.tau > 1.2 and drafter.guessed > 0


def test_a_request_output_does_not_depend_on_its_batch_neighbours():
    target = SyntheticTarget(vocab_size=12, sharpness=1.0)
    decoder = SpecDecoder(target, LookaheadDrafter(target, window=3, ngram=3, guesses=2), reference.verify)
    sampling = SamplingParams(1.0, top_p=0.9)
    prompts = {"a": [1, 2, 3], "b": [4], "c": [5, 6], "d": [7, 8, 9, 10]}
    seeds = {"a": 11, "b": 12, "c": 13, "d": 14}

    def run(names, max_batch=None):
        out = decoder.generate([prompts[n] for n in names], 15, sampling, seeds=[seeds[n] for n in names], max_batch=max_batch)
        return dict(zip(names, out.outputs))

    alone = run(["c"])
    mixed = run(["a", "b", "c", "d"])
    queued = run(["d", "c", "a", "b"], max_batch=2)
    assert alone["c"] == mixed["c"] == queued["c"]
    assert mixed["a"] == queued["a"] and mixed["d"] == queued["d"] and mixed["b"] == queued["b"]


@pytest.mark.slow
def test_greedy_equals_plain_decoding_on_smollm2():
    from experiments.common.prompt_sets import encode_prompt, load_mtbench
    from specdec.packaged_models import load_smollm2

    model, tokenizer = load_smollm2()
    target = HFTarget(model, packed_gemm_from="auto", key="smollm2")
    prompts = [encode_prompt(tokenizer, p) for p in load_mtbench(2)]
    eos = tokenizer.eos_token_id
    plain = SpecDecoder(target, None, reference.verify).generate(prompts, 32, GREEDY, eos_token_id=eos)
    out = SpecDecoder(target, build("lookahead", target), reference.verify).generate(prompts, 32, GREEDY, eos_token_id=eos)
    assert out.outputs == plain.outputs


def test_the_exactness_setup_drafts_guesses():
    """tests/test_exactness.py::test_lookahead_is_exact exercises the pool's guesses, not only the window."""
    from test_exactness import LOOKAHEAD_EXACTNESS, PROMPT

    target = SyntheticTarget(vocab_size=3, sharpness=1.5, seed=0)
    drafter = Counting(target, **LOOKAHEAD_EXACTNESS)
    SpecDecoder(target, drafter, reference.verify).generate([PROMPT] * 1000, 5, SamplingParams(1.0))
    assert drafter.guessed > 100
