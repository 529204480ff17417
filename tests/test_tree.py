"""Draft-tree invariants: topology views, builders, pruning and validation (specdec/tree.py)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from specdec.metrics import sibling_rank
from specdec.tree import (
    DraftTree,
    SiblingMode,
    TreeError,
    chain_tree,
    empty_tree,
    parents_from_paths,
    prune_to_depth,
    sorted_paths,
    tree_from_parents,
)

MEDUSA_CHOICES = [[0], [1], [0, 0], [0, 1], [1, 0]]


def random_tree(
    seed: int,
    batch: int = 4,
    max_nodes: int = 12,
    vocab: int = 7,
    mode: SiblingMode = SiblingMode.SAMPLED_IID,
    ragged: bool = True,
) -> DraftTree:
    """A random topology (parents[i] uniform in [-1, i-1]) with ragged num_nodes.

    Padding rows get arbitrary in-range garbage (tokens in the vocabulary, parents anywhere in
    [-1, N-1], even >= their own index): the contract says values beyond num_nodes are ignored.
    """
    gen = torch.Generator().manual_seed(seed)
    own = torch.arange(max_nodes).expand(batch, max_nodes)
    parents = (torch.rand(batch, max_nodes, generator=gen) * (own + 1)).long() - 1  # [-1, i-1]
    garbage = torch.randint(-1, max_nodes, (batch, max_nodes), generator=gen)
    if ragged:
        num_nodes = torch.randint(0, max_nodes + 1, (batch,), generator=gen)
        num_nodes[0] = max_nodes  # at least one full request
    else:
        num_nodes = torch.full((batch,), max_nodes)
    valid = own < num_nodes[:, None]
    parents = torch.where(valid, parents, garbage)
    tokens = torch.randint(0, vocab, (batch, max_nodes), generator=gen)
    probs = torch.softmax(torch.randn(batch, max_nodes, vocab, generator=gen), -1)
    draft_probs = None if mode is SiblingMode.DETERMINISTIC else probs
    return DraftTree(tokens, parents, draft_probs, num_nodes, mode)


def walk_to_root(parents: list[int], node: int) -> list[int]:
    """Node indices root-child -> node, by following parent pointers (the test's own reference)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


# --- parents -> ancestor mask -> paths ---------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_ancestor_mask_matches_parent_walk(seed):
    tree = random_tree(seed).validate(vocab_size=7)
    mask = tree.ancestor_mask
    n = tree.max_nodes
    assert mask.shape == (tree.batch_size, n + 1, n + 1) and mask.dtype == torch.bool
    for b in range(tree.batch_size):
        k = int(tree.num_nodes[b])
        parents = tree.parents[b].tolist()
        assert mask[b, 0].tolist() == [True] + [False] * n, "the root sees only itself"
        for i in range(n):
            expected = torch.zeros(n + 1, dtype=torch.bool)
            expected[0] = True
            expected[i + 1] = True
            if i < k:
                expected[[a + 1 for a in walk_to_root(parents, i)]] = True
            assert torch.equal(mask[b, i + 1], expected), (b, i, k)


@pytest.mark.parametrize("seed", range(6))
def test_parents_recovered_from_ancestor_mask(seed):
    """The parent is the latest strict ancestor (nodes are topologically ordered)."""
    tree = random_tree(seed, batch=3, max_nodes=15)
    mask = tree.ancestor_mask
    for b in range(tree.batch_size):
        for i in range(int(tree.num_nodes[b])):
            strict = [c - 1 for c in range(1, i + 1) if mask[b, i + 1, c]]
            recovered = max(strict) if strict else -1
            assert recovered == int(tree.parents[b, i])


@pytest.mark.parametrize("seed", range(6))
def test_paths_cover_every_leaf_once_and_follow_parents(seed):
    tree = random_tree(seed)
    all_paths = tree.paths()
    assert len(all_paths) == tree.batch_size
    mask = tree.ancestor_mask
    for b, paths in enumerate(all_paths):
        k = int(tree.num_nodes[b])
        parents = tree.parents[b, :k].tolist()
        leaves = sorted(set(range(k)) - set(parents))
        assert sorted(p[-1] for p in paths) == leaves
        assert set().union(*map(set, paths)) == set(range(k)) if k else paths == []
        for path in paths:
            assert path == walk_to_root(parents, path[-1])
            # mask row of the leaf = exactly the root and the path
            row = torch.zeros(tree.max_nodes + 1, dtype=torch.bool)
            row[[0] + [i + 1 for i in path]] = True
            assert torch.equal(mask[b, path[-1] + 1], row)


@pytest.mark.parametrize("seed", range(4))
def test_depth_and_positions(seed):
    tree = random_tree(seed)
    root_position = torch.tensor([3, 0, 17, 5])
    positions = tree.positions(root_position)
    assert tree.depth.dtype == torch.int64 and positions.shape == (4, tree.max_nodes + 1)
    for b in range(tree.batch_size):
        k = int(tree.num_nodes[b])
        parents = tree.parents[b].tolist()
        expected = [len(walk_to_root(parents, i)) if i < k else 0 for i in range(tree.max_nodes)]
        assert tree.depth[b].tolist() == expected
        assert positions[b].tolist() == [int(root_position[b]) + d for d in [0] + expected]


def test_padding_rows_ignore_in_range_garbage():
    """Same valid part, different padding garbage -> same views on the valid part."""
    a = random_tree(11)
    garbage = torch.randint(
        -1, a.max_nodes, a.parents.shape, generator=torch.Generator().manual_seed(1)
    )
    b = dataclasses.replace(a, parents=torch.where(a.node_valid(), a.parents, garbage))
    assert not torch.equal(a.parents, b.parents)
    assert torch.equal(a.depth, b.depth)
    assert torch.equal(a.ancestor_mask, b.ancestor_mask)
    assert a.paths() == b.paths()


def test_padding_parents_out_of_range_are_ignored():
    tokens = torch.tensor([[1, 2, 0, 0]])
    parents = torch.tensor([[-1, 0, 7, 99]])  # nodes 2 and 3 are padding
    tree = DraftTree(tokens, parents, None, torch.tensor([2]), SiblingMode.DETERMINISTIC).validate(
        3
    )
    assert tree.depth.tolist() == [[1, 2, 0, 0]]
    assert prune_to_depth(tree, torch.tensor([1])).num_nodes.tolist() == [1]


# --- chains ----------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 5])
def test_chain_is_the_sequential_case(k):
    tokens = torch.arange(2 * k).reshape(2, k)
    tree = chain_tree(tokens, SiblingMode.DETERMINISTIC).validate(vocab_size=2 * k)
    causal = torch.ones(k + 1, k + 1, dtype=torch.bool).tril()
    assert torch.equal(tree.ancestor_mask, causal.expand(2, k + 1, k + 1))
    assert tree.depth.tolist() == [list(range(1, k + 1))] * 2
    assert tree.paths() == [[list(range(k))]] * 2
    assert tree.positions(torch.tensor([10, 0])).tolist() == [
        list(range(10, 11 + k)),
        list(range(0, k + 1)),
    ]


def test_ragged_chain_pads_with_root_only_rows():
    tree = chain_tree(
        torch.zeros(2, 4, dtype=torch.int64),
        SiblingMode.DETERMINISTIC,
        num_nodes=torch.tensor([4, 2]),
    )
    mask = tree.ancestor_mask[1]
    assert torch.equal(mask[:3, :3], torch.ones(3, 3, dtype=torch.bool).tril())
    for row in (3, 4):
        assert mask[row].nonzero().flatten().tolist() == [0, row]
    assert tree.depth[1].tolist() == [1, 2, 0, 0]
    assert tree.paths()[1] == [[0, 1]]


def test_empty_tree_has_no_nodes():
    tree = empty_tree(3).validate(vocab_size=5)
    assert tree.max_nodes == 0 and tree.num_nodes.tolist() == [0, 0, 0]
    assert tree.ancestor_mask.tolist() == [[[True]]] * 3
    assert tree.paths() == [[], [], []]


def test_zero_node_request_in_a_batch():
    tree = chain_tree(
        torch.ones(2, 3, dtype=torch.int64),
        SiblingMode.DETERMINISTIC,
        num_nodes=torch.tensor([3, 0]),
    )
    assert tree.paths() == [[[0, 1, 2]], []]
    assert tree.depth[1].tolist() == [0, 0, 0]
    assert torch.equal(
        tree.ancestor_mask[1], torch.eye(4, dtype=torch.bool) | (torch.arange(4) == 0)
    )


# --- static topologies (Medusa "choices") -----------------------------------------------------


def test_parents_from_medusa_choices():
    assert parents_from_paths(MEDUSA_CHOICES) == [-1, -1, 0, 0, 1]
    assert sorted_paths(MEDUSA_CHOICES) == [(0,), (1,), (0, 0), (0, 1), (1, 0)]


def test_choices_order_and_duplicates_do_not_matter():
    shuffled = [[1, 0], (0, 1), [0], [1], [0, 0], [0]]
    assert parents_from_paths(shuffled) == parents_from_paths(MEDUSA_CHOICES)
    assert sorted_paths(shuffled) == sorted_paths(MEDUSA_CHOICES)


@pytest.mark.parametrize("seed", range(4))
def test_random_choices_give_consistent_topology(seed):
    rng = random.Random(seed)
    paths = {(0,)}
    while len(paths) < 40:  # grow a prefix-closed set of rank paths
        base = rng.choice(sorted(paths))
        paths.add(base + (rng.randrange(4),) if rng.random() < 0.7 else (rng.randrange(4),))
    listed = [list(p) for p in paths]
    rng.shuffle(listed)
    parents = parents_from_paths(listed)
    order = sorted_paths(listed)
    assert len(parents) == len(order) == len(paths)
    for i, (p, path) in enumerate(zip(parents, order, strict=True)):
        assert p < i
        assert (order[p] if p >= 0 else ()) == path[:-1]
    for i in range(len(order)):  # siblings in rank order
        for j in range(i):
            if parents[i] == parents[j]:
                assert order[j][-1] < order[i][-1]
    tree = tree_from_parents(
        torch.zeros(1, len(order), dtype=torch.int64), parents, SiblingMode.DETERMINISTIC
    )
    assert tree.depth[0].tolist() == [len(p) for p in order]


@pytest.mark.parametrize(
    "paths, message",
    [
        ([[0, 0]], r"no parent path \[0\]"),
        ([[0], [1, 2]], r"no parent path \[1\]"),
        ([[0], [0, 0, 0]], r"no parent path \[0, 0\]"),
        ([], "non-empty"),
        ([[0], []], "non-empty"),
        ([[-1]], "negative sibling rank"),
        ([[0], [0, -2]], "negative sibling rank"),
    ],
)
def test_parents_from_paths_errors(paths, message):
    with pytest.raises(TreeError, match=message):
        parents_from_paths(paths)


def test_tree_from_shared_topology():
    parents = parents_from_paths(MEDUSA_CHOICES)
    tokens = torch.arange(15).reshape(3, 5) % 4
    tree = tree_from_parents(tokens, parents, SiblingMode.DETERMINISTIC).validate(vocab_size=4)
    assert tree.parents.shape == (3, 5) and tree.parents.dtype == torch.int64
    assert tree.parents.tolist() == [parents] * 3
    assert tree.num_nodes.tolist() == [5, 5, 5]
    assert tree.paths() == [[[0, 2], [0, 3], [1, 4]]] * 3
    assert tree.depth.tolist() == [[1, 1, 2, 2, 2]] * 3
    tree.parents[0, 0] = 5  # each request owns its row (expand + contiguous, not a shared view)
    assert tree.parents[1, 0] == -1


def test_tree_from_per_request_parents_and_num_nodes():
    parents = torch.tensor([[-1, 0, 1], [-1, -1, 0]])
    tree = tree_from_parents(
        torch.zeros(2, 3, dtype=torch.int64),
        parents,
        SiblingMode.DETERMINISTIC,
        num_nodes=torch.tensor([3, 2]),
    )
    assert tree.paths() == [[[0, 1, 2]], [[0], [1]]]


def test_tree_from_shared_topology_length_mismatch():
    with pytest.raises(TreeError, match="parents"):
        tree_from_parents(
            torch.zeros(2, 4, dtype=torch.int64), [-1, 0, 1], SiblingMode.DETERMINISTIC
        )


# --- prune_to_depth --------------------------------------------------------------------------


def test_prune_hand_example_compacts_interleaved_nodes():
    parents = torch.tensor([[-1, 0, -1, 1, 2]])  # depths 1, 2, 1, 3, 2
    tokens = torch.tensor([[10, 11, 12, 13, 14]])
    probs = torch.arange(5, dtype=torch.float32)[None, :, None].expand(1, 5, 3).contiguous()
    tree = DraftTree(tokens, parents, probs, torch.tensor([5]), SiblingMode.SAMPLED_IID)
    pruned = prune_to_depth(tree, torch.tensor([2]))
    assert int(pruned.num_nodes[0]) == 4
    assert pruned.tokens[0, :4].tolist() == [10, 11, 12, 14]
    assert pruned.parents[0, :4].tolist() == [-1, 0, -1, 2]
    assert pruned.draft_probs[0, :4, 0].tolist() == [0, 1, 2, 4]
    assert pruned.mode is SiblingMode.SAMPLED_IID
    assert pruned.depth[0, :4].tolist() == [1, 2, 1, 2]


@pytest.mark.parametrize("seed", range(8))
def test_prune_matches_brute_force(seed):
    tree = random_tree(seed, batch=5, max_nodes=14)
    gen = torch.Generator().manual_seed(100 + seed)
    limits = torch.randint(0, 5, (5,), generator=gen)
    limits[1] = 0
    pruned = prune_to_depth(tree, limits).validate(vocab_size=7)
    for b in range(tree.batch_size):
        k = int(tree.num_nodes[b])
        depth = tree.depth[b].tolist()
        kept = [i for i in range(k) if depth[i] <= int(limits[b])]
        new = {old: j for j, old in enumerate(kept)}
        m = len(kept)
        assert int(pruned.num_nodes[b]) == m
        # ancestor-closed: every kept node's parent is kept (or the root)
        assert all(int(tree.parents[b, i]) in new or int(tree.parents[b, i]) == -1 for i in kept)
        assert pruned.tokens[b, :m].tolist() == [int(tree.tokens[b, i]) for i in kept]
        assert pruned.parents[b, :m].tolist() == [
            new.get(int(tree.parents[b, i]), -1) for i in kept
        ]
        assert torch.equal(pruned.draft_probs[b, :m], tree.draft_probs[b, kept])
        assert pruned.depth[b, :m].tolist() == [depth[i] for i in kept]
    assert int(pruned.num_nodes[1]) == 0


def test_prune_without_draft_probs_and_with_generous_limit_is_identity():
    tree = random_tree(3, mode=SiblingMode.DETERMINISTIC)
    pruned = prune_to_depth(tree, torch.full((tree.batch_size,), tree.max_nodes))
    assert pruned.draft_probs is None
    assert torch.equal(pruned.num_nodes, tree.num_nodes)
    valid = tree.node_valid()
    assert torch.equal(pruned.tokens[valid], tree.tokens[valid])
    assert torch.equal(pruned.parents[valid], tree.parents[valid])
    assert pruned.paths() == tree.paths()


def test_prune_to_zero_everywhere_is_a_plain_step():
    tree = random_tree(5)
    pruned = prune_to_depth(tree, torch.zeros(tree.batch_size, dtype=torch.int64))
    assert pruned.num_nodes.tolist() == [0] * tree.batch_size
    assert pruned.paths() == [[]] * tree.batch_size


# --- sibling rank ----------------------------------------------------------------------------


def test_sibling_rank_on_a_bushy_tree():
    parents = torch.tensor(
        [
            [-1, -1, -1, 0, 0, 1, 0, 2, 2, 3],
            [-1, 0, -1, 0, -1, 1, -1, 0, 0, 0],  # 7 valid nodes; the rest is padding
        ]
    )
    tree = tree_from_parents(
        torch.zeros(2, 10, dtype=torch.int64),
        parents,
        SiblingMode.DETERMINISTIC,
        num_nodes=torch.tensor([10, 7]),
    )
    ranks = sibling_rank(tree)
    assert ranks[0].tolist() == [0, 1, 2, 0, 1, 0, 2, 0, 1, 0]
    assert ranks[1, :7].tolist() == [0, 0, 1, 1, 2, 0, 3]


@pytest.mark.parametrize("seed", range(3))
def test_sibling_rank_matches_brute_force(seed):
    tree = random_tree(seed, max_nodes=16)
    ranks = sibling_rank(tree)
    for b in range(tree.batch_size):
        parents = tree.parents[b].tolist()
        for i in range(int(tree.num_nodes[b])):
            assert int(ranks[b, i]) == sum(parents[j] == parents[i] for j in range(i))
