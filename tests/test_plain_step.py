"""Plain decoding's verify step (an empty tree at T = 0) takes the root's argmax directly: the same
token the general walk draws from the root's one-hot p (verifiers/reference.py)."""

from __future__ import annotations

import pytest
import torch

from specdec.sampling import SamplingParams, target_probabilities
from specdec.tree import empty_tree
from verifiers.reference import final_token, verify


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_empty_tree_at_temperature_zero_gives_the_walks_token(dtype):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1, 1000, generator=generator).to(dtype)
    logits[1, 0, [7, 400]] = 50.0  # a tie: the first index wins, as the one-hot's argmax
    logits[2, 0] = 0.0  # every token tied
    greedy = SamplingParams(0.0)
    noise = None  # greedy reads no noise
    result = verify(empty_tree(6), logits, greedy, noise)
    walk = final_token(target_probabilities(logits[:, 0], greedy), greedy, noise)
    assert torch.equal(result.next_token, walk)
    assert result.next_token[1] == 7 and result.next_token[2] == 0
    assert result.accepted_nodes.shape == (6, 0) and torch.equal(result.num_accepted, torch.zeros(6, dtype=torch.int64))
