"""Draft-tree validation (specdec/tree.py validate_tree): every malformed field is a TreeError
naming it; padding is never validated."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specdec.tree import DraftTree, SiblingMode, TreeError

V = 5


def valid_tree(mode: SiblingMode = SiblingMode.SAMPLED_IID) -> DraftTree:
    tokens = torch.tensor([[1, 2, 3, 4], [0, 1, 0, 0]])
    parents = torch.tensor([[-1, 0, 0, 2], [-1, -1, 0, 0]])
    probs = torch.full((2, 4, V), 1.0 / V)
    return DraftTree(
        tokens,
        parents,
        None if mode is SiblingMode.DETERMINISTIC else probs,
        torch.tensor([4, 3]),
        mode,
    )


def with_(tree: DraftTree, **changes) -> DraftTree:
    return dataclasses.replace(tree, **changes)


def set_at(t: torch.Tensor, index, value) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


@pytest.mark.parametrize("mode", list(SiblingMode))
def test_valid_tree_passes_and_validate_returns_self(mode):
    tree = valid_tree(mode)
    assert tree.validate(vocab_size=V) is tree
    assert tree.validate() is tree


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda t: with_(t, parents=set_at(t.parents, (0, 2), 2)),
            r"request 0: node 2 has parent 2",
        ),
        (
            lambda t: with_(t, parents=set_at(t.parents, (1, 1), 3)),
            r"request 1: node 1 has parent 3",
        ),
        (
            lambda t: with_(t, parents=set_at(t.parents, (0, 0), 0)),
            r"node 0 has parent 0.*earlier node",
        ),
        (
            lambda t: with_(t, parents=set_at(t.parents, (1, 2), -2)),
            r"request 1: node 2 has parent -2.*-1 \(root\)",
        ),
        (
            lambda t: with_(t, num_nodes=torch.tensor([5, 3])),
            r"num_nodes must lie in \[0, N=4\]; got \[5, 3\]",
        ),
        (lambda t: with_(t, num_nodes=torch.tensor([4, -1])), r"num_nodes must lie in \[0, N=4\]"),
        (lambda t: with_(t, num_nodes=torch.tensor([4])), r"num_nodes must be \[B=2\]"),
        (
            lambda t: with_(t, tokens=set_at(t.tokens, (0, 3), V)),
            rf"request 0: node 3 has token {V} outside the vocabulary \[0, {V}\)",
        ),
        (
            lambda t: with_(t, tokens=set_at(t.tokens, (1, 0), -1)),
            r"request 1: node 0 has token -1 outside",
        ),
        (lambda t: with_(t, draft_probs=None), r"SAMPLED_IID needs draft_probs"),
        (
            lambda t: with_(t, mode=SiblingMode.SAMPLED_WOR, draft_probs=None),
            r"SAMPLED_WOR needs draft_probs.*DETERMINISTIC",
        ),
        (
            lambda t: with_(t, draft_probs=t.draft_probs[:, :3]),
            r"draft_probs must be \[B=2, N=4, V\]; got \(2, 3, 5\)",
        ),
        (
            lambda t: with_(t, draft_probs=t.draft_probs[:, :, 0]),
            r"draft_probs must be \[B=2, N=4, V\]",
        ),
        (
            lambda t: with_(t, draft_probs=torch.ones(2, 4, V + 1)),
            rf"draft_probs has vocabulary {V + 1} but the target has {V}",
        ),
        (
            lambda t: with_(t, parents=torch.full((2, 5), -1)),
            r"tokens and parents must both be \[B, N\]; got \(2, 4\) and \(2, 5\)",
        ),
        (lambda t: with_(t, parents=t.parents[:1]), r"tokens and parents must both be \[B, N\]"),
        (lambda t: with_(t, tokens=t.tokens.int()), r"int64"),
        (lambda t: with_(t, parents=t.parents.float()), r"int64"),
    ],
    ids=[
        "parent-equals-own",
        "parent-after-own",
        "first-node-parent-self",
        "parent-below-minus-one",
        "num-nodes-above-N",
        "num-nodes-negative",
        "num-nodes-shape",
        "token-equals-vocab",
        "token-negative",
        "iid-without-probs",
        "wor-without-probs",
        "probs-wrong-N",
        "probs-2d",
        "probs-vocab-mismatch",
        "parents-wider",
        "parents-fewer-rows",
        "tokens-int32",
        "parents-float",
    ],
)
def test_validation_errors(change, message):
    tree = change(valid_tree())
    with pytest.raises(TreeError, match=message):
        tree.validate(vocab_size=V)


def test_padding_is_not_validated():
    """Values beyond num_nodes are ignored: bad tokens/parents there are not errors."""
    tree = valid_tree()  # request 1 has 3 valid nodes; node 3 is padding
    tree = with_(
        tree, tokens=set_at(tree.tokens, (1, 3), 10 * V), parents=set_at(tree.parents, (1, 3), 3)
    )
    assert tree.validate(vocab_size=V) is tree


def test_token_range_needs_a_vocabulary():
    tree = with_(valid_tree(), tokens=set_at(valid_tree().tokens, (0, 0), 10 * V))
    tree.validate()  # no vocabulary given: nothing to check against
    with pytest.raises(TreeError, match="outside the vocabulary"):
        tree.validate(vocab_size=V)


def test_deterministic_tree_needs_no_draft_probs():
    valid_tree(SiblingMode.DETERMINISTIC).validate(vocab_size=V)


@pytest.mark.parametrize("shape", [(4,), (1, 4, 1)])
def test_tokens_of_wrong_rank_raise_tree_error(shape):
    tree = DraftTree(
        torch.zeros(shape, dtype=torch.int64),
        torch.full(shape, -1),
        None,
        torch.tensor([1]),
        SiblingMode.DETERMINISTIC,
    )
    with pytest.raises(TreeError, match=r"\[B, N\]"):
        tree.validate()


@pytest.mark.parametrize("field", ["num_nodes", "draft_probs"])
def test_other_dtypes_are_validated(field):
    tree = valid_tree()
    bad = {"num_nodes": torch.tensor([2.5, 3.0]), "draft_probs": tree.draft_probs.half()}[field]
    with pytest.raises(TreeError, match=field):
        with_(tree, **{field: bad}).validate(vocab_size=V)
