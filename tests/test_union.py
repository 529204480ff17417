"""The union drafter: members' drafts merged into one trie, exact at T > 0 through the whole loop,
greedy-equal with a trained-head member under continuous batching, and clear refusals."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch

from drafters.base import build
from drafters.eagle import EagleConfig, EagleHead
from drafters.heads import save_head
from drafters.union import UnionDrafter
from experiments.calibrate_union import EDGES, fit, non_decreasing
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


@pytest.mark.statistical
@pytest.mark.parametrize("temperature", [0.7])
def test_union_of_deterministic_drafts_is_exact(temperature):
    """Two synthetic drafters with different drafts, merged: the sequence-level chi-square test of
    tests/test_exactness.py through the whole decode loop."""
    verdict = run(lambda target: UnionDrafter(target, [TOP2, CHAIN3]), SamplingParams(temperature), length=3)
    print(verdict)
    assert verdict.impossible == 0 and verdict.p_value > ALPHA, verdict


def head_and_ngram(tmp_path):
    """A tiny target, a union of an untrained EAGLE-3 head and n-gram lookup for it, and prompts
    (two repeat themselves) with plain decoding's greedy outputs."""
    target = HFTarget(tiny_model("llama", sharpness=4.0))
    torch.manual_seed(0)
    save_head(EagleHead(EagleConfig.for_target(target, feature_layers=(1, 2))).eval(), tmp_path / "head")
    members = [
        {"name": "eagle3", "checkpoint": str(tmp_path / "head"), "depth": 2, "top_k": 2, "total_tokens": 3},
        {"name": "ngram", "num_draft": 3, "max_branches": 2},
    ]
    prompts = [[5, 6, 7, 8, 5, 6, 7], [3], [9, 10, 11, 9, 10], [4, 4, 4]]
    plain = SpecDecoder(target, None, reference.verify).generate(prompts, 20, SamplingParams(0.0))
    return target, members, prompts, plain


def test_greedy_union_with_a_head_and_ngram_equals_plain_decoding(tmp_path):
    target, members, prompts, plain = head_and_ngram(tmp_path)
    union = build("union", target, members=members)
    assert union.target_layers == (1, 2)
    greedy = SamplingParams(0.0)
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


# -- the budgeted merge ------------------------------------------------------------------------------

NGRAMS = [{"name": "ngram", "num_draft": 3, "max_branches": 2}, {"name": "ngram", "num_draft": 2, "rank": "frequency"}]


def write_calibration(path, members, accept, edges=(0.0, 0.5, 1.0 + 1e-6), temperature=0.0):
    path.write_text(json.dumps({"members": members, "edges": list(edges), "accept": accept, "temperature": temperature}))
    return str(path)


def test_the_budget_keeps_the_subtree_with_the_best_expected_rate(tmp_path):
    """Against every ancestor-closed subset of small random candidate trees: the kept nodes give the
    highest (1 + sum of P) / (T(k + 1) / T(1) + c)."""
    from specdec.synthetic import SyntheticTarget

    rng = random.Random(0)
    costs = [1.0, 1.08, 1.12, 1.4, 1.45, 1.52, 1.6, 1.66, 1.7]
    for trial in range(30):
        accept = [[[rng.random() * 0.3, 0.3 + rng.random() * 0.7] for _ in range(4)] for _ in range(2)]
        calibration = write_calibration(tmp_path / f"c{trial}.json", NGRAMS, accept)
        union = UnionDrafter(SyntheticTarget(vocab_size=6, seed=0), NGRAMS, costs=costs, calibration=calibration,
                             max_rows=len(costs), draft_cost=0.1)
        assert union.report == {"costs": costs, "draft_cost": 0.1, "cost_batch": 1}  # for results.json
        paths = {()}
        for _ in range(6):  # a random tree of up to 6 nodes over tokens 0..2
            paths.add(rng.choice(sorted(paths)) + (rng.randrange(3),))
        nodes = [(rng.randrange(2), p, rng.random()) for p in sorted(paths - {()}, key=len)]
        kept, _ = union._budget(nodes, union.calibrations[0])
        chance = {}
        for member, path, confidence in nodes:
            chance[path] = max(chance.get(path, 0.0), union.calibrations[0].probability(member, len(path), confidence))
        for path in sorted(chance, key=len):
            if len(path) > 1:
                chance[path] = min(chance[path], chance[path[:-1]])
        rate = lambda subset: (1 + sum(chance[p] for p in subset)) / (costs[len(subset)] + 0.1)
        candidates = sorted(chance)
        best = max(
            rate(subset)
            for k in range(len(candidates) + 1)
            for subset in itertools.combinations(candidates, k)
            if all(len(p) == 1 or p[:-1] in subset for p in subset)
        )
        assert {tuple(p) for p in kept} <= set(chance)
        assert rate([tuple(p) for p in kept]) == pytest.approx(best), trial


def test_a_recorded_calibration_drives_a_greedy_equal_budgeted_union(tmp_path):
    target, members, prompts, plain = head_and_ngram(tmp_path)
    greedy = SamplingParams(0.0)
    recording = build("union", target, members=members, record=True)
    SpecDecoder(target, recording, reference.verify).generate(prompts, 20, greedy, max_batch=2)
    assert {member for member, *_ in recording.records} == {0, 1}
    assert any(hit for *_, hit in recording.records) and not all(hit for *_, hit in recording.records)
    accept, count = fit(recording.records, len(members))
    assert sum(map(sum, count[1])) == sum(1 for m, *_ in recording.records if m == 1)
    calibration = write_calibration(tmp_path / "calibration.json", members, accept, EDGES)
    costs = [1.0, 1.05, 1.1, 1.4, 1.45, 1.5, 1.55, 1.6]
    union = build("union", target, members=members, costs=costs, calibration=calibration, max_rows=8)
    out = SpecDecoder(target, union, reference.verify).generate(prompts, 20, greedy, max_batch=2)
    assert out.outputs == plain.outputs
    assert out.stats.tau > 1.0
    assert max(step["mean_tree_nodes"] for step in out.steps) <= 7


def test_each_step_uses_the_table_fitted_nearest_its_temperature(tmp_path):
    from specdec.synthetic import SyntheticTarget

    likely = write_calibration(tmp_path / "t0.json", NGRAMS, [[[0.9, 0.9]] * 4] * 2, temperature=0.0)
    hopeless = write_calibration(tmp_path / "t1.json", NGRAMS, [[[0.0, 0.0]] * 4] * 2, temperature=1.0)
    target = SyntheticTarget(vocab_size=6, seed=0)
    union = UnionDrafter(target, NGRAMS, costs=[1.0, 1.1, 1.2, 1.3, 1.4, 1.5], max_rows=6, calibration=[likely, hopeless])
    ctx = lambda t: DraftContext(torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2]]), torch.tensor([8]), (), torch.zeros(1, dtype=torch.int64),
                                 SamplingParams(t), RequestRNG(torch.tensor([0])))
    union.reset(1, 32)
    assert int(union.propose(ctx(0.3)).num_nodes[0]) > 0  # nearest 0: every node is worth its row
    assert int(union.propose(ctx(0.8)).num_nodes[0]) == 0  # nearest 1: none is


def test_calibration_tables_are_non_decreasing_in_confidence():
    assert non_decreasing([0.1, 0.3, 0.2, 0.5], [1, 1, 1, 1]) == pytest.approx([0.1, 0.25, 0.25, 0.5])
    records = [(0, 1, 0.9, False)] * 5 + [(0, 1, 0.1, True)] * 5 + [(0, 2, 0.5, True)]
    accept, count = fit(records, 1)
    assert all(a <= b for table in accept[0] for a, b in zip(table, table[1:]))
    assert count[0][0][EDGES.index(0.9)] == 5 and count[0][1][EDGES.index(0.5)] == 1


def test_trees_are_priced_by_t_n_at_the_cost_batch(tmp_path, monkeypatch):
    """costs=measure times B requests of n rows each; a CSV profile must come from that batch size."""
    import drafters.union as union_module
    from specdec.speedup import ForwardProfile

    target = HFTarget(tiny_model("llama"))
    calibration = write_calibration(tmp_path / "c.json", NGRAMS, [[[0.1, 0.5]] * 4] * 2)
    timed = []

    def fake_profile(target, sizes, context_length, repeats, batch_size):
        timed.append(batch_size)  # at batch 4 each added row costs more than at batch 1
        return ForwardProfile(sizes, [1.0 + 0.1 * batch_size * (n - 1) for n in sizes], context_length, batch_size)

    monkeypatch.setattr(union_module, "profile_forward", fake_profile)
    for batch, expected in ((1, [1.0, 1.1, 1.2, 1.3]), (4, [1.0, 1.4, 1.8, 2.2])):
        union = UnionDrafter(target, NGRAMS, costs="measure", calibration=calibration, max_rows=4, cost_batch=batch)
        assert union.costs == pytest.approx(expected) and union.report["cost_batch"] == batch
    assert timed == [1, 4]
    csv = tmp_path / "tn.csv"
    csv.write_text("n,seconds,context,batch\n1,0.010,128,1\n2,0.011,128,1\n4,0.013,128,1\n")
    union = UnionDrafter(target, NGRAMS, costs=str(csv), calibration=calibration, max_rows=4)
    assert union.costs == pytest.approx([1.0, 1.1, 1.2, 1.3])
    csv.write_text("n,seconds,context,batch\n1,0.010,128,1\n2,0.012,128,1\n3,0.011,128,1\n4,0.013,128,1\n")
    union = UnionDrafter(target, NGRAMS, costs=str(csv), calibration=calibration, max_rows=4)
    assert union.costs == pytest.approx([1.0, 1.2, 1.2, 1.3])  # a timed dip is noise: more rows never cost less
    with pytest.raises(ValueError, match="measured at batch 1, but this union prices trees at batch 4"):
        UnionDrafter(target, NGRAMS, costs=str(csv), calibration=calibration, max_rows=4, cost_batch=4)
    with pytest.raises(ValueError, match="cost_batch >= 1"):
        UnionDrafter(target, NGRAMS, costs=str(csv), calibration=calibration, max_rows=4, cost_batch=0)


def test_budgeted_union_refusals(tmp_path):
    from specdec.synthetic import SyntheticTarget

    target = SyntheticTarget(vocab_size=6, sharpness=1.5, seed=0)
    accept = [[[0.1, 0.5]] * 4] * 2
    calibration = write_calibration(tmp_path / "c.json", NGRAMS, accept)
    with pytest.raises(ValueError, match="set costs=null"):
        UnionDrafter(target, NGRAMS, costs=[1.0] * 16, record=True)
    with pytest.raises(ValueError, match="fitted for members"):
        UnionDrafter(target, [TOP2, CHAIN3], costs=[1.0] * 16, calibration=calibration)
    with pytest.raises(FileNotFoundError, match="calibrate_union"):
        UnionDrafter(target, NGRAMS, costs=[1.0] * 16, calibration=str(tmp_path / "none.json"))
    with pytest.raises(ValueError, match="never falling"):
        UnionDrafter(target, NGRAMS, costs=[1.0, 0.9] + [1.0] * 14, calibration=calibration)
    no_confidence = write_calibration(tmp_path / "s.json", [TOP2, CHAIN3], accept)
    union = UnionDrafter(target, [TOP2, CHAIN3], costs=[1.0] * 16, calibration=no_confidence)
    with pytest.raises(ValueError, match="no confidence"):
        SpecDecoder(target, union, reference.verify).generate([[1, 2]], 3, SamplingParams(0.0))


def test_calibrate_union_writes_to_the_targets_table_or_asks_where(tmp_path, capsys):
    """By default a table goes where the union reads the target's own at T = 0 or 1; another
    temperature has no such place, so --out is asked for before any model loads."""
    from experiments.calibrate_union import main

    with pytest.raises(SystemExit):
        main(["--temperature", "0.5", "--target", "gemma3_270m"])
    assert "--temperature 0.5: no bundled table is read at it" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--target", "llama"])
    assert "invalid choice: 'llama'" in capsys.readouterr().err


@pytest.mark.slow
def test_calibrate_union_fits_a_table_on_the_real_target(tmp_path):
    """Two short prompts on SmolLM2: a table for exactly the members given, labelled with its target."""
    from drafters.union import Calibration
    from experiments.calibrate_union import main

    members = [{"name": "ngram", "num_draft": 3, "max_ngram": 3, "min_ngram": 1},
               {"name": "ngram", "num_draft": 2, "max_ngram": 2, "min_ngram": 1}]
    (tmp_path / "members.yaml").write_text(json.dumps({"members": members}))
    main(["--members", str(tmp_path / "members.yaml"), "--prompts", "2", "--max-new-tokens", "8",
          "--out", str(tmp_path / "table.json")])
    table = json.loads((tmp_path / "table.json").read_text())
    assert table["target"] == "smollm2" and table["nodes"] > 0 and table["temperature"] == 0.0
    calibration = Calibration.load(tmp_path / "table.json", members)
    assert calibration.fits(0) and calibration.fits(1)
