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
