"""The drafter registry and contract (drafters.base): every registered drafter is a DrafterBase,
declares the options budget.mode=auto sets, and says whether its config uses weights bundled for
SmolLM2."""

from __future__ import annotations

import inspect
import typing

import pytest

from drafters import base
from drafters.base import DRAFTERS, BudgetKnobs, DrafterBase, StatelessDrafter


def test_every_registered_drafter_builds_a_drafter_base():
    for name in base.names():
        factory = DRAFTERS.get(name)
        built = factory if inspect.isclass(factory) else inspect.signature(factory, eval_str=True).return_annotation
        assert issubclass(built, DrafterBase), name


def test_the_budget_knobs_are_the_factories_own_options():
    assert base.budget_knobs("eagle3") == BudgetKnobs(depth="depth", nodes="total_tokens")
    assert base.budget_knobs("ngram") == BudgetKnobs(depth="num_draft")
    assert base.budget_knobs("union") == BudgetKnobs()  # nothing to size
    for name in base.names():
        options = {p.name for p in inspect.signature(DRAFTERS.get(name)).parameters.values()}
        knobs = base.budget_knobs(name)
        assert {knobs.depth, knobs.nodes} - {None} <= options, name


def test_every_drafter_that_may_bound_its_depth_declares_it():
    """budget.mode=auto reads ``max_depth`` only from drafters registered ``bounded``: a module that
    sets it must register so, or the chooser would calibrate deeper than the drafter can draft."""
    bounded = set()
    for name in base.names():
        factory = DRAFTERS.get(name)
        # the drafter class may live apart from its factory (drafters.formats.load registers the heads
        # that take any published layout): read the module of the class the factory returns too
        returned = typing.get_type_hints(factory).get("return")
        modules = {inspect.getmodule(factory)} | ({inspect.getmodule(returned)} if isinstance(returned, type) else set())
        if any("self.max_depth =" in inspect.getsource(module) for module in modules):
            assert base.budget_knobs(name).bounded, name
            bounded.add(name)
    assert bounded == {"dflash", "medusa", "mtp"}  # domino: drafters.dflash's drafter


def test_a_budget_knob_naming_no_option_is_refused_at_registration():
    with pytest.raises(ValueError, match="'typo'.*BudgetKnobs name num_drafts, which its factory does not take"):
        base.register("typo", budget=BudgetKnobs(depth="num_drafts"))(lambda target, num_draft=3: None)
    assert "typo" not in DRAFTERS


def test_bundled_weights_are_folder_options_left_null_in_the_drafter_or_a_member(tmp_path):
    assert base.bundled_weights({"name": "eagle3", "checkpoint": None})
    assert base.bundled_weights({"name": "mtp"})  # unset: the factory's default, the bundled modules
    assert not base.bundled_weights({"name": "eagle3", "checkpoint": str(tmp_path)})
    assert not base.bundled_weights({"name": "ngram", "num_draft": 3})
    assert not base.bundled_weights({"name": "draft_model", "model_path": str(tmp_path)})
    ngram = {"name": "ngram"}
    assert base.bundled_weights({"name": "union", "members": [ngram, {"name": "retrieval", "datastore": None}]})
    assert not base.bundled_weights({"name": "union", "members": [ngram, {"name": "eagle", "checkpoint": str(tmp_path)}]})


def test_the_optional_capabilities_default_to_nothing():
    class Chain(StatelessDrafter):
        def propose(self, ctx):
            raise NotImplementedError

    drafter = Chain()
    assert (drafter.target_layers, drafter.commit_reads_tree, dict(drafter.report), drafter.quantizable()) == ((), False, {}, [])
    with pytest.raises(TypeError, match="abstract"):  # a drafter without the protocol's methods
        type("Partial", (DrafterBase,), {"propose": lambda self, ctx: None})()
