"""The core, the drafters and the verifiers never import the experiment edge's libraries."""

from __future__ import annotations

import json
import subprocess
import sys

EDGE_LIBRARIES = ("hydra", "omegaconf", "wandb", "matplotlib")

# every module of the three packages, so an import buried in a submodule is caught too
PROBE = """
import importlib, json, pkgutil, sys
import drafters, specdec, verifiers
for package in (specdec, drafters, verifiers):
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(module.name)
print(json.dumps(sorted(name for name in sys.modules if name.split(".")[0] in %r)))
""" % (EDGE_LIBRARIES,)


def test_core_drafters_and_verifiers_import_no_hydra_omegaconf_wandb_or_matplotlib():
    # a fresh interpreter: this test process has imported hydra & co. through other tests
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


# the README's layout: these need torch (and scipy, for the intervals) only; the Hugging Face
# backend (target, kv_cache, cpu_kernels, assets, target_loader) sits beside them
LOOP_MODULES = ("decode", "protocols", "tree", "sampling", "noise", "metrics", "intervals", "speedup", "registry",
                "synthetic")
HF_LIBRARIES = ("transformers", "datasets", "gguf", "safetensors", "accelerate")


def test_the_loop_modules_import_no_hugging_face_library():
    probe = (
        "import importlib, json, sys\n"
        f"for name in {LOOP_MODULES!r}:\n"
        "    importlib.import_module('specdec.' + name)\n"
        f"print(json.dumps(sorted(n for n in sys.modules if n.split('.')[0] in {HF_LIBRARIES!r})))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
