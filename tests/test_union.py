"""The union drafter: members' drafts merged into one trie, exact at T > 0 through the whole loop,
greedy-equal with a trained-head member under continuous batching, and clear refusals."""

from __future__ import annotations

import pytest
import torch

from drafters.base import build
from drafters.eagle import EagleConfig, EagleHead, save_head
from drafters.union import UnionDrafter
from sequence_stats import ALPHA
from specdec.decode import SpecDecoder
from specdec.noise import RequestRNG
from specdec.protocols import DraftContext
from specdec.sampling import SamplingParams
from specdec.target import HFTarget
from specdec.tree import SiblingMode, token_paths, token_trie
from test_exactness import run
from tiny_models import tiny_model
from verifiers import reference

TOP2 = {"name": "synthetic", "branching": (2, 1), "mode": "deterministic"}
CHAIN3 = {"name": "synthetic", "branching": (1, 1, 1), "mode": "deterministic", "divergence": 0.8, "seed": 2}


def test_token_trie_shares_prefixes_and_keeps_first_reach_order():
    tree = token_trie([[[4, 5, 6], [4, 7], [8]], [], [[4, 5, 6], [4, 5, 6]]])
    assert tree.num_nodes.tolist() == [5, 0, 3] and tree.mode is SiblingMode.DETERMINISTIC
    assert tree.tokens[0].tolist() == [4, 5, 6, 7, 8] and tree.parents[0].tolist() == [-1, 0, 1, 0, -1]
    assert token_paths(tree) == [[[4, 5, 6], [4, 7], [8]], [], [[4, 5, 6]]]
    tree.validate(vocab_size=16)


def test_the_union_holds_every_members_drafts_once():
    from specdec.synthetic import SyntheticTarget

    target = SyntheticTarget(vocab_size=6, sharpness=1.5, seed=0)
    union = UnionDrafter(target, [TOP2, CHAIN3])
    members = [build(m["name"], target, **{k: v for k, v in m.items() if k != "name"}) for m in (TOP2, CHAIN3)]
    ctx = DraftContext(torch.tensor([[1, 2, 3], [2, 2, 0]]), torch.tensor([3, 2]), (), torch.zeros(2, dtype=torch.int64),
                       SamplingParams(1.0), RequestRNG(torch.tensor([0, 1])))
    union.reset(2, 16)
    tree = union.propose(ctx)
    merged = token_paths(tree)
    for b in range(2):
        own = [path for member in members for path in token_paths(member.propose(ctx))[b]]
        prefixes = lambda paths: {tuple(p[:d]) for p in paths for d in range(1, len(p) + 1)}
        assert prefixes(merged[b]) == prefixes(own)  # every drafted continuation, nothing else
        assert len(prefixes(merged[b])) == int(tree.num_nodes[b])  # each node once


@pytest.mark.parametrize("temperature", [0.7])
def test_union_of_deterministic_drafts_is_exact(temperature):
    """Two synthetic drafters with different drafts, merged: the sequence-level chi-square test of
    tests/test_exactness.py through the whole decode loop."""
    verdict = run(lambda target: UnionDrafter(target, [TOP2, CHAIN3]), SamplingParams(temperature), length=3)
    print(verdict)
    assert verdict.impossible == 0 and verdict.p_value > ALPHA, verdict


def test_greedy_union_with_a_head_and_ngram_equals_plain_decoding(tmp_path):
    target = HFTarget(tiny_model("llama", sharpness=4.0))
    torch.manual_seed(0)
    save_head(EagleHead(EagleConfig.for_target(target, feature_layers=(1, 2))).eval(), tmp_path / "head")
    members = [
        {"name": "eagle3", "checkpoint": str(tmp_path / "head"), "depth": 2, "top_k": 2, "total_tokens": 3},
        {"name": "ngram", "num_draft": 3, "max_branches": 2},
    ]
    union = build("union", target, members=members)
    assert union.target_layers == (1, 2)
    prompts = [[5, 6, 7, 8, 5, 6, 7], [3], [9, 10, 11, 9, 10], [4, 4, 4]]
    greedy = SamplingParams(0.0)
    plain = SpecDecoder(target, None, reference.verify).generate(prompts, 20, greedy)
    out = SpecDecoder(target, union, reference.verify).generate(prompts, 20, greedy, max_batch=2)
    assert out.outputs == plain.outputs
    assert out.stats.tau > 1.0  # the repetitive prompts give the n-gram member accepted drafts


def test_union_refusals():
    from specdec.synthetic import SyntheticTarget

    target = SyntheticTarget(vocab_size=6, sharpness=1.5, seed=0)
    with pytest.raises(ValueError, match="at least two members"):
        UnionDrafter(target, [TOP2])
    with pytest.raises(ValueError, match="name of another drafter"):
        UnionDrafter(target, [TOP2, {"name": "union", "members": []}])
    sampled = {**CHAIN3, "mode": "sampled_iid"}
    with pytest.raises(ValueError, match="deterministic drafts only"):
        SpecDecoder(target, UnionDrafter(target, [TOP2, sampled]), reference.verify).generate([[1, 2]], 3, SamplingParams(1.0))
    hf = HFTarget(tiny_model("llama"))
    with pytest.raises(ValueError, match="own tree accepted"):
        build("union", hf, members=[{"name": "ngram"}, {"name": "draft_model", "model": tiny_model("llama", seed=1)}])
