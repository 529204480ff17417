"""Acceptance statistics pooled over runs (AcceptanceStats.merged) equal those of one run over the
same requests: counts add, alpha is recomputed from them, means weigh by request-steps."""

from __future__ import annotations

import pytest

from drafters.synthetic import SyntheticDrafter
from specdec.decode import SpecDecoder
from specdec.metrics import AcceptanceStats, TimeSplit
from specdec.sampling import SamplingParams
from specdec.synthetic import SyntheticTarget
from specdec.tree import SiblingMode
from verifiers.reference import verify

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [2, 2]]
COUNTED = ("num_requests", "num_steps", "request_steps", "generated_tokens", "per_depth_attempts",
           "per_depth_accepted", "accepted_histogram", "accepted_rank_histogram")
MEANS = ("tau", "per_depth_alpha", "survival", "mean_tree_nodes")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_merged_runs_of_single_prompts_equal_one_run_over_all_of_them(temperature):
    target = SyntheticTarget(vocab_size=16, sharpness=2.0, seed=3)
    decoder = SpecDecoder(target, SyntheticDrafter(target, (2, 1, 1), SiblingMode.SAMPLED_IID, 0.4), verify)
    sampling = SamplingParams(temperature=temperature)
    seeds = [11, 12, 13, 14]
    whole = decoder.generate(PROMPTS, 12, sampling, seeds=seeds, max_batch=1).stats  # one request at a time
    parts = [decoder.generate([p], 12, sampling, seeds=[s]).stats for p, s in zip(PROMPTS, seeds)]
    merged = AcceptanceStats.merged(parts)
    for name in COUNTED:
        assert getattr(merged, name) == getattr(whole, name), name
    for name in MEANS:
        assert getattr(merged, name) == pytest.approx(getattr(whole, name), rel=1e-6), name  # the loop divides in float32
    assert whole.per_depth_alpha == pytest.approx([a / n for a, n in zip(whole.per_depth_accepted, whole.per_depth_attempts)])
    # an average of the parts' rates is not the pooled rate when the parts reach a depth unequally
    assert len({tuple(p.per_depth_attempts) for p in parts}) > 1


def test_merged_time_adds_the_parts_unless_given():
    one = AcceptanceStats(1, 2, 2, 3, 1.5, [0.5], [2], [1], [1.0, 0.5], [1, 1], [1], 2.0, 1.0,
                          TimeSplit(draft_s=1.0, total_s=2.0))
    assert AcceptanceStats.merged([one, one]).time == TimeSplit(draft_s=2.0, total_s=4.0)
    assert AcceptanceStats.merged([one, one], TimeSplit(total_s=1.0)).tokens_per_s == 6.0
    assert AcceptanceStats.merged([one, one]).per_depth_alpha == [0.5]
