"""The synthetic workload and the Triton verifier's test cases keep every tensor on the data's device.

A tensor made without ``device=`` lands on the default device, the CPU; on a GPU run it then meets
CUDA tensors and raises, a bug no CPU-only run sees. So the CPU runs here play that GPU run: while
the data lives on "cpu", ``StraysOnMeta`` puts tensors made without a device on "meta" and raises
wherever one meets a CPU tensor, as CUDA does. With a CUDA device the same paths also run on it
for real.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from sequence_stats import ALPHA, sequence_verdict
from test_triton_verifier import DEVICE, LOOP_CASES, ULP_BLOCK_V, X1, X2, CheckedTriton, assert_same, one_ulp_case
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from drafters.synthetic import SyntheticDrafter
from specdec.decode import SpecDecoder
from specdec.synthetic import SyntheticTarget
from specdec.tree import SiblingMode
from verifiers import reference

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# the usual factories among those torch.set_default_device redirects (torch.utils._device)
CONSTRUCTORS = {
    torch.arange, torch.as_tensor, torch.asarray, torch.empty, torch.eye, torch.full, torch.linspace,
    torch.ones, torch.rand, torch.randint, torch.randn, torch.randperm, torch.scalar_tensor, torch.tensor,
    torch.zeros,
}


class StraysOnMeta(TorchFunctionMode):
    """torch.set_default_device("meta"), plus a device check on every torch call: some CPU kernels
    (scatter_, indexing) read a meta argument's missing data without complaint, where CUDA would
    raise. as_tensor / asarray of a tensor keep its device, as on a GPU run (decode.check_prompts
    converts each prompt so)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        converts = func in (torch.as_tensor, torch.asarray) and isinstance(args[0], torch.Tensor)
        if func in CONSTRUCTORS and kwargs.get("device") is None and not converts:
            kwargs["device"] = "meta"
        tensors = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        if len({t.is_meta for t in tensors}) > 1:
            raise RuntimeError(f"{getattr(func, '__name__', func)}: a tensor made without device= meets the data")
        return func(*args, **kwargs)


def guarded(device: str):
    # on an accelerator the default device, the CPU, is already somewhere else
    return StraysOnMeta() if device == "cpu" else contextlib.nullcontext()


@pytest.mark.parametrize(
    "mix",
    [
        lambda data: data + torch.arange(4),
        lambda data: data.clone().scatter_(0, data, torch.arange(4)),  # the CPU kernel alone accepts this
        lambda data: data[torch.arange(4)],
    ],
    ids=["add", "scatter_", "index"],
)
def test_the_guard_catches_a_tensor_made_without_a_device(mix):
    data = torch.arange(4, device="cpu")  # [4]
    with StraysOnMeta(), pytest.raises(RuntimeError, match="without device="):
        mix(data)
    assert mix(data).device.type == "cpu", "the guard must not outlive its block"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", LOOP_CASES)
def test_sequence_distribution_and_decode_loop(device, case):
    """sequence_distribution, the whole loop through the verifier (the Triton kernel, checked against
    the reference, where the kernel runs on this device), and sequence_verdict's statistics."""
    branching, mode, sampling = LOOP_CASES[case]
    vocab, length = 4, 2
    verifier = CheckedTriton() if device == DEVICE else reference.verify
    with guarded(device):
        target = SyntheticTarget(vocab_size=vocab, sharpness=1.5, device=device)
        exact = target.sequence_distribution([1, 2], length, sampling)  # [V ** L]
        decoder = SpecDecoder(target, SyntheticDrafter(target, branching, mode, 0.5), verifier)
        # not a list: check_prompts turns a list into a tensor without a device and moves it later,
        # right on a GPU, but on meta that tensor has no values to move
        prompt = torch.tensor([1, 2], device=device)  # [P]
        verdict = sequence_verdict(decoder, exact, prompt, length, vocab, sampling, samples=32, seed=1)
    assert exact.device.type == device and abs(exact.sum().item() - 1) < 1e-6  # float32 probabilities
    assert verdict.impossible == 0 and verdict.p_value > ALPHA, verdict


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", SiblingMode, ids=lambda m: m.name)
def test_one_ulp_case(device, mode):
    with guarded(device):
        tree, target_logits, noise, sampling, _ = one_ulp_case(mode, [X1, X2], device)
        if device == DEVICE:
            result = assert_same(tree, target_logits, sampling, noise, ULP_BLOCK_V)
        else:
            result = reference.verify(tree, target_logits, sampling, noise)
    assert target_logits.device.type == device and noise.final.device.type == device
    assert result.accepted_nodes[:, 0].tolist() == [-1, 1]
