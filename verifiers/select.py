"""Pick a verifier by name: ``auto``, ``reference``, ``triton``, ``block`` (chains only) or
``traversal`` (chains, deterministic trees and sampled trees of a static shape), all exact, or
``typical_lossy`` (Medusa's typical acceptance, LOSSY: opt-in by name only, never chosen by
``auto``).

Nothing here imports triton until the Triton verifier is actually chosen, so CPU-only installs
never touch it.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from specdec.protocols import Verifier

CHOICES = ("auto", "reference", "triton", "block", "traversal", "typical_lossy")


def select_verifier(name: str, **options) -> Verifier:
    """``auto`` = the Triton kernel when a CUDA device is present and triton is installed, else the
    reference; ``triton`` insists on the kernel (on CPU only under the Triton interpreter).
    ``options`` are the settings of ``typical_lossy`` (epsilon, delta, sample_first); the exact
    verifiers have none."""
    if options and name != "typical_lossy":
        raise ValueError(f"verifier {name!r} takes no options; got {', '.join(sorted(options))}")
    if name == "reference":
        from verifiers.reference import verify

        return verify
    if name == "auto":
        if torch.cuda.is_available():
            try:
                from verifiers.triton_tree import verify
            except ImportError:  # no (working) triton: the reference is exact too, only slower
                return select_verifier("reference")
            return verify
        return select_verifier("reference")
    if name == "triton":
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
    if name == "block":
        from verifiers.block import verify

        return verify
    if name == "traversal":
        from verifiers.traversal import verify

        return verify
    if name == "typical_lossy":
        from verifiers.lossy import TypicalAcceptanceLossy

        return TypicalAcceptanceLossy(**options)
    raise ValueError(f"unknown verifier {name!r}; choose one of {', '.join(CHOICES)}")
