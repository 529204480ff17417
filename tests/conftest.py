import os

# Before anything imports triton or the hubs: the Triton interpreter runs kernels on CPU tensors,
# and offline hubs fail fast instead of waiting ~23 s for a lookup.
if not os.environ.get("SPECDEC_TRITON_GPU"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

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
