"""Token Recycling (drafters/recycling.py): the template, the matrix update from the target's logits
and the expansion on hand-built examples; prompt seeding; rows that follow their requests; greedy
equality with plain decoding alone, batched, under continuous batching and as a union member;
sampled outputs independent of batch neighbours; acceptance that rises as the matrix fills.
Exactness at T > 0: tests/test_exactness.py (test_token_recycling_is_exact)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import greedy_outputs, sharp_llama

from drafters import base as drafter_registry
from drafters.base import build
from drafters.recycling import UNKNOWN, prior_denominator, template
from specdec.decode import SpecDecoder
from specdec.noise import RequestRNG
from specdec.protocols import DraftContext, VerifyResult
from specdec.sampling import SamplingParams
from specdec.speedup import TreeShape
from specdec.synthetic import SyntheticTarget
from specdec.target import HFTarget
from specdec.tree import tree_from_parents
from verifiers import reference

GREEDY, SAMPLED = SamplingParams(0.0), SamplingParams(1.0)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [3], [9, 10, 11, 9, 10, 11, 12, 9, 10], [20, 21], [30, 31, 32, 33, 30, 31]]
SEEDS = [101, 102, 103, 104, 105]


def context(tokens: list[list[int]]) -> DraftContext:
    """A DraftContext over right-padded token rows (the root last in each)."""
    lengths = torch.tensor([len(row) for row in tokens])
    padded = torch.zeros(len(tokens), int(lengths.max()), dtype=torch.int64)
    for b, row in enumerate(tokens):
        padded[b, : len(row)] = torch.tensor(row)
    return DraftContext(padded, lengths, (), torch.zeros(len(tokens), dtype=torch.int64), GREEDY,
                        RequestRNG(torch.arange(len(tokens))))


def ranked_logits(rows: list[list[list[int]]], vocab: int) -> torch.Tensor:
    """[B, R, V] logits whose top tokens are, per row, the listed ones in that order."""
    logits = torch.zeros(len(rows), len(rows[0]), vocab)
    for b, request in enumerate(rows):
        for r, best in enumerate(request):
            for place, token in enumerate(best):
                logits[b, r, token] = 10.0 - place
    return logits


def matrix(drafter, b: int | None = None) -> torch.Tensor:
    return drafter.matrix if b is None else drafter.matrix[b]


# ----- the template -----


def test_the_template_keeps_the_paths_of_highest_prior():
    # prior = prod 1 / (2 (r + 1)): 1/2 for (0); 1/4 for (1) and (0, 0); 1/6 for (2); 1/8 for
    # (0, 1), (1, 0), (0, 0, 0), (3): the shallower first on ties, then the lower ranks
    assert [prior_denominator(p) for p in [(0,), (1,), (0, 0), (2,), (0, 1), (0, 0, 0)]] == [2, 4, 4, 6, 8, 8]
    assert template(3, 3, 7) == [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    assert template(3, 4, 6) == [(0,), (1,), (2,), (3,), (0, 0), (0, 1)]
    assert template(1, 2, 5) == [(0,), (1,)]  # all that depth 1 and top_k 2 hold
    assert template(2, 2, 100) == [(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)]
    for depth, top_k, total in [(4, 4, 30), (6, 2, 20), (3, 8, 40)]:
        paths = template(depth, top_k, total)
        assert len(paths) == total and set(paths) >= {p[:-1] for p in paths if len(p) > 1}  # a tree
        assert max(map(len, paths)) <= depth and max(max(p) for p in paths) < top_k
        worst_in = max(prior_denominator(p) for p in paths)
        children = {p + (r,) for p in paths for r in range(top_k) if len(p) < depth} | {(r,) for r in range(top_k)}
        assert all(prior_denominator(c) >= worst_in for c in children - set(paths))  # nothing better left out


def test_registration_budget_knobs_and_shape():
    assert drafter_registry.budget_knobs("recycling") == drafter_registry.BudgetKnobs(depth="depth", nodes="total_tokens")
    assert drafter_registry.tree_shape("recycling", {"top_k": 4}) == TreeShape(children=4)
    target = SyntheticTarget(vocab_size=6)
    for bad in [{"depth": 0}, {"top_k": 0}, {"total_tokens": 0}]:
        with pytest.raises(ValueError, match="depth, top_k and total_tokens >= 1"):
            build("recycling", target, **bad)
    with pytest.raises(ValueError, match="top_k=7 exceeds the target's vocabulary of 6"):
        build("recycling", target, top_k=7)
    with pytest.raises(ValueError, match="shared"):
        build("recycling", target, shared="yes")


# ----- the matrix update and the expansion -----


def step(drafter, roots: list[int], tokens, parents, num_nodes, accepted, logits_rows, vocab):
    """Propose (to give the drafter its roots), then observe a hand-built tree and logits."""
    drafter.propose(context([[root] for root in roots]))
    tree = tree_from_parents(torch.tensor(tokens), torch.tensor(parents), drafter_registry.SiblingMode.DETERMINISTIC,
                             num_nodes=torch.tensor(num_nodes))
    accepted_nodes = torch.tensor(accepted)
    num_accepted = (accepted_nodes >= 0).sum(1)
    result = VerifyResult(accepted_nodes, num_accepted, torch.zeros(len(roots), dtype=torch.int64))
    drafter.observe(tree, ranked_logits(logits_rows, vocab), result)


# request 0: root 1; node 0 = 3 (accepted), node 1 = 4 under it, node 2 = 3 again (rejected)
# request 1: root 3; node 0 = 4 (rejected); two padding nodes (4 and 7) with logits of their own
HAND_TREE = dict(
    roots=[1, 3],
    tokens=[[3, 4, 3], [4, 4, 7]],
    parents=[[-1, 0, -1], [-1, 0, 1]],
    num_nodes=[3, 1],
    accepted=[[0, -1, -1], [-1, -1, -1]],
    logits_rows=[[[5, 6], [7, 8], [2, 9], [0, 1]], [[1, 2], [6, 5], [9, 8], [9, 8]]],
    vocab=10,
)


def test_every_row_of_the_tree_updates_its_tokens_candidates():
    target = SyntheticTarget(vocab_size=10)
    drafter = build("recycling", target, top_k=2, seed_from_prompt=False)
    drafter.reset(2, 16)
    step(drafter, **HAND_TREE)
    own, other = matrix(drafter, 0), matrix(drafter, 1)
    assert own[1].tolist() == [5, 6]  # the root's row: the logits after the root
    assert own[3].tolist() == [7, 8]  # 3 at an accepted row and at a later rejected one: the accepted wins
    assert own[4].tolist() == [2, 9]  # a rejected node's candidates are recycled too
    assert other[3].tolist() == [1, 2] and other[4].tolist() == [6, 5]  # padding rows write nothing
    assert other[7].tolist() == [UNKNOWN] * 2 and other[1].tolist() == [UNKNOWN] * 2  # nor a neighbour's rows
    assert int((matrix(drafter) != UNKNOWN).sum()) == 2 * 5

    # among rejected rows of one token the later wins; an accepted row wins over any rejected
    step(drafter, roots=[2, 2], tokens=[[5, 5, 6], [6, 6, 6]], parents=[[-1, -1, 1], [-1, 0, 1]], num_nodes=[3, 3],
         accepted=[[-1, -1, -1], [0, 1, -1]], logits_rows=[[[0, 1], [1, 2], [2, 3], [3, 4]], [[4, 5], [5, 6], [6, 7], [7, 8]]],
         vocab=10)
    assert matrix(drafter, 0)[5].tolist() == [2, 3] and matrix(drafter, 1)[6].tolist() == [6, 7]


def test_a_shared_matrix_takes_every_requests_rows():
    target = SyntheticTarget(vocab_size=10)
    drafter = build("recycling", target, top_k=2, shared=True, seed_from_prompt=False)
    drafter.reset(2, 16)
    step(drafter, **HAND_TREE)
    shared = matrix(drafter).clone()
    # token 3: request 0's accepted node beats request 1's root (both accepted: the later row wins)
    assert shared[3].tolist() == [7, 8] and shared[1].tolist() == [5, 6]
    assert shared[4].tolist() == [2, 9]  # request 0's rejected row 2 beats request 1's rejected row 1
    assert shared[7].tolist() == [UNKNOWN] * 2
    drafter.reset(1, 16)  # kept across batches: the hot start
    assert torch.equal(matrix(drafter), shared)


def test_the_template_is_expanded_from_the_matrix_and_unknown_entries_prune():
    target = SyntheticTarget(vocab_size=10)
    drafter = build("recycling", target, depth=3, top_k=2, total_tokens=6, seed_from_prompt=False)
    assert drafter.paths == [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    drafter.reset(2, 16)
    rows = matrix(drafter, 0)
    rows[1] = torch.tensor([2, 3])
    rows[2] = torch.tensor([4, UNKNOWN])
    rows[4] = torch.tensor([5, 6])  # token 3's row stays unknown: (1, 0) is pruned
    tree = drafter.propose(context([[0, 1], [7]]))  # request 1's root 7 is unknown: no draft
    tree.validate(vocab_size=10)
    assert tree.num_nodes.tolist() == [4, 0] and tree.max_nodes == 4
    assert tree.tokens[0].tolist() == [2, 3, 4, 5]  # (0), (1), (0, 0), (0, 0, 0)
    assert tree.parents[0].tolist() == [-1, -1, 0, 2]
    assert tree.confidence[0].tolist() == [1 / 2, 1 / 4, 1 / 4, 1 / 8]  # the prior of each node's path
    assert tree.mode is drafter_registry.SiblingMode.DETERMINISTIC


def test_the_prompt_seeds_unknown_rows_most_recent_first():
    target = SyntheticTarget(vocab_size=10)
    drafter = build("recycling", target, top_k=2)
    drafter.reset(2, 16)
    tree = drafter.propose(context([[5, 6, 5, 7, 5, 8, 5], [1, 2]]))
    own = matrix(drafter, 0)
    # 5 was followed by 6, 7, 8: the two most recent, latest first; the root (the last 5) by nothing yet
    assert own[5].tolist() == [8, 7] and own[6].tolist() == [5, UNKNOWN] and own[8].tolist() == [5, UNKNOWN]
    assert matrix(drafter, 1)[1].tolist() == [2, UNKNOWN] and matrix(drafter, 1)[5].tolist() == [UNKNOWN] * 2
    # the root 5 drafts 8 and 7, each followed by 5, the first 5 by 8 again: the first step drafts
    assert tree.num_nodes.tolist() == [5, 0] and tree.tokens[0].tolist() == [8, 7, 5, 5, 8]
    # shared: rows the target filled are left alone, unknown ones are seeded
    drafter = build("recycling", target, top_k=2, shared=True)
    drafter.reset(1, 16)
    matrix(drafter)[5] = torch.tensor([1, 2])
    drafter.propose(context([[5, 6, 5, 7, 6, 9]]))
    assert matrix(drafter)[5].tolist() == [1, 2] and matrix(drafter)[6].tolist() == [9, 5]


def test_matrices_follow_their_requests_through_retain_and_admit():
    target = SyntheticTarget(vocab_size=10)
    drafter = build("recycling", target, top_k=2, seed_from_prompt=True)
    drafter.reset(3, 16)
    drafter.propose(context([[1, 2], [3, 4], [5, 6]]))
    drafter.retain(torch.tensor([2, 0]))
    drafter.admit(1, 16)
    drafter.propose(context([[5, 6, 8], [1, 2, 8], [7, 9]]))  # the admitted request is seeded at its first proposal
    assert [matrix(drafter, b)[t, 0].item() for b, t in [(0, 5), (1, 1), (2, 7)]] == [6, 2, 9]
    assert matrix(drafter, 0)[1, 0].item() == UNKNOWN and matrix(drafter, 2)[5, 0].item() == UNKNOWN
    assert matrix(drafter, 0)[6, 0].item() == UNKNOWN  # seeded once, from the prompt only


# ----- through the decode loop -----


target = pytest.fixture(scope="module", name="target")(sharp_llama)


@pytest.fixture(scope="module")
def plain(target):
    return greedy_outputs(target, PROMPTS, 24)


OPTIONS = {
    "default": {},
    "shared": {"shared": True},
    "unseeded": {"seed_from_prompt": False},
    "wide": {"depth": 5, "top_k": 4, "total_tokens": 16},
}


BATCHES = {"batch1": (PROMPTS[:1], None), "ragged5": (PROMPTS, None), "admitted": (PROMPTS, 2)}
# the fast tier keeps every batch shape with the default options and every option on the ragged
# batch; the other pairs are integration's
GREEDY_CASES = [pytest.param(options, *BATCHES[batch], id=f"{batch}-{name}",
                             marks=() if name == "default" or batch == "ragged5" else pytest.mark.integration)
                for batch in BATCHES for name, options in OPTIONS.items()]


@pytest.mark.parametrize("options,prompts,max_batch", GREEDY_CASES)
def test_greedy_equals_plain_decoding(target, plain, options, prompts, max_batch):
    drafter = build("recycling", target, **options)
    out = SpecDecoder(target, drafter, reference.verify).generate(prompts, 24, GREEDY, max_batch=max_batch)
    assert out.outputs == plain[: len(prompts)]
    assert out.stats.tau > 1.2  # the tiny model repeats itself: recycled candidates draft for it
    if max_batch is not None:
        assert max(s["active_requests"] for s in out.steps) == max_batch


def test_sampled_output_of_a_request_does_not_depend_on_its_neighbours(target):
    decoder = SpecDecoder(target, build("recycling", target), reference.verify)
    alone = [decoder.generate([p], 16, SAMPLED, seeds=[s]).outputs[0] for p, s in zip(PROMPTS, SEEDS)]
    order = [3, 1, 4, 0, 2]  # other neighbours, other admission times
    for max_batch in (2, None):
        batched = decoder.generate([PROMPTS[i] for i in order], 16, SAMPLED, seeds=[SEEDS[i] for i in order],
                                   max_batch=max_batch)
        assert batched.outputs == [alone[i] for i in order], max_batch
    assert len({tuple(o) for o in alone}) == len(alone)


def test_acceptance_rises_as_the_matrix_fills(target):
    """The tiny model falls into loops: the first steps have little to recycle, the later ones draft
    the loop from the candidates the target gave the last time round."""
    out = SpecDecoder(target, build("recycling", target), reference.verify).generate(PROMPTS[:3], 48, GREEDY)
    accepted = [s["mean_accepted"] for s in out.steps]
    assert accepted[0] == 0.0  # nothing recycled yet (no prompt token follows the roots)
    third = len(accepted) // 3
    assert sum(accepted[-third:]) / third > sum(accepted[:third]) / third + 0.5
    assert out.stats.tau > 1.5


def test_a_shared_matrix_carries_over_to_the_next_call(target, plain):
    """The hot start: a second call on the same prompts drafts from what the first call recycled,
    where per-request matrices start over (the reason the config keeps them per request)."""
    taus = {}
    for shared in (False, True):
        decoder = SpecDecoder(target, build("recycling", target, shared=shared), reference.verify)
        first, second = (decoder.generate(PROMPTS[:2], 24, GREEDY) for _ in range(2))
        assert first.outputs == second.outputs == plain[:2]
        taus[shared] = (first.stats.tau, second.stats.tau)
    assert taus[False][0] == taus[False][1]
    assert taus[True][1] > taus[True][0] + 0.5


def test_recycling_as_a_union_member_is_greedy_equal(target, plain):
    union = build("union", target, members=[{"name": "ngram", "num_draft": 4}, {"name": "recycling"}])
    out = SpecDecoder(target, union, reference.verify).generate(PROMPTS, 24, GREEDY, max_batch=3)
    assert out.outputs == plain
    alone = SpecDecoder(target, build("ngram", target, num_draft=4), reference.verify).generate(PROMPTS, 24, GREEDY, max_batch=3)
    assert out.stats.tau > alone.stats.tau  # the member's recycled candidates add accepted tokens


# ----- the real model -----


@pytest.fixture(scope="module")
def smollm2():
    from experiments.common.prompt_sets import encode_prompt, load_mtbench
    from specdec.packaged_models import load_smollm2

    model, tokenizer = load_smollm2()
    target = HFTarget(model, packed_gemm_from="auto", key="smollm2")
    prompts = [encode_prompt(tokenizer, p) for p in load_mtbench(2)]
    plain = SpecDecoder(target, None, reference.verify).generate(prompts, 32, GREEDY, eos_token_id=tokenizer.eos_token_id)
    return target, tokenizer, prompts, plain


@pytest.mark.slow
@pytest.mark.parametrize("drafter", [{"name": "recycling"},
                                     {"name": "union", "members": [{"name": "eagle3"}, {"name": "recycling"}]}],
                         ids=["recycling", "union-eagle3"])
def test_smollm2_greedy_equals_plain_decoding(smollm2, drafter):
    target, tokenizer, prompts, plain = smollm2
    options = {key: value for key, value in drafter.items() if key != "name"}
    out = SpecDecoder(target, build(drafter["name"], target, **options), reference.verify).generate(
        prompts, 32, GREEDY, eos_token_id=tokenizer.eos_token_id, max_batch=1
    )
    assert out.outputs == plain.outputs
    assert out.stats.tau > 1.0
