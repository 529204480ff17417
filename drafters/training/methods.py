"""Training methods behind ``specdec-train``: one per drafter family, registered by name.

A method says which cached target layers it reads, builds its trainable model, data and loss from a
feature cache, exports a checkpoint its drafter loads, and builds that drafter for the
end-of-training evaluation. The trainer, the feature cache and the CLI are shared; adding a method
is one module in drafters/training/ calling ``register_method`` plus one YAML in configs/train/.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from torch import Tensor, nn

from drafters.training.features import FeatureCache
from specdec.protocols import Drafter


@dataclass(frozen=True)
class Prepared:
    model: nn.Module  # the trainable head: what checkpoints hold
    batches: Callable[[int], Iterator[Any]]  # step -> batches from that step on (seeded order)
    loss: Callable[[Any], tuple[Tensor, dict[str, float]]]
    num_tokens: int  # training tokens in the data (for tau-vs-tokens curves)
    num_sequences: int


class TrainMethod(Protocol):
    def feature_layers(self, target) -> tuple[int, ...]:
        """Target layers it reads from the feature cache (HFTarget indices; L + 1 = final norm)."""
        ...

    def prepare(self, target, cache: FeatureCache, batch_size: int, seed: int, shards: list[int],
                head: nn.Module | None = None) -> Prepared:
        """``head``: a checkpoint loaded by ``load`` to train further (its architecture and draft
        vocabulary win over the method's settings, except settings that shape the data or the
        loss, which must agree: ``check_head``); None: a new head built for ``target``."""
        ...

    def load(self, target, directory: Path) -> nn.Module:
        """A checkpoint this method exported, ready to train further (``specdec-train init=DIR``)."""
        ...

    def export(self, model: nn.Module, directory: Path, extra: dict) -> None:
        """Write a checkpoint (safetensors + config JSON, atomically) that its drafter loads."""
        ...

    def drafter(self, target, model: nn.Module, depth: int) -> Drafter:
        """The drafter that uses ``model``, for the evaluation on held-out prompts."""
        ...


def check_head(head: nn.Module, method: str, **settings: Any) -> None:
    """A loaded head's config must agree with the method's settings that decide which features
    are read and what is predicted; a mismatch would train it on the wrong data silently."""
    wrong = [f"{name}: checkpoint {getattr(head.config, name)!r}, settings {value!r}"
             for name, value in settings.items() if getattr(head.config, name) != value]
    if wrong:
        raise ValueError(f"init: the checkpoint does not match train={method}'s settings ({'; '.join(wrong)}); "
                         f"set those train.* options to the checkpoint's values")


_METHODS: dict[str, Callable[..., TrainMethod]] = {}


def register_method(*names: str) -> Callable:
    def decorate(factory: Callable[..., TrainMethod]) -> Callable[..., TrainMethod]:
        for name in names:
            _METHODS[name] = factory
        return factory

    return decorate


def build_method(options: dict[str, Any]) -> TrainMethod:
    """``options`` is the ``train`` config node: its ``name`` picks the method, the rest are the
    method's own settings (an unknown key is an error that lists the known ones)."""
    import drafters.training

    for module in pkgutil.iter_modules(drafters.training.__path__):
        if module.name.endswith("_training"):
            importlib.import_module(f"drafters.training.{module.name}")
    options = dict(options)
    name = options.pop("name", None)
    if name not in _METHODS:
        raise ValueError(f"train={name!r}: unknown training method; available: {', '.join(sorted(_METHODS))}")
    factory = _METHODS[name]
    known = set(inspect.signature(factory).parameters) - {"name"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"train={name}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    parameters = inspect.signature(factory).parameters
    return factory(name=name, **options) if "name" in parameters else factory(**options)
