"""The adaptive union (drafters/union.py, adaptive=true): per request, members' node P follow their
recent outcomes. Greedy-equal with plain decoding (batch 1 and continuous batching), every
candidate labelled by the committed text (kept or not), a member that stops paying in a request
loses its nodes there within a few steps and one that starts paying regains them, each request
independently of its batch neighbours. Exactness at T = 1: tests/test_exactness.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from drafters.base import StatelessDrafter, build
from drafters.synthetic import SyntheticDrafter
from drafters.union import (DEFAULT_CALIBRATIONS, Calibration, RequestState, UnionDrafter, bundled_calibrations, calibration_paths,
                            node_paths)
from specdec.decode import SpecDecoder
from specdec.sampling import SamplingParams
from specdec.synthetic import SyntheticTarget
from specdec.tree import SiblingMode
from test_union import NGRAMS, head_and_ngram, write_calibration
from verifiers import reference

GREEDY = SamplingParams(0.0)
CHAIN = {"name": "synthetic", "branching": (1, 1, 1), "mode": "deterministic"}
LINEAR = [1.0 + 0.2 * k for k in range(8)]  # T(n)/T(1): every row costs a fifth of a forward more
CONFIG = Path(__file__).parents[1] / "configs" / "drafter" / "union_adaptive.yaml"


# -- greedy equality on a tiny model ----------------------------------------------------------------


class Unscored(StatelessDrafter):
    """A member's trees without their confidence (a drafter that gives none)."""

    def __init__(self, inner) -> None:
        self.inner, self.target_layers = inner, inner.target_layers

    def reset(self, batch_size, max_length):
        self.inner.reset(batch_size, max_length)

    def admit(self, count, max_length):
        self.inner.admit(count, max_length)

    def retain(self, rows):
        self.inner.retain(rows)

    def commit(self, tree, result):
        self.inner.commit(tree, result)

    def propose(self, ctx):
        return dataclasses.replace(self.inner.propose(ctx), confidence=None)


@pytest.mark.parametrize("max_batch", [1, 2])
def test_greedy_adaptive_union_equals_plain_decoding(tmp_path, max_batch):
    """An untrained EAGLE-3 head and n-gram lookup (no table fits them: P0 is their confidence),
    at batch 1 and with 4 prompts through 2 rows (continuous batching)."""
    target, members, prompts, plain = head_and_ngram(tmp_path)
    union = build("union", target, members=members, costs=LINEAR, max_rows=8, adaptive=True)
    assert union.report["adaptive"]["tables"] == [False, False]
    out = SpecDecoder(target, union, reference.verify).generate(prompts, 20, GREEDY, max_batch=max_batch)
    assert out.outputs == plain.outputs
    assert out.stats.tau > 1.0
    report = json.loads(json.dumps(union.report))  # as results.json holds it
    for member in report["adaptive"]["members"]:
        assert member["proposed"] >= member["kept"] >= member["accepted"]
        assert member["kept_share"]["requests"] == len(prompts)
    assert report["adaptive"]["members"][1]["accepted"] > 0  # the repetitive prompts' n-gram drafts


def test_greedy_adaptive_union_with_a_member_without_confidence(tmp_path):
    target, members, prompts, plain = head_and_ngram(tmp_path)
    union = build("union", target, members=members, costs=LINEAR, max_rows=8, adaptive=True, calibration=[])
    name, ngram = union.members[1]
    union.members[1] = (name, Unscored(ngram))  # its P0 is the prior, its P then its own record
    out = SpecDecoder(target, union, reference.verify).generate(prompts, 20, GREEDY, max_batch=2)
    assert out.outputs == plain.outputs
    assert union.report["adaptive"]["members"][1]["accepted"] > 0


# -- labels: every candidate, settled by the committed text -------------------------------------------


def test_every_candidate_is_labelled_by_the_committed_text_over_later_steps():
    target = SyntheticTarget(vocab_size=16, seed=0)
    union = UnionDrafter(target, [CHAIN, CHAIN], costs=LINEAR, max_rows=8, adaptive=True, calibration=[], decay=0.5)
    state = RequestState.fresh(2, union._depths)
    nodes = [(0, (5,), 0.0), (0, (5, 6), 0.0), (0, (5, 6, 7), 0.0), (1, (5,), 0.0), (1, (5, 8), 0.0), (1, (9,), 0.0)]
    bases = [0.5, 0.4, 0.3, 0.5, 0.2, 0.1]
    # only (5,) was verified, and accepted; the target went on with 6 (its own token)
    union._learn(state, nodes, bases, {(5,)}, (5, 6))
    assert (state.proposed, state.kept, state.accepted, state.verified) == ([3, 3], [1, 1], [1, 1], 1)
    # settled: both (5,) hit, (5, 6) hit though never verified, (5, 8) and (9,) missed; (5, 6, 7) waits
    assert state.hits[0][:3] == [1.0, 1.0, 0.0] and state.expected[0][:3] == [0.5, 0.4, 0.0]
    assert state.hits[1][:2] == [1.0, 0.0] and state.expected[1][:2] == [0.6, 0.2]
    assert state.open == [(0, 3, 0.3, (7,))]
    union._learn(state, [], [], set(), (7, 3))  # the next step's text settles it: a hit at depth 3
    assert state.open == [] and state.hits[0][2] == 1.0 and state.expected[0][2] == pytest.approx(0.3)
    union._learn(state, [(0, (2,), 0.0)], [0.5], {(2,)}, (4,))  # a miss at depth 1: decayed, then added
    assert state.hits[0][0] == pytest.approx(0.5) and state.expected[0][0] == pytest.approx(0.75)
    assert state.hits[1][0] == 1.0  # member 1 settled nothing this step: its sums keep
    w = union.prior_weight
    assert union._factor(state, 0, 1) == pytest.approx((0.5 + w) / (0.75 + w))
    assert union._factor(state, 1, 9) == 1.0  # no evidence at depth 7+: P = P0


def test_rows_follow_the_batch_through_retain_and_admit():
    target = SyntheticTarget(vocab_size=16, seed=0)
    union = UnionDrafter(target, [CHAIN, CHAIN], costs=LINEAR, max_rows=8, adaptive=True, calibration=[])
    union.reset(3, 64)
    for row, state in enumerate(union._states):
        state.hits[0][0], state.kept[0], state.verified = float(row), row, 4
    union.retain(torch.tensor([2, 0]))
    assert [state.hits[0][0] for state in union._states] == [2.0, 0.0]
    assert union._shares[0] == [0.25] and union._shares[1] == [0.0]  # row 1 finished with 1 of 4 nodes from member 0
    union.admit(2, 64)
    assert [state.hits[0][0] for state in union._states] == [2.0, 0.0, 0.0, 0.0] and union._states[3].verified == 0
    union.reset(1, 64)
    assert len(union._states) == 1 and union._states[0].verified == 0


# -- adaptation: per request, from the request's own outcomes -----------------------------------------


class Selective(StatelessDrafter):
    """A 3-token chain that is the target's greedy continuation (divergence 0) in requests whose
    prompt starts with ``favoured``, noise (divergence 1) in the others; from committed length
    ``switch_at`` on, the other way round. Gives no confidence."""

    def __init__(self, target: SyntheticTarget, favoured: int, seed: int, switch_at: int | None = None) -> None:
        self.good = SyntheticDrafter(target, (1, 1, 1), SiblingMode.DETERMINISTIC, divergence=0.0)
        self.bad = SyntheticDrafter(target, (1, 1, 1), SiblingMode.DETERMINISTIC, divergence=1.0, seed=seed)
        self.favoured, self.switch_at = favoured, switch_at

    def propose(self, ctx):
        good, bad = self.good.propose(ctx), self.bad.propose(ctx)
        pays = ctx.tokens[:, 0] == self.favoured
        if self.switch_at is not None:
            pays = pays ^ (ctx.lengths >= self.switch_at)
        return dataclasses.replace(good, tokens=torch.where(pays[:, None], good.tokens, bad.tokens))


def selective_union(target, switch_at=None):
    """Member a pays in requests whose prompt starts with 1, member b in those starting with 2."""
    union = UnionDrafter(target, [CHAIN, CHAIN], costs=LINEAR, max_rows=8, adaptive=True, calibration=[])
    union.members = [("a", Selective(target, 1, seed=11, switch_at=switch_at)),
                     ("b", Selective(target, 2, seed=12, switch_at=switch_at))]
    return union


def kept_per_step(union, prompts):
    """Wraps union.propose: per request (its prompt, as a tuple), per step, each member's kept nodes."""
    history: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    propose = union.propose

    def tracked(ctx):
        tree = propose(ctx)
        for b, nodes in enumerate(node_paths(tree)):
            verified = {path for path, _ in nodes}
            kept = [sum(path in verified for m, path, _ in union._pending[b] if m == member)
                    for member in range(len(union.members))]
            prompt = next(tuple(p) for p in prompts if ctx.tokens[b, : len(p)].tolist() == list(p))
            history.setdefault(prompt, []).append(tuple(kept))
        return tree

    union.propose = tracked
    return history


PROMPTS = [[1, 3, 4], [2, 5, 6], [1, 7, 8], [2, 9, 10]]


def decode(prompts, max_batch=None, switch_at=None, tokens=24):
    target = SyntheticTarget(vocab_size=64, sharpness=3.0, seed=0)
    union = selective_union(target, switch_at)
    history = kept_per_step(union, prompts)
    out = SpecDecoder(target, union, reference.verify).generate(prompts, tokens, GREEDY, max_batch=max_batch)
    plain = SpecDecoder(target, None, reference.verify).generate(prompts, tokens, GREEDY)
    assert out.outputs == plain.outputs
    return history, union


def test_a_member_that_never_hits_loses_its_nodes_per_request():
    """Two requests in one batch favouring different members: at the first step both members' nodes
    are kept (equal priors); from the second, each request keeps its own paying member's nodes
    and fewer (here none) of the other's."""
    history, union = decode(PROMPTS[:2])
    for prompt, favoured in ((tuple(PROMPTS[0]), 0), (tuple(PROMPTS[1]), 1)):
        steps = history[prompt]
        assert all(steps[0]), steps  # the priors keep both
        for kept in steps[1:]:
            assert kept[favoured] > kept[1 - favoured], (prompt, steps)
    members = union.report["adaptive"]["members"]
    assert members[0]["kept_share"]["requests"] == 2
    assert members[0]["kept_share"]["p90"] > 0.5 > members[0]["kept_share"]["p10"]  # one request each way


def test_each_requests_trees_are_its_own_whatever_its_batch_neighbours():
    """The same requests decoded alone, two at a time through continuous batching and all at once:
    every request's kept nodes, step by step, are the same."""
    alone = {}
    for prompt in PROMPTS:
        alone.update(decode([prompt])[0])
    for max_batch in (2, None):
        history, _ = decode(PROMPTS, max_batch=max_batch)
        assert history == alone


def test_a_member_that_starts_paying_regains_its_nodes():
    """Member a pays in request [1, ...] until 12 tokens are committed, member b from then on. b's
    dropped nodes are still labelled by the committed text, so b regains them within a few steps
    (and a loses them) without any exploration."""
    history, _ = decode([PROMPTS[0]], switch_at=12, tokens=40)
    steps = history[tuple(PROMPTS[0])]
    # a's chains are accepted whole (4 tokens a step): steps 2-3 (committed 7, 11) keep a's nodes only
    assert steps[1:3] == [(3, 0), (3, 0)], steps
    # from step 4 (committed 15) a drafts noise and b pays: b has all its nodes back within 3 steps,
    # and a loses its own (more slowly: its record was long)
    assert any(kept[1] == 3 for kept in steps[3:6]), steps
    assert steps[-1] == (0, 3), steps


# -- tables, options, refusals --------------------------------------------------------------------------


def test_each_member_takes_its_own_table_from_any_file_that_fitted_it(tmp_path):
    accept = [[[0.1, 0.9]] * 4, [[0.2, 0.8]] * 4]
    path = write_calibration(tmp_path / "c.json", NGRAMS, accept)
    other = {"name": "ngram", "num_draft": 4}
    table = Calibration.load(path, [other, NGRAMS[0]], by_member=True)
    assert (table.fits(0), table.fits(1)) == (False, True) and table.probability(1, 1, 0.7) == 0.9
    with pytest.raises(ValueError, match="fitted for members"):
        Calibration.load(path, [other, NGRAMS[0]])  # the plain budgeted union wants the whole list
    members = yaml.safe_load(CONFIG.read_text())["members"]
    budgeted = yaml.safe_load((CONFIG.parent / "union_retrieval.yaml").read_text())["members"]
    for packaged in ("smollm2", "gemma3_270m"):  # each packaged target's tables: T = 0 and T = 1, fitted on it
        for path, temperature in zip(calibration_paths(packaged), (0.0, 1.0)):
            table = Calibration.load(path, members, by_member=True)  # both of union_adaptive's members
            assert table.fits(0) and table.fits(1) and table.temperature == temperature
            assert Calibration.load(path, budgeted).temperature == temperature  # exactly union_retrieval's members
            assert json.loads(path.read_text()).get("target", packaged) == packaged


def test_a_target_starts_from_the_tables_fitted_on_it_only():
    """SmolLM2's tables hold SmolLM2's acceptance, Gemma 3's its own; a local model and a synthetic
    target start from their members' confidence instead."""
    def named(key: str) -> SimpleNamespace:
        return SimpleNamespace(key=key)

    assert bundled_calibrations(named("smollm2")) == list(DEFAULT_CALIBRATIONS)
    assert bundled_calibrations(named("gemma3_270m")) == list(calibration_paths("gemma3_270m"))
    for target in (named("hf"), SyntheticTarget(vocab_size=4, seed=0)):
        assert bundled_calibrations(target) == []
    union = UnionDrafter(SyntheticTarget(vocab_size=16, seed=0), [CHAIN, CHAIN], costs=LINEAR, max_rows=8, adaptive=True)
    assert union.report["adaptive"]["tables"] == [False, False]
    with pytest.raises(ValueError, match="none is bundled for this target.*calibrate_union"):
        UnionDrafter(SyntheticTarget(vocab_size=16, seed=0), [CHAIN, CHAIN], costs=LINEAR, max_rows=8)


def test_the_adaptive_union_starts_from_the_table_and_the_confidence():
    """Before any evidence a node's P is P0: a table's P, else the member's confidence, else the prior."""
    target = SyntheticTarget(vocab_size=16, seed=0)
    union = UnionDrafter(target, [CHAIN, CHAIN], costs=LINEAR, max_rows=8, adaptive=True, calibration=[], prior=0.3)
    table = Calibration([0.0, 0.5, 1.0 + 1e-6], [None, [[0.1, 0.6]] * 4], 0.0)
    assert union._base([None, table], [True, True], 1, (4, 5), 0.7) == 0.6
    assert union._base([None, table], [True, True], 0, (4,), 0.7) == pytest.approx(0.7)
    assert union._base([None, table], [True, True], 0, (4,), 3.0) == 1.0  # a score beyond [0, 1] is clamped
    assert union._base([None, None], [False, True], 0, (4,), 0.0) == 0.3


def test_adaptive_refusals(tmp_path):
    target = SyntheticTarget(vocab_size=6, seed=0)
    with pytest.raises(ValueError, match="needs costs"):
        UnionDrafter(target, [CHAIN, CHAIN], adaptive=True)
    with pytest.raises(ValueError, match="0 <= decay <= 1"):
        UnionDrafter(target, [CHAIN, CHAIN], costs=LINEAR, max_rows=8, adaptive=True, decay=1.5)
    with pytest.raises(ValueError, match="prior_weight > 0"):
        UnionDrafter(target, [CHAIN, CHAIN], costs=LINEAR, max_rows=8, adaptive=True, prior_weight=0.0)
    with pytest.raises(ValueError, match="needs a calibration table"):
        UnionDrafter(target, [CHAIN, CHAIN], costs=LINEAR, max_rows=8, calibration=[])
    with pytest.raises(FileNotFoundError, match="calibrate_union"):
        UnionDrafter(target, [CHAIN, CHAIN], costs=LINEAR, max_rows=8, adaptive=True, calibration=str(tmp_path / "none.json"))
    plain = UnionDrafter(target, NGRAMS, costs=LINEAR, max_rows=8,
                         calibration=write_calibration(tmp_path / "c.json", NGRAMS, [[[0.1, 0.5]] * 4] * 2))
    assert "adaptive" not in plain.report  # the plain budgeted union's report is unchanged


@pytest.mark.slow
def test_on_smollm2_a_copying_request_leans_on_the_ngram_member_and_a_chat_one_on_the_head():
    """union_adaptive's members on the real model, one run, two requests in one batch: one asks
    for a passage back word for word, one is MT-bench's first question. Greedy-equal with plain
    decoding; the n-gram member's share of the kept nodes is higher in the copying request.
    Trees priced by the bundled CPU profile, not a timed one, so the test does not depend on timing."""
    from experiments.common.prompt_sets import Prompt, encode_prompt, load_mtbench
    from specdec.packaged_models import load_smollm2
    from specdec.target import HFTarget

    model, tokenizer = load_smollm2()
    target = HFTarget(model, packed_gemm_from="auto", key="smollm2")
    passage = ("The lighthouse keeper climbed the stairs at dusk, lit the lamp, wound the clockwork that "
               "turned the lens, and wrote the time, the wind and the ships he saw in the log.")
    copying = Prompt(text=f"Repeat this text word for word:\n\n{passage}", category="copy", id="copy", chat=True)
    prompts = [encode_prompt(tokenizer, p) for p in (copying, load_mtbench(1)[0])]
    options = {k: v for k, v in yaml.safe_load(CONFIG.read_text()).items() if k not in ("name", "cost_batch")}
    options["costs"] = str(Path(__file__).parents[1] / "docs" / "data" / "tn" / "tn-smollm2-cpu.csv")
    union = build("union", target, **options)
    history = kept_per_step(union, prompts)
    eos = tokenizer.eos_token_id
    out = SpecDecoder(target, union, reference.verify).generate(prompts, 48, GREEDY, eos_token_id=eos, max_batch=2)
    plain = SpecDecoder(target, None, reference.verify).generate(prompts, 48, GREEDY, eos_token_id=eos)
    assert out.outputs == plain.outputs
    share = [sum(k[1] for k in history[tuple(p)]) / max(1, sum(map(sum, history[tuple(p)]))) for p in prompts]
    print("n-gram share of kept nodes (copying, chat):", share, union.report["adaptive"])
    assert share[0] > share[1]
    assert union.report["adaptive"]["members"][1]["accepted"] > 0
