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
    "check_options", "names", "register",
]

_REGISTRY: dict[str, Callable[..., Drafter]] = {}


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


def register(name: str) -> Callable[[Callable[..., Drafter]], Callable[..., Drafter]]:
    def decorate(factory: Callable[..., Drafter]) -> Callable[..., Drafter]:
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise ValueError(f"drafter {name!r} is registered twice")
        _REGISTRY[name] = factory
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


def build(name: str, target, **kwargs) -> Drafter:
    """Build a registered drafter for ``target``; kwargs (tree shapes, checkpoints) go to its
    factory, whose first parameter is always the target (some drafters read its weights)."""
    check_options(name, kwargs)
    return _REGISTRY[name](target, **kwargs)
