"""EAGLE-2 dynamic trees stop expanding once no deeper node could enter the kept tree."""

from __future__ import annotations

import pytest
import torch

from drafters.eagle import EagleConfig, EagleDrafter, EagleHead
from specdec.decode import SpecDecoder
from specdec.sampling import SamplingParams
from specdec.target import HFTarget
from tiny_models import tiny_model
from verifiers import reference

PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [3], [9, 10, 11, 9, 10]]


def run(drafter: EagleDrafter, prune: bool, monkeypatch) -> tuple[list, list, int]:
    """Outputs, every proposed tree, and how many head passes past depth 1 were run."""
    trees, passes = [], []
    propose, draft_rows, budget_full = drafter.propose, drafter._draft_rows, drafter._budget_full
    monkeypatch.setattr(drafter, "propose", lambda ctx: trees.append(propose(ctx)) or trees[-1])
    monkeypatch.setattr(drafter, "_draft_rows", lambda *a: passes.append(1) or draft_rows(*a))
    monkeypatch.setattr(drafter, "_budget_full", budget_full if prune else lambda *a: False)
    out = SpecDecoder(drafter.target, drafter, reference.verify).generate(PROMPTS, 12, SamplingParams(0.0))
    monkeypatch.undo()
    return out.outputs, trees, len(passes)


@pytest.mark.parametrize("sharpness", [1.0, 30.0])  # 30: peaked q, so deep chains outscore shallow siblings
@pytest.mark.parametrize("depth,top_k,total_tokens", [(4, 2, 1), (4, 3, 3), (3, 2, 5), (5, 4, 8)])
def test_pruned_expansion_proposes_the_same_trees_with_fewer_passes(depth, top_k, total_tokens, sharpness, monkeypatch):
    target = HFTarget(tiny_model("llama", sharpness=4.0))
    torch.manual_seed(3)
    head = EagleHead(EagleConfig.for_target(target)).eval()
    drafter = EagleDrafter(target, head, depth, top_k, total_tokens)
    drafter.target = target
    with torch.no_grad():
        drafter.draft_lm_head[0].weight.mul_(sharpness)  # the head's own copy of the target's rows
    full_out, full_trees, full_passes = run(drafter, False, monkeypatch)
    out, trees, passes = run(drafter, True, monkeypatch)
    assert out == full_out and len(trees) == len(full_trees)
    for tree, full in zip(trees, full_trees):
        assert torch.equal(tree.num_nodes, full.num_nodes)
        for b, n in enumerate(tree.num_nodes.tolist()):
            assert torch.equal(tree.tokens[b, :n], full.tokens[b, :n])
            assert torch.equal(tree.parents[b, :n], full.parents[b, :n])
    assert passes <= full_passes
    if sharpness > 1 and total_tokens > top_k:  # the kept trees reach past depth 2
        assert max(int(t.depth.max()) for t in trees) > 2
    if total_tokens == 1:  # the best depth-1 node outranks all its descendants: one pass per step
        assert passes == 0


@pytest.mark.parametrize("sampling", ["sampled_iid", "sampled_wor"])
def test_static_shapes_do_not_depend_on_the_drawn_tokens(sampling):
    """shape=static: the same topology for every request and every draw (the first-drawn child of
    each frontier node expanded, groups kept in pool order), flagged for traversal verification."""
    target = HFTarget(tiny_model("llama", sharpness=4.0))
    torch.manual_seed(3)
    head = EagleHead(EagleConfig.for_target(target)).eval()
    shapes, dynamic = set(), set()
    for shape, seen in (("static", shapes), ("dynamic", dynamic)):
        drafter = EagleDrafter(target, head, depth=3, top_k=2, total_tokens=4, sampling=sampling, shape=shape)
        trees = []
        propose = drafter.propose
        drafter.propose = lambda ctx: trees.append(propose(ctx)) or trees[-1]
        SpecDecoder(target, drafter, reference.verify).generate(PROMPTS * 4, 6, SamplingParams(1.0), seed=1)
        for tree in trees:
            assert tree.static_shape == (shape == "static")
            seen.update(tuple(p[: int(n)]) for p, n in zip(tree.parents.tolist(), tree.num_nodes.tolist()) if n == 4)
    # depth 1: nodes 0 and 1; then one more group of 2: under node 0, the first draw
    assert shapes == {(-1, -1, 0, 0)}
    assert dynamic == {(-1, -1, 0, 0), (-1, -1, 1, 1)}  # scores decide which group a dynamic tree keeps


@pytest.mark.parametrize("depth,total_tokens", [(1, 8), (2, 8), (3, 5)])
def test_a_sampled_tree_is_as_wide_as_the_groups_it_keeps(depth, total_tokens):
    """Every request keeps min(total_tokens // top_k, groups in the pool) groups of top_k, so the
    width is known on the host: the tree holds them all and nothing more."""
    target = HFTarget(tiny_model("llama", sharpness=4.0))
    torch.manual_seed(3)
    head = EagleHead(EagleConfig.for_target(target)).eval()
    drafter = EagleDrafter(target, head, depth=depth, top_k=2, total_tokens=total_tokens, sampling="sampled_iid")
    trees = []
    propose = drafter.propose
    drafter.propose = lambda ctx: trees.append(propose(ctx)) or trees[-1]
    SpecDecoder(target, drafter, reference.verify).generate(PROMPTS, 4, SamplingParams(1.0), seed=1)
    full = [tree for tree in trees if tree.tokens.shape[1] > 0]
    assert full and all(tree.num_nodes.tolist() == [tree.tokens.shape[1]] * len(tree.num_nodes) for tree in full)
    pool_groups = 1 + (depth - 1) * 2  # the root's group, then top_k groups per further depth
    assert {tree.tokens.shape[1] for tree in full} == {min(total_tokens // 2, pool_groups) * 2}


def test_static_shapes_are_for_sampled_trees():
    target = HFTarget(tiny_model("llama"))
    head = EagleHead(EagleConfig.for_target(target)).eval()
    with pytest.raises(ValueError, match="shape=static is for sampled trees"):
        EagleDrafter(target, head, 3, 2, 6, sampling="deterministic", shape="static")
    with pytest.raises(ValueError, match="shape='round'"):
        EagleDrafter(target, head, 3, 2, 6, sampling="sampled_iid", shape="round")
