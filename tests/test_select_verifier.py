"""verifier=auto: the Triton kernel only when it builds and agrees with the reference, else the
reference with a warning saying why; decided once per device. conftest.py sets TRITON_INTERPRET=1,
so here the kernel runs (interpreted) on CPU tensors."""

from __future__ import annotations

import dataclasses
import re
import sys
import warnings

import pytest
import torch

from verifiers import reference, select, triton_tree
from verifiers.select import select_verifier

FALLBACK = "using the exact reference verifier instead"


@pytest.fixture
def cuda(monkeypatch):
    """A machine that claims a CUDA device, with auto's per-process choice forgotten."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(select, "_AUTO", {}, raising=False)


def counting(verify, calls: list):
    def wrapped(*args, **kwargs):
        calls.append(1)
        return verify(*args, **kwargs)

    return wrapped


def test_a_working_kernel_is_chosen_without_a_warning(cuda):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # auto's fallback warning
        assert select_verifier("auto") is triton_tree.verify


def test_the_kernel_is_launched_before_it_is_chosen_and_only_once(cuda, monkeypatch):
    calls = []
    kernel = counting(triton_tree.verify, calls)
    monkeypatch.setattr(triton_tree, "verify", kernel)
    assert select_verifier("auto") is kernel
    assert calls, "auto chose the kernel without launching it"
    launches = len(calls)
    assert select_verifier("auto") is kernel
    assert len(calls) == launches  # cached: no second warm-up


def test_the_warm_up_builds_the_split_and_the_walk_variants_of_every_case(cuda, monkeypatch):
    splits, real = [], triton_tree.verify

    def recording(*args, split=None, **kwargs):
        splits.append(split)
        return real(*args, split=split, **kwargs)

    monkeypatch.setattr(triton_tree, "verify", recording)
    assert select_verifier("auto") is recording
    cases = len(list(select.warm_up_cases(torch.device("cpu"))))
    assert splits == [False, True] * cases


def test_a_failed_import_falls_back_with_a_warning(cuda, monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers.triton_tree", None)  # importing it raises
    with pytest.warns(RuntimeWarning, match=rf"could not be set up \(ModuleNotFoundError: .*\); {FALLBACK}"):
        assert select_verifier("auto") is reference.verify


def test_a_broken_cuda_runtime_falls_back_with_a_warning(cuda, monkeypatch):
    def broken():
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(triton_tree, "_INTERPRETED", False)  # a compiled kernel, for the device
    monkeypatch.setattr(torch.cuda, "current_device", broken)
    message = re.escape(f"could not be set up (RuntimeError: CUDA driver initialization failed); {FALLBACK}")
    with pytest.warns(RuntimeWarning, match=message):
        assert select_verifier("auto") is reference.verify


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a real device the launch succeeds")
def test_a_launch_on_an_unusable_device_falls_back_with_a_warning(cuda, monkeypatch):
    monkeypatch.setattr(triton_tree, "_INTERPRETED", False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.warns(RuntimeWarning, match=rf"could not be built or run on cuda:0 \(.+\); {FALLBACK}"):
        assert select_verifier("auto") is reference.verify


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("PTXAS error: ptxas fatal: Value 'sm_200' is not defined for option 'gpu-name'"),
        OSError("libcuda.so cannot found"),
        AssertionError("Torch not compiled with CUDA enabled"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_a_failing_first_launch_falls_back_with_a_warning(cuda, monkeypatch, error):
    """A compile or driver failure shows only when the kernel is first launched."""

    def broken(*args, **kwargs):
        raise error

    monkeypatch.setattr(triton_tree, "verify", broken)
    device = "cpu" if triton_tree._INTERPRETED else f"cuda:{torch.cuda.current_device()}"  # as auto picks it
    message = re.escape(f"could not be built or run on {device} ({type(error).__name__}: {error}); {FALLBACK}")
    with pytest.warns(RuntimeWarning, match=message):
        assert select_verifier("auto") is reference.verify
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # decided once: no second attempt, no second warning
        assert select_verifier("auto") is reference.verify


def test_a_kernel_that_disagrees_with_the_reference_falls_back_with_a_warning(cuda, monkeypatch):
    real = triton_tree.verify

    def off_by_one(*args, **kwargs):
        result = real(*args, **kwargs)
        return dataclasses.replace(result, next_token=result.next_token + 1)

    monkeypatch.setattr(triton_tree, "verify", off_by_one)
    with pytest.warns(RuntimeWarning, match=rf"disagrees with the reference.*next_token.*{FALLBACK}"):
        assert select_verifier("auto") is reference.verify


def test_without_cuda_auto_is_the_reference_and_never_touches_triton(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(select, "_AUTO", {}, raising=False)
    monkeypatch.setitem(sys.modules, "verifiers.triton_tree", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # auto's fallback warning
        assert select_verifier("auto") is reference.verify


def test_auto_gives_a_target_on_the_cpu_the_reference_whatever_the_machine_has(cuda, monkeypatch):
    """specdec-run passes the target's device: on a GPU machine a CPU target's logits never reach
    the kernel, which reads CUDA tensors only."""
    monkeypatch.setattr(select, "_checked", lambda *args: pytest.fail("the kernel was built for a CPU target"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # auto's fallback warning
        assert select_verifier("auto", torch.device("cpu")) is reference.verify


def test_triton_for_a_target_on_the_cpu_is_refused_outside_the_interpreter(cuda, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="runs on CUDA tensors and the target is on cpu; use target.device=cuda"):
        select_verifier("triton", torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the tests' interpreter runs it on CPU tensors
    assert select_verifier("triton", torch.device("cpu")) is triton_tree.verify
