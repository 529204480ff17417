"""One registry mechanism for every kind of component a config names: drafters, verifiers, targets,
workloads and metric sinks each keep a ``Registry``, and a config's ``name`` is looked up in it.

A component registers itself where it is defined (``@DRAFTERS.register("eagle3", ...)``); a
registry that owns a package imports that package's modules on its first lookup, so a new module
needs no list to be added to. Code outside the project's packages registers the same way once its
module is imported: ``specdec-run imports=[my_module]`` imports it before any name is looked up.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class Registry(Generic[F]):
    """Names -> factories of one ``kind`` (used in messages), each with the traits it registered."""

    def __init__(self, kind: str, package: str | None = None) -> None:
        self.kind = kind
        self.package = package  # its modules are imported on the first lookup
        self._factories: dict[str, F] = {}
        self._traits: dict[str, dict[str, Any]] = {}
        self._loaded = package is None

    def register(self, name: str, **traits: Any) -> Callable[[F], F]:
        def decorate(factory: F) -> F:
            if self._factories.get(name, factory) is not factory:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._factories[name] = factory
            self._traits[name] = traits
            return factory

        return decorate

    def _load(self) -> None:
        if not self._loaded:
            self._loaded = True
            package = importlib.import_module(self.package)
            for module in pkgutil.iter_modules(package.__path__):
                if not module.name.startswith("_"):
                    importlib.import_module(f"{self.package}.{module.name}")

    def names(self) -> list[str]:
        self._load()
        return sorted(self._factories)

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._factories

    def check(self, name: object) -> None:
        """Raise ValueError naming the choices when ``name`` is not registered."""
        if name not in self:
            raise ValueError(f"unknown {self.kind} {name!r}; choose one of {', '.join(self.names())}")

    def get(self, name: str) -> F:
        self.check(name)
        return self._factories[name]

    def trait(self, name: str, key: str, default: Any = None) -> Any:
        """What ``name`` declared as ``key`` when it registered (``default`` if nothing)."""
        self.check(name)
        return self._traits[name].get(key, default)


def import_modules(modules: Iterable[str]) -> None:
    """Import modules that register components of their own (``imports=[...]`` in a run config)."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise ValueError(
                f"imports: cannot import module {module!r} ({error}); put its folder on PYTHONPATH or install it"
            ) from error
