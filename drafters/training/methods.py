"""Training methods behind ``specdec-train``: one per drafter family, in the ``METHODS`` registry.

A method says which target layers it reads, builds its trainable model, data and loss from target
features, exports a checkpoint its drafter loads, and builds that drafter for the end-of-training
evaluation. The recipe (experiments/train), the trainer and the feature sources are shared; adding
a method is one module in drafters/training/ (named NAME_training.py by custom), registering a
factory in ``METHODS``, plus one YAML in configs/train/.

What a method can do is declared when it registers, not probed: ``online=True`` says it trains on
features the target computes while training runs (``HeadMethod.prepare_on``) as well as on cached
ones (without it the recipe refuses ``features=online`` for it in one line), and ``needs`` names the
kind of target (``Target.kind``) it reads features from, as a drafter's registration does.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from drafters.base import require_kind
from drafters.training.data import HeadData, head_data
from drafters.training.features import FeatureCache
from specdec.protocols import Drafter, HeadTarget
from specdec.registry import Registry

FEATURE_SOURCES = ("cached", "online")  # features extracted beforehand into a cache, or computed by the target as it trains


@dataclass(frozen=True)
class Prepared:
    model: nn.Module  # the trainable head: what checkpoints hold
    batches: Callable[[int], Iterator[Any]]  # step -> batches from that step on (seeded order)
    loss: Callable[[Any], tuple[Tensor, dict[str, float]]]
    num_tokens: int  # training tokens in the data (for tau-vs-tokens curves)
    num_sequences: int


class HeadMethod:
    """What every training method offers. ``prepare`` (cached features) is ``head_data`` then
    ``prepare_on``, the step a method registered with ``online=True`` shares with online features;
    a method that needs more of the cache (Medusa's held-out shard) overrides ``prepare`` and
    registers without ``online``."""

    name: str
    draft_vocab: int | None

    def feature_layers(self, target: HeadTarget) -> tuple[int, ...]:
        """Target layers it reads (HFTarget indices; L + 1 = final norm)."""
        raise NotImplementedError

    def draft_vocab_size(self, target: HeadTarget) -> int:
        """How many of the target's most frequent choices the head drafts from."""
        return int(self.draft_vocab or target.vocab_size)

    def counts_choices(self, head: nn.Module | None) -> bool:
        """Whether ``prepare_on`` reads a draft vocabulary picked from the data (``HeadData.draft_ids``)
        when it starts from ``head``; False spares online training the target's pass over the data
        that counts its choices (a whole-vocabulary head, or an init= head that brings its own)."""
        return True

    def prepare(self, target: HeadTarget, cache: FeatureCache, batch_size: int, seed: int, shards: list[int],
                head: nn.Module | None = None) -> Prepared:
        """``head``: a checkpoint loaded by ``load`` to train further (its architecture and draft
        vocabulary win over the method's settings, except settings that shape the data or the
        loss, which must agree: ``check_head``); None: a new head built for ``target``."""
        d = head_data(target, cache, self.feature_layers(target), batch_size, seed, shards, self.draft_vocab_size(target))
        return self.prepare_on(target, d, head)

    def prepare_on(self, target: HeadTarget, d: HeadData, head: nn.Module | None = None) -> Prepared:
        """As prepare, on the batches and draft vocabulary in ``d``: cached features (head_data) or
        features the target computes as training runs (drafters.training.online)."""
        raise NotImplementedError

    def load(self, target: HeadTarget, directory: Path) -> nn.Module:
        """A checkpoint this method exported, ready to train further (``specdec-train init=DIR``)."""
        raise NotImplementedError

    def export(self, model: nn.Module, directory: Path, extra: dict) -> None:
        """Write a checkpoint (safetensors + config JSON, atomically) that its drafter loads."""
        raise NotImplementedError

    def drafter(self, target: HeadTarget, model: nn.Module, depth: int) -> Drafter:
        """The drafter that uses ``model``, for the evaluation on held-out prompts."""
        raise NotImplementedError


def check_head(head: nn.Module, method: str, **settings: Any) -> None:
    """A loaded head's config must agree with the method's settings that decide which features
    are read and what is predicted; a mismatch would train it on the wrong data silently."""
    wrong = [f"{name}: checkpoint {getattr(head.config, name)!r}, settings {value!r}"
             for name, value in settings.items() if getattr(head.config, name) != value]
    if wrong:
        raise ValueError(f"init: the checkpoint does not match train={method}'s settings ({'; '.join(wrong)}); "
                         f"set those train.* options to the checkpoint's values")


# traits: online (bool) -- also trains on features computed while training runs (prepare_on);
# needs (a Target.kind) -- the kind of target whose features it reads
METHODS: Registry[Callable[..., HeadMethod]] = Registry("training method", "drafters.training")


def check_feature_source(name: str, features: str) -> None:
    """ValueError in one line when training method ``name`` cannot train on ``features``."""
    if features not in FEATURE_SOURCES:
        raise ValueError(f"features={features!r}: choose one of {', '.join(FEATURE_SOURCES)}")
    if features == "online" and not METHODS.trait(name, "online", False):
        online = ", ".join(n for n in METHODS.names() if METHODS.trait(n, "online", False))
        raise ValueError(f"train={name} trains on cached features only (it registered without online=True); "
                         f"use features=cached, or one of {online} for features=online")


def check_target_kind(name: str, kind: str, target: str) -> None:
    """ValueError in one line when training method ``name`` cannot read features from a ``kind`` target."""
    require_kind(f"train={name}", METHODS.trait(name, "needs"), kind, target, " to read features from")


def build_method(options: dict[str, Any]) -> HeadMethod:
    """``options`` is the ``train`` config node: its ``name`` picks the method, the rest are the
    method's own settings (an unknown key is an error that lists the known ones)."""
    options = dict(options)
    name = options.pop("name", None)
    if name not in METHODS:
        raise ValueError(f"train={name!r}: unknown training method; available: {', '.join(METHODS.names())}")
    factory = METHODS.get(name)
    parameters = inspect.signature(factory).parameters
    known = set(parameters) - {"name"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"train={name}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return factory(name=name, **options) if "name" in parameters else factory(**options)
