"""The Drafter protocol and the registry that configs name drafters through.

Adding a drafter = one module here that calls ``register("name")`` on its factory, plus one YAML in
configs/drafter/. Nothing in the core or the verifiers dispatches on drafter names.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Callable, Mapping

from specdec.protocols import DraftContext, Drafter, VerifyResult
from specdec.tree import DraftTree, SiblingMode

__all__ = [
    "DraftContext", "DraftTree", "Drafter", "SiblingMode", "StatelessDrafter", "VerifyResult", "build",
    "check_options", "max_tree_nodes", "names", "register",
]

_REGISTRY: dict[str, Callable[..., Drafter]] = {}
# name: (depth, the factory's options) -> the most draft nodes a tree of that depth can hold
_CAPACITY: dict[str, Callable[..., int]] = {}


class StatelessDrafter:
    """Base for drafters that keep nothing per request between steps (everything they need is
    rebuilt from each DraftContext): starting, admitting, committing and dropping requests is free."""

    def reset(self, batch_size: int, max_length: int) -> None:
        pass

    def admit(self, count: int, max_length: int) -> None:
        pass

    def commit(self, tree: DraftTree, result: VerifyResult) -> None:
        pass

    def retain(self, rows) -> None:
        pass


def register(
    name: str, capacity: Callable[..., int] | None = None
) -> Callable[[Callable[..., Drafter]], Callable[..., Drafter]]:
    """``capacity(depth, **options)``, for tree drafters whose shape bounds their size (an EAGLE-2
    tree holds at most top_k nodes at depth 1 and top_k^2 below): the most draft nodes a tree of
    ``depth`` levels can hold with the factory's ``options``, which the tree-budget chooser caps
    its candidates at."""

    def decorate(factory: Callable[..., Drafter]) -> Callable[..., Drafter]:
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise ValueError(f"drafter {name!r} is registered twice")
        _REGISTRY[name] = factory
        if capacity is not None:
            _CAPACITY[name] = capacity
        return factory

    return decorate


def _import_all() -> None:
    import drafters

    for module in pkgutil.iter_modules(drafters.__path__):
        if module.name != "base" and not module.name.startswith("_"):
            importlib.import_module(f"drafters.{module.name}")


def names() -> list[str]:
    _import_all()
    return sorted(_REGISTRY)


def check_options(name: str, options: Mapping[str, object]) -> None:
    """Refuse options the drafter's factory does not take, by its signature: a typo in a drafter
    YAML or override fails before any model loads rather than when the drafter is built."""
    _import_all()
    if name not in _REGISTRY:
        raise ValueError(f"unknown drafter {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    parameters = list(inspect.signature(_REGISTRY[name]).parameters.values())[1:]  # after the target
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return
    known = [p.name for p in parameters]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"drafter {name!r} takes no option {', '.join(unknown)}; its options are {', '.join(known)}")


def max_tree_nodes(name: str, depth: int, options: Mapping[str, object]) -> int | None:
    """The most draft nodes drafter ``name`` with ``options`` (the factory's, defaults filled in)
    can put in a tree of ``depth`` levels; None when its registration declares no bound."""
    check_options(name, options)
    if name not in _CAPACITY:
        return None
    defaults = {
        p.name: p.default
        for p in list(inspect.signature(_REGISTRY[name]).parameters.values())[1:]
        if p.default is not p.empty
    }
    return _CAPACITY[name](**{**defaults, **options, "depth": depth})


def build(name: str, target, **kwargs) -> Drafter:
    """Build a registered drafter for ``target``; kwargs (tree shapes, checkpoints) go to its
    factory, whose first parameter is always the target (some drafters read its weights)."""
    check_options(name, kwargs)
    return _REGISTRY[name](target, **kwargs)
