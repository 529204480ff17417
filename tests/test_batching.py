"""Continuous batching: requests leave the batch when they finish and queued prompts take their rows.

Exactness at batch > 1: greedy output equals plain decoding for every drafter kind, and a sampled
request's output is byte-identical whether it runs alone or among ragged neighbours admitted at
other times (its noise is its own), so the sequence-level chi-square tests, run on one batch,
carry over to any batching.
"""

from __future__ import annotations

import pytest
import torch

from drafters.draft_model import DraftModelDrafter
from drafters.eagle import EagleConfig, EagleDrafter, EagleHead
from drafters.heads import DecoderBlock, catch_up_runs
from drafters.mtp import MTPConfig, MTPDrafter, MTPHead
from drafters.ngram import NgramDrafter
from drafters.synthetic import SyntheticDrafter
from specdec.decode import SpecDecoder
from specdec.protocols import VerifyResult
from specdec.sampling import SamplingParams
from specdec.synthetic import SyntheticTarget
from specdec.target import HFTarget
from specdec.tree import SiblingMode, tree_from_parents
from tiny_models import full_logits, tiny_model
from verifiers import reference

GREEDY, SAMPLED = SamplingParams(0.0), SamplingParams(1.0)
# five ragged prompts, some with repeats so prompt lookup finds drafts
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [3], [9, 10, 11, 9, 10], [20, 21], [30, 31, 32, 33, 30, 31, 32, 33, 30]]
SEEDS = [101, 102, 103, 104, 105]


@pytest.fixture(scope="module")
def target() -> HFTarget:
    return HFTarget(tiny_model("llama", sharpness=4.0))


def random_eagle(target: HFTarget, depth: int, top_k: int, total_tokens: int) -> EagleDrafter:
    torch.manual_seed(7)
    head = EagleHead(EagleConfig.for_target(target)).eval()
    return EagleDrafter(target, head, depth, top_k, total_tokens)


def random_mtp(target: HFTarget, modules: int, depth: int) -> MTPDrafter:
    torch.manual_seed(7)
    return MTPDrafter(target, MTPHead(MTPConfig.for_target(target, num_modules=modules, depth=depth)).eval(), depth)


DRAFTERS = {
    "ngram-trie": lambda t: NgramDrafter(t, num_draft=4, max_branches=3),
    "draft-model": lambda t: DraftModelDrafter(t, model=tiny_model("llama", seed=1, layers=1, sharpness=4.0), num_draft=3),
    "eagle2-tree": lambda t: random_eagle(t, depth=3, top_k=2, total_tokens=5),
    "mtp-chain": lambda t: random_mtp(t, modules=2, depth=2),
}


def test_admitted_requests_see_exactly_their_own_prefix(target):
    """Prefill two prompts, commit a ragged step, admit a third: every tree row's logits equal a
    plain forward over that request's text alone."""
    model = target.model
    sequences = [[5, 6, 7, 8, 9], [3]]
    target.prefill([torch.tensor(s) for s in sequences], ())
    tokens = torch.tensor([[40, 41], [42, 43]])
    tree = tree_from_parents(tokens, [-1, 0], SiblingMode.DETERMINISTIC)
    target.forward_tree(tree, ())
    target.commit(tree, VerifyResult(torch.tensor([[0, 1], [-1, -1]]), torch.tensor([2, 0]), torch.tensor([44, 45])))
    sequences = [sequences[0] + [40, 41, 44], sequences[1] + [45]]
    sequences.append([50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60])  # longer than the running cache
    target.admit([torch.tensor(sequences[2])], ())
    target.retain(torch.tensor([2, 0]))  # the middle request finishes
    sequences = [sequences[2], sequences[0]]
    out = target.forward_tree(tree_from_parents(tokens, [-1, 0], SiblingMode.DETERMINISTIC), ())
    for b, seq in enumerate(sequences):
        expected = full_logits(model, seq + tokens[b].tolist())[-3:]
        assert torch.allclose(out.logits[b], expected, atol=1e-5)


@pytest.fixture(scope="module")
def plain_with_eos(target) -> tuple[int, list[list[int]]]:
    plain = SpecDecoder(target, None, reference.verify)
    eos = plain.generate(PROMPTS, 12, GREEDY).outputs[0][5]  # stops request 0 early, maybe others
    expected = plain.generate(PROMPTS, 12, GREEDY, eos_token_id=eos).outputs
    assert len(expected[0]) < 12 and len({len(o) for o in expected}) > 1  # ragged finishing times
    return eos, expected


# max_batch 1 empties the batch before every admission
@pytest.mark.parametrize("name,max_batch", [(name, 2) for name in DRAFTERS] + [("draft-model", 1), ("eagle2-tree", 1)])
def test_greedy_with_continuous_batching_equals_plain_decoding(target, plain_with_eos, name, max_batch):
    eos, expected = plain_with_eos
    out = SpecDecoder(target, DRAFTERS[name](target), reference.verify).generate(
        PROMPTS, 12, GREEDY, eos_token_id=eos, max_batch=max_batch
    )
    assert out.outputs == expected
    assert max(s["active_requests"] for s in out.steps) == max_batch
    assert sorted({r for s in out.steps for r in s["requests"]}) == list(range(len(PROMPTS)))


@pytest.mark.parametrize("name", DRAFTERS)
def test_sampled_output_of_a_request_does_not_depend_on_batching(target, name):
    decoder = SpecDecoder(target, DRAFTERS[name](target), reference.verify)
    prompts, seeds = PROMPTS[1:], SEEDS[1:]
    alone = [decoder.generate([p], 10, SAMPLED, seeds=[s]).outputs[0] for p, s in zip(prompts, seeds)]
    order = [3, 1, 0, 2]  # other neighbours, other admission times
    batched = decoder.generate([prompts[i] for i in order], 10, SAMPLED, seeds=[seeds[i] for i in order], max_batch=2)
    assert batched.outputs == [alone[i] for i in order]
    assert len({tuple(o) for o in alone}) == len(alone)


def test_catch_up_runs_keep_prompts_apart_from_accepted_rows():
    assert catch_up_runs([2, 1, 3, 120]) == [slice(0, 3), slice(3, 4)]  # an admission at batch 4
    assert catch_up_runs([2, 1, 3, 5]) == [slice(0, 4)]  # a step's accepted rows: one call
    assert catch_up_runs([40, 90, 3, 0, 33]) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    assert catch_up_runs([]) == [] and catch_up_runs([7]) == [slice(0, 1)]


@pytest.mark.parametrize("name", ["eagle2-tree", "mtp-chain"])
def test_an_admitted_prompt_is_caught_up_in_a_call_of_its_own(target, name, monkeypatch):
    """A request admitted into a running batch brings its whole prompt while its neighbours bring
    a few accepted rows: the head computes the prompt once, not padded across the batch, and
    drafts exactly what one call over the padded batch drafts."""
    prompts = [list(range(10, 60)), [3, 4, 5], [6, 7], [8, 9, 10, 11], [12, 13], list(range(60, 100))]
    block = DecoderBlock.block

    def run(one_call: bool) -> tuple[list, list]:
        if one_call:
            monkeypatch.setattr(name == "mtp-chain" and "drafters.mtp.catch_up_runs" or "drafters.eagle.catch_up_runs",
                                lambda counts: [slice(0, len(counts))])
        shapes, trees = [], []
        monkeypatch.setattr(DecoderBlock, "block", lambda self, x, *a, **k: shapes.append(tuple(x.shape[:2])) or block(self, x, *a, **k))
        drafter = DRAFTERS[name](target)
        propose = drafter.propose
        drafter.propose = lambda ctx: trees.append(propose(ctx)) or trees[-1]
        out = SpecDecoder(target, drafter, reference.verify).generate(prompts, 8, GREEDY, max_batch=3)
        monkeypatch.undo()
        return out.outputs, [t.tokens.tolist() for t in trees], shapes

    outputs, trees, shapes = run(one_call=False)
    one_call_outputs, one_call_trees, one_call_shapes = run(one_call=True)
    assert outputs == one_call_outputs and trees == one_call_trees
    admitted = {rows for rows in one_call_shapes if rows[0] > 1 and rows[1] >= 39}  # the batch padded to a prompt
    assert admitted and not admitted & set(shapes)
    assert sum(b * r for b, r in shapes) < sum(b * r for b, r in one_call_shapes)


@pytest.mark.parametrize("mode", ["sampled_iid", "sampled_wor", "deterministic"])
def test_synthetic_target_continuous_batching_is_independent_of_neighbours(mode):
    target = SyntheticTarget(vocab_size=12, sharpness=1.0)
    decoder = SpecDecoder(target, SyntheticDrafter(target, (2, 2), mode, 0.5), reference.verify)
    prompts, seeds = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10], [11]], [11, 12, 13, 14, 15]
    eos = 3  # requests finish at different times
    run = lambda max_batch: decoder.generate(prompts, 12, SAMPLED, seeds=seeds, eos_token_id=eos, max_batch=max_batch)
    alone = [decoder.generate([p], 12, SAMPLED, seeds=[s], eos_token_id=eos).outputs[0] for p, s in zip(prompts, seeds)]
    for max_batch in (1, 2, None):
        assert run(max_batch).outputs == alone, max_batch
    assert len({len(o) for o in alone}) > 1


def test_stats_count_every_request_once_under_continuous_batching():
    target = SyntheticTarget(vocab_size=8, sharpness=1.0)
    decoder = SpecDecoder(target, SyntheticDrafter(target, (1, 1), "sampled_iid", 0.3), reference.verify)
    out = decoder.generate([[1, 2]] * 7, 12, SAMPLED, max_batch=3)
    assert out.stats.num_requests == 7 and out.stats.generated_tokens == 7 * 12
    assert all(s["active_requests"] <= 3 for s in out.steps)
    assert out.stats.request_steps == sum(s["active_requests"] for s in out.steps)
    assert out.stats.time.prefill_s > 0 and 0 <= out.stats.time.overhead_share < 1


@pytest.mark.parametrize("max_batch", [0, -1, 1.5])
def test_bad_max_batch_gets_a_clear_error(max_batch):
    target = SyntheticTarget(vocab_size=8)
    with pytest.raises(ValueError, match="max_batch must be an integer >= 1"):
        SpecDecoder(target, None, reference.verify).generate([[1]], 4, GREEDY, max_batch=max_batch)


def test_specdec_run_batches_continuously_within_groups(tmp_path):
    from test_run_cli import read_jsonl, run_in_process

    overrides = ["experiment=synthetic", "workload.num_prompts=5", "max_new_tokens=10", "logger=none"]
    run_in_process(tmp_path / "single", overrides)
    results = run_in_process(tmp_path / "batched", [*overrides, "batch_size=2", "group_size=4"])
    steps = read_jsonl(tmp_path / "batched" / "steps.jsonl")
    assert {s["batch"] for s in steps} == {0, 1} and max(s["active_requests"] for s in steps) == 2
    # group 0 holds 4 prompts, 2 in flight: the third enters when the first leaves
    assert sorted({r for s in steps if s["batch"] == 0 for r in s["requests"]}) == [0, 1, 2, 3]
    outputs = lambda name: [p["output"] for p in read_jsonl(tmp_path / name / "prompts.jsonl")]
    assert outputs("batched") == outputs("single") and results["greedy_equal"] is True
    assert results["group_size"] == 4 and results["time_split"]["prefill_s"] > 0
    assert 0 <= results["overhead_share"] < 1 and results["budget"] == {"mode": "fixed"}


def test_specdec_run_refuses_a_group_smaller_than_the_batch(tmp_path):
    from experiments.cli import SpecdecUserError
    from test_run_cli import run_in_process

    with pytest.raises(SpecdecUserError, match="group_size=2 is smaller than batch_size=4"):
        run_in_process(tmp_path, ["experiment=synthetic", "workload.num_prompts=5", "batch_size=4", "group_size=2"])
