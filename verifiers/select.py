"""Verifiers by name: ``auto``, ``reference``, ``triton``, ``block`` (chains only) and ``traversal``
(chains, deterministic trees and sampled trees of a static shape), all exact, and ``typical_lossy``
(Medusa's typical acceptance, LOSSY: opt-in by name only, never chosen by ``auto``).

Each entry is a function that returns its verifier when chosen; the Triton kernel's entries import
it only then, so CPU-only installs never touch triton. A new verifier registers one more here, plus
configs/verifier/NAME.yaml.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import warnings
from collections.abc import Callable, Iterator

import torch

from specdec.noise import RequestRNG, VerifyNoise
from specdec.protocols import Verifier, VerifyResult
from specdec.registry import Registry
from specdec.sampling import SamplingParams
from specdec.tree import DraftTree, SiblingMode
import verifiers.block
import verifiers.lossy
import verifiers.reference
import verifiers.traversal

VERIFIERS: Registry[Callable[..., Verifier]] = Registry("verifier")


def select_verifier(name: str, device: torch.device | None = None, **options) -> Verifier:
    """``device``: where the target's logits will be (None: wherever the kernel can run), for the
    verifiers that depend on it (``auto`` and ``triton``: the kernel runs on CUDA tensors).
    ``options`` are the settings of ``typical_lossy`` (epsilon, delta, sample_first); the exact
    verifiers have none."""
    factory = VERIFIERS.get(name)
    if options and not VERIFIERS.trait(name, "options", False):
        raise ValueError(f"verifier {name!r} takes no options; got {', '.join(sorted(options))}")
    if VERIFIERS.trait(name, "device", False):
        options["device"] = device
    return factory(**options)


@VERIFIERS.register("reference")
def _reference() -> Verifier:
    return verifiers.reference.verify


# the choice auto made, per device: building and checking the kernel happens once per process
_AUTO: dict[str, Verifier] = {}


@VERIFIERS.register("auto", device=True)
def _auto(device: torch.device | None = None) -> Verifier:
    """The Triton kernel when a CUDA device is present and the kernel builds there and agrees with the
    reference on tiny trees, else the reference (exact too, only slower), with a warning saying why.
    A target on the CPU (``device``) gets the reference, whatever the machine has."""
    if not torch.cuda.is_available() or (device is not None and device.type != "cuda"):
        return _reference()
    try:
        import verifiers.triton_tree as triton_tree  # imports triton: optional, and only where it can run

        # an interpreted kernel (TRITON_INTERPRET=1 when triton was imported: tests) runs on CPU tensors
        device = torch.device("cpu") if triton_tree._INTERPRETED else torch.device("cuda", torch.cuda.current_device())
    except Exception as error:  # no (working) triton or CUDA runtime
        reason = f"could not be set up ({type(error).__name__}: {error})"
        return _remember("cuda", lambda: _fall_back(reason))
    return _remember(str(device), lambda: _checked(triton_tree.verify, device))


def _remember(key: str, choose: Callable[[], Verifier]) -> Verifier:
    if key not in _AUTO:
        _AUTO[key] = choose()
    return _AUTO[key]


def _checked(kernel: Verifier, device: torch.device) -> Verifier:
    """The kernel, once it has run: a failed compile (or a driver error) only shows at the first
    launch, which would otherwise come in the middle of a run instead of a fallback here."""
    try:
        mismatch = _warm_up(kernel, _reference(), device)
    except Exception as error:  # any failure to build or run it: the reference is exact too
        return _fall_back(f"could not be built or run on {device} ({type(error).__name__}: {error})")
    if mismatch is not None:
        return _fall_back(f"disagrees with the reference on {device}: {mismatch}")
    return kernel


def _fall_back(reason: str) -> Verifier:
    warnings.warn(
        f"verifier=auto: the Triton verifier kernel {reason}; using the exact reference verifier instead "
        "(same results, slower)",
        RuntimeWarning,
        stacklevel=2,
    )
    return _reference()


def _warm_up(kernel: Verifier, reference: Verifier, device: torch.device) -> str | None:
    """Run the kernel on a tiny tree per sibling mode, each with the rows' statistics split across
    blocks and without (each compiles its own specialisations: a run may take either, by its
    batch and tree size); the first disagreement with the reference, or None."""
    for tree, target_logits, sampling, noise in warm_up_cases(device):
        want = reference(tree, target_logits, sampling, noise)
        for split in (False, True):
            got = kernel(tree, target_logits, sampling, noise, split=split)
            for field in (f.name for f in dataclasses.fields(VerifyResult)):
                g, w = getattr(got, field).cpu(), getattr(want, field).cpu()
                if not torch.equal(g, w):
                    return (f"on a tiny {tree.mode.value} tree at T = {sampling.temperature:g} "
                            f"({'split' if split else 'walk'} statistics) its {field} is {g.tolist()} "
                            f"where the reference's is {w.tolist()}")
    return None


def warm_up_cases(device: torch.device) -> Iterator[tuple]:
    """(tree, target_logits, sampling, noise): every sibling mode at T = 1 and T = 0 (greedy has a
    variant of its own), each on float32 and bfloat16 logits (the kernel reads them as they come),
    with noise hashed, as a run's is, so the variants compiled are the ones runs use. Node 0's
    token is likely under q but not under p, and seed 0's first coin rejects it
    (tests/test_triton_verifier.py checks), so the residual is rewritten."""
    p = torch.tensor([0.05, 0.05, 0.5, 0.1, 0.1, 0.1, 0.05, 0.05], dtype=torch.float64)  # [V]
    q = torch.tensor([0.05, 0.6, 0.1, 0.05, 0.05, 0.05, 0.05, 0.05])  # [V]
    target_logits = p.log().float().expand(1, 4, -1).to(device)  # [B=1, N+1=4, V]
    tokens = torch.tensor([[1, 2, 3]], device=device)  # [B, N]: two siblings, one grandchild
    parents = torch.tensor([[-1, -1, 0]], device=device)  # [B, N]
    noise = VerifyNoise.draw(RequestRNG(torch.zeros(1, dtype=torch.int64, device=device)), 3)
    for mode in SiblingMode:
        draft_probs = None if mode is SiblingMode.DETERMINISTIC else q.expand(1, 3, -1).to(device)  # [B, N, V]
        tree = DraftTree(tokens, parents, draft_probs, torch.tensor([3], device=device), mode)
        for logits in (target_logits, target_logits.bfloat16()):
            for sampling in (SamplingParams(1.0), SamplingParams(0.0)):
                yield tree, logits, sampling, noise


@VERIFIERS.register("triton", device=True)
def _triton(device: torch.device | None = None) -> Verifier:
    """Insists on the kernel (on CPU only under the Triton interpreter)."""
    if importlib.util.find_spec("triton") is None:
        raise RuntimeError(
            "verifier 'triton' needs the triton package: pip install 'specdec[triton]' "
            "(or choose verifier=reference / verifier=auto)"
        )
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if not torch.cuda.is_available() and not interpreted:
        raise RuntimeError(
            "verifier 'triton' needs a CUDA device; without one choose verifier=reference "
            "(or verifier=auto), or set TRITON_INTERPRET=1 before triton is imported to run the "
            "kernel in the Triton interpreter on CPU (slow: for tests)"
        )
    if device is not None and device.type != "cuda" and not interpreted:
        raise RuntimeError(
            f"verifier 'triton' runs on CUDA tensors and the target is on {device}; use target.device=cuda, or "
            f"verifier=reference (or auto) for a target on the CPU"
        )
    from verifiers.triton_tree import verify  # imports triton: optional, and only where it can run

    return verify


@VERIFIERS.register("block")
def _block() -> Verifier:
    return verifiers.block.verify


@VERIFIERS.register("traversal")
def _traversal() -> Verifier:
    return verifiers.traversal.verify


@VERIFIERS.register("typical_lossy", options=True)
def _typical_lossy(**options) -> Verifier:
    return verifiers.lossy.TypicalAcceptanceLossy(**options)
