"""Verifiers by name: ``auto``, ``reference``, ``triton``, ``block`` (chains only) and ``traversal``
(chains, deterministic trees and sampled trees of a static shape), all exact, and ``typical_lossy``
(Medusa's typical acceptance, LOSSY: opt-in by name only, never chosen by ``auto``).

Each entry is a function that imports its verifier when chosen, so CPU-only installs never touch
triton. A new verifier registers one more here, plus configs/verifier/NAME.yaml.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

import torch

from specdec.protocols import Verifier
from specdec.registry import Registry

VERIFIERS: Registry[Callable[..., Verifier]] = Registry("verifier")


def select_verifier(name: str, **options) -> Verifier:
    """``options`` are the settings of ``typical_lossy`` (epsilon, delta, sample_first); the exact
    verifiers have none."""
    factory = VERIFIERS.get(name)
    if options and not VERIFIERS.trait(name, "options", False):
        raise ValueError(f"verifier {name!r} takes no options; got {', '.join(sorted(options))}")
    return factory(**options)


@VERIFIERS.register("reference")
def _reference() -> Verifier:
    from verifiers.reference import verify

    return verify


@VERIFIERS.register("auto")
def _auto() -> Verifier:
    """The Triton kernel when a CUDA device is present and triton is installed, else the reference."""
    if torch.cuda.is_available():
        try:
            from verifiers.triton_tree import verify
        except ImportError:  # no (working) triton: the reference is exact too, only slower
            return _reference()
        return verify
    return _reference()


@VERIFIERS.register("triton")
def _triton() -> Verifier:
    """Insists on the kernel (on CPU only under the Triton interpreter)."""
    if importlib.util.find_spec("triton") is None:
        raise RuntimeError(
            "verifier 'triton' needs the triton package: pip install 'specdec[triton]' "
            "(or choose verifier=reference / verifier=auto)"
        )
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "verifier 'triton' needs a CUDA device; without one choose verifier=reference "
            "(or verifier=auto), or set TRITON_INTERPRET=1 before triton is imported to run the "
            "kernel in the Triton interpreter on CPU (slow: for tests)"
        )
    from verifiers.triton_tree import verify

    return verify


@VERIFIERS.register("block")
def _block() -> Verifier:
    from verifiers.block import verify

    return verify


@VERIFIERS.register("traversal")
def _traversal() -> Verifier:
    from verifiers.traversal import verify

    return verify


@VERIFIERS.register("typical_lossy", options=True)
def _typical_lossy(**options) -> Verifier:
    from verifiers.lossy import TypicalAcceptanceLossy

    return TypicalAcceptanceLossy(**options)
