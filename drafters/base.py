"""The drafter contract and the registry that configs name drafters through.

Every drafter subclasses ``DrafterBase`` (a Drafter of specdec.protocols, with the optional
capabilities declared and defaulted) or ``StatelessDrafter``. Adding a drafter = one module here whose
factory registers with ``@register("name")``, plus one YAML in configs/drafter/ (docs/adding-a-drafter.md).
Nothing in the core or the verifiers dispatches on drafter names.
"""

from __future__ import annotations

import inspect
import types
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from torch import Tensor, nn

from specdec.protocols import DraftContext, Drafter, Target, TargetSizes, VerifyResult
from specdec.registry import Registry
from specdec.speedup import TreeShape
from specdec.tree import DraftTree, SiblingMode

__all__ = [
    "DRAFTERS", "BudgetKnobs", "DraftContext", "DraftTree", "Drafter", "DrafterBase", "SiblingMode", "StatelessDrafter",
    "TargetSizes", "VerifyResult", "budget_knobs", "build", "bundled_weights", "check_options", "names", "register", "tree_shape",
]


class DrafterBase(ABC):
    """A Drafter (specdec.protocols: reset, admit, propose, commit, retain) and the optional
    capabilities the framework asks every drafter about, declared here with their defaults."""

    # target layers whose hidden states it reads (0 = embeddings, k = block k, L + 1 = final norm)
    target_layers: tuple[int, ...] = ()
    # True when its state follows what its own last tree accepted (its own KV cache of the drafted
    # tokens): then commit must be given the tree it proposed itself, which a union cannot promise
    # when another member's branch is accepted, so drafters.union refuses it as a member
    commit_reads_tree: bool = False
    # what it measured or decided when it was built (a timed cost curve, ...): specdec-run records
    # it in results.json as drafter_report; read-only and empty unless a drafter sets its own
    report: Mapping[str, Any] = MappingProxyType({})
    # the deepest tree it can draft at all (a head trained for so many positions), None: no bound;
    # budget.mode=auto considers no deeper tree (a drafter that sets it registers BudgetKnobs(bounded=True))
    max_depth: int | None = None

    def quantizable(self) -> list[nn.Module]:
        """The modules holding weights of its own, which drafter_quant may quantize in place
        (drafters.quantize); never modules of the target. None by default."""
        return []

    def observe(self, tree: DraftTree, logits: Tensor, result: VerifyResult) -> None:
        """The target's logits over the step's tree (specdec.protocols.Drafter.observe); most
        drafters need nothing from them."""

    @abstractmethod
    def reset(self, batch_size: int, max_length: int) -> None: ...

    @abstractmethod
    def admit(self, count: int, max_length: int) -> None: ...

    @abstractmethod
    def propose(self, ctx: DraftContext) -> DraftTree: ...

    @abstractmethod
    def commit(self, tree: DraftTree, result: VerifyResult) -> None: ...

    @abstractmethod
    def retain(self, rows: Tensor) -> None: ...


class StatelessDrafter(DrafterBase):
    """Base for drafters that keep nothing per request between steps (everything they need is
    rebuilt from each DraftContext): starting, admitting, committing and dropping requests is free."""

    def reset(self, batch_size: int, max_length: int) -> None:
        pass

    def admit(self, count: int, max_length: int) -> None:
        pass

    def commit(self, tree: DraftTree, result: VerifyResult) -> None:
        pass

    def retain(self, rows: Tensor) -> None:
        pass


@dataclass(frozen=True)
class BudgetKnobs:
    """The factory options budget.mode=auto sets (experiments/run/budget.py): ``depth`` names the
    drafting depth, ``nodes`` the number of tree nodes (tree drafters only). None: no such option;
    BudgetKnobs() = nothing to size. ``bounded``: what it loads may bound its depth
    (``DrafterBase.max_depth``), so the chooser builds one to read that bound before calibrating;
    the others are not built an extra time (a draft model would load twice)."""

    depth: str | None = None
    nodes: str | None = None
    bounded: bool = False


# name -> factory(target, **options); traits: shape, budget, check and needs (register)
DRAFTERS: Registry[Callable[..., DrafterBase]] = Registry("drafter", package="drafters")


def register(
    name: str, shape: Callable[..., TreeShape] | None = None, budget: BudgetKnobs | None = None,
    check: Callable[[Mapping[str, Any], TargetSizes], None] | None = None, needs: str | None = None,
) -> Callable[[Callable[..., DrafterBase]], Callable[..., DrafterBase]]:
    """``shape(**options)``, for tree drafters that cannot build every tree (an EAGLE-2 tree gives
    each node at most top_k children and expands only top_k nodes per depth): the TreeShape of the
    trees the factory's ``options`` build, which the tree-budget chooser keeps to. ``budget``: the
    factory options budget.mode=auto may set (None = none). ``check(options, target)``: what the
    factory would refuse, found before the target loads (a checkpoint's files, headers and sizes);
    raises ValueError or FileNotFoundError. ``needs``: the one kind of target (``Target.kind``) the
    drafter runs on, if it needs one: "model" for drafters built on the target's own modules (a
    HeadTarget), "synthetic" for one that reads the synthetic target's logits."""
    knobs = budget or BudgetKnobs()

    def decorate(factory: Callable[..., DrafterBase]) -> Callable[..., DrafterBase]:
        options = set(inspect.signature(factory).parameters)
        unknown = [knob for knob in (knobs.depth, knobs.nodes) if knob is not None and knob not in options]
        if unknown:
            raise ValueError(f"drafter {name!r}: its BudgetKnobs name {', '.join(unknown)}, which its factory does not take")
        return DRAFTERS.register(name, shape=shape, budget=knobs, check=check, needs=needs)(factory)

    return decorate


def names() -> list[str]:
    return DRAFTERS.names()


def budget_knobs(name: str) -> BudgetKnobs:
    """The options of drafter ``name`` that budget.mode=auto sets."""
    return DRAFTERS.trait(name, "budget")


# Options by these names name a folder on disk (a trained head, a datastore); null = the head bundled
# for SmolLM2, or the datastore built from the target's own tokenizer. A drafter whose factory takes
# `members` (drafter configs, as the union does) has each member checked too.
FOLDER_OPTIONS = ("checkpoint", "datastore")


def check_options(name: str, options: Mapping[str, object], target: TargetSizes | None = None) -> None:
    """Refuse options the drafter's factory does not take, by its signature, and folder options
    naming no folder: a typo in a drafter YAML or override fails before any model loads rather than
    when the drafter is built. With ``target``, also what the drafter's registered ``check`` refuses."""
    parameters = _options(name)
    known = [p.name for p in parameters]
    unknown = sorted(set(options) - set(known))
    if unknown and not any(p.kind is p.VAR_KEYWORD for p in parameters):
        raise ValueError(f"drafter {name!r} takes no option {', '.join(unknown)}; its options are {', '.join(known)}")
    for parameter in parameters:
        if parameter.name in options and not _fits(options[parameter.name], parameter.annotation):
            raise ValueError(
                f"drafter {name!r}: {parameter.name}={options[parameter.name]!r} is not a value of type "
                f"{_type_name(parameter.annotation)}"
            )
    for key in FOLDER_OPTIONS:
        folder = options.get(key)
        if isinstance(folder, (str, Path)) and not Path(folder).expanduser().is_dir():
            raise ValueError(f"drafter {name!r}: {key}={folder} is not a folder; give an existing folder, or null for the bundled one")
    if target is not None:
        check_kind(name, target.kind, target.name)
    check = DRAFTERS.trait(name, "check")
    if target is not None and check is not None:
        defaults = {p.name: p.default for p in parameters if p.default is not p.empty}
        check({**defaults, **options}, target)
    for member_name, member in _members(options):
        check_options(member_name, member, target)


def bundled_weights(options: Mapping[str, object]) -> bool:
    """Whether a drafter config ({"name": ..., its options}) leaves a folder option (FOLDER_OPTIONS)
    that its factory takes null or unset, in the drafter or in any union member: it then needs a real
    target, SmolLM2 for a bundled head, one loaded from a folder with its tokenizer for a datastore."""
    name = options["name"]
    rest = {key: value for key, value in options.items() if key != "name"}
    defaults = {p.name: p.default for p in _options(name)}
    bundled = any(key in defaults and rest.get(key, defaults[key]) is None for key in FOLDER_OPTIONS)
    return bundled or any(bundled_weights({"name": member_name, **member}) for member_name, member in _members(rest))


def _options(name: str) -> list[inspect.Parameter]:
    """The factory's parameters after the target: the drafter's options."""
    return list(_signature(DRAFTERS.get(name)).parameters.values())[1:]


def _members(options: Mapping[str, object]) -> list[tuple[str, dict[str, object]]]:
    """(name, options) of each member config of a union-like drafter's ``members`` option."""
    members = options.get("members")
    if not isinstance(members, Sequence) or isinstance(members, str):
        return []
    return [(member["name"], {k: v for k, v in member.items() if k != "name"})
            for member in members if isinstance(member, Mapping) and isinstance(member.get("name"), str)]


SCALARS = (int, float, str, bool, type(None))  # the option types a YAML value is checked against


def _signature(factory: Callable[..., DrafterBase]) -> inspect.Signature:
    try:
        return inspect.signature(factory, eval_str=True)
    except NameError:  # an annotation naming a type imported for type checkers only: options stay unchecked
        return inspect.signature(factory)


def _fits(value: object, annotation: object) -> bool:
    """Whether a config value fits a factory parameter annotated with scalars only (``int``,
    ``float | None``, ...); other annotations (paths, sequences, loaded objects) are the factory's to check."""
    members = typing.get_args(annotation) if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union else (annotation,)
    if not members or not all(member in SCALARS for member in members):
        return True
    if isinstance(value, bool):
        return bool in members
    return isinstance(value, members) or (isinstance(value, int) and float in members)


def _type_name(annotation: object) -> str:
    return getattr(annotation, "__name__", None) or str(annotation)


def tree_shape(name: str, options: Mapping[str, object]) -> TreeShape:
    """The trees drafter ``name`` with ``options`` (the factory's, defaults filled in) can build;
    unbounded when its registration declares no shape."""
    check_options(name, options)
    shape = DRAFTERS.trait(name, "shape")
    if shape is None:
        return TreeShape()
    defaults = {p.name: p.default for p in _options(name) if p.default is not p.empty}
    return shape(**{**defaults, **options})


def build(name: str, target: Target, **kwargs) -> DrafterBase:
    """Build a registered drafter for ``target``; kwargs (tree shapes, checkpoints) go to its
    factory, whose first parameter is always the target (some drafters read its weights)."""
    check_options(name, kwargs)
    check_kind(name, target.kind, f"a {type(target).__name__}")
    return DRAFTERS.get(name)(target, **kwargs)


TARGET_KINDS = {  # Target.kind -> the targets of that kind a user can choose
    "model": "a model target, a HeadTarget (target=smollm2, target=gemma3_270m or target=hf)",
    "synthetic": "target=synthetic (try experiment=synthetic)",
}


def check_kind(name: str, kind: str, target: str) -> None:
    """Refuse drafter ``name`` on a ``kind`` of target other than the one it registered it ``needs``."""
    require_kind(f"drafter {name!r}", DRAFTERS.trait(name, "needs"), kind, target)


def require_kind(who: str, needs: str | None, kind: str, target: str, purpose: str = "") -> None:
    """ValueError in one line when ``who`` (a registration declaring ``needs``, a Target.kind) is
    given ``target`` of another ``kind``."""
    if needs is not None and kind != needs:
        raise ValueError(f"{who} needs {TARGET_KINDS.get(needs, f'a {needs} target')}{purpose}; {target} is of kind {kind!r}")
