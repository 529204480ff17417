import os

# Before anything imports triton or the hubs: the Triton interpreter runs kernels on CPU tensors,
# and offline hubs fail fast instead of waiting ~23 s for a lookup.
if not os.environ.get("SPECDEC_TRITON_GPU"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The default run splits the fast tier over two pytest-xdist workers (pyproject.toml's addopts): each
# takes one core, and so do the commands its tests start, which inherit this
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

# 2 threads suit the 2-core CI machine; OMP_NUM_THREADS=1 keeps a test run from crowding out
# another job (two 2-thread torch processes on 2 cores run ~10x slower)
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_TIMED: dict[tuple, object] = {}


@pytest.fixture(autouse=True)
def _each_models_kernels_timed_once(request, monkeypatch):
    """HFTarget(packed_gemm_from="auto") times its linears' kernels when it loads; the tests load the
    same few models many times, so each set of linear shapes is timed once per session (a real
    timing, kept). test_cpu_kernels tests that timing itself, so it times every call."""
    if request.module.__name__ == "test_cpu_kernels":
        return
    from collections import Counter

    from specdec import target

    timed = target.fastest_packed_from

    def once(model, *args, **kwargs):
        shapes = Counter((m.in_features, m.out_features) for m in model.modules() if type(m) is torch.nn.Linear)
        key = (tuple(sorted(shapes.items())), next(model.parameters()).dtype, args, tuple(sorted(kwargs.items())))
        if key not in _TIMED:
            _TIMED[key] = timed(model, *args, **kwargs)
        return _TIMED[key]

    monkeypatch.setattr(target, "fastest_packed_from", once)
