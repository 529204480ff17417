"""Every variant of the Triton verifier's kernels compiled to a cubin for sm_90 with the ptxas that
ships with Triton: the interpreter runs Python, so it misses what only the compiler rejects (a
loop-carried value changing type, say). No GPU needed; slow (40-90 s on a fresh Triton cache), so
CI runs it after the default suite, and scripts/gpu_check.sh with the rest of its files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

COMPILE_FOR_H100 = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from verifiers.triton_rows import _tile_best_kernel, _tile_mass_kernel
from verifiers.triton_tree import _verify_tree_kernel as kernel

def build(fn, types, constants):
    signature = dict(zip(fn.arg_names, types + ["constexpr"] * len(constants)))
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constants)
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "enable_fp_fusion": False})

# (logits, draft probabilities, greedy, deterministic, without replacement, hashed noise, split):
# greedy's and DETERMINISTIC's unused pointers are empty float64 tensors, and so is tile_best
# without the split
variants = []
for logits_type, draft_type, greedy, deterministic, without_replacement, hashed, split in [
    ("*bf16", "*fp64", True, True, False, False, False), ("*bf16", "*fp64", False, True, False, True, False),
    ("*fp32", "*fp32", False, False, False, True, False), ("*bf16", "*bf16", False, False, True, True, False),
    ("*fp32", "*fp32", False, False, False, False, False), ("*bf16", "*fp64", True, True, False, False, True),
    ("*bf16", "*bf16", False, False, True, True, True),
]:
    thresholds = ["*fp64"] * 2 if greedy else ["*fp32"] * 2
    tiles = ["*fp32" if split else "*fp64", "*i64", "*fp64"]
    types = [logits_type, *thresholds, *tiles, "fp32", draft_type] + ["*i64"] * 3 + ["*fp64"] * 2 + ["*i64"] * 2
    types += ["*fp64"] * 2 + ["*i64"] * 3 + ["i32", "i32"]
    variants.append((kernel, types, {"GREEDY": greedy, "HASHED": hashed, "DETERMINISTIC": deterministic,
                                     "WITHOUT_REPLACEMENT": without_replacement, "SPLIT": split, "BLOCK_V": 2048,
                                     "NUM_TILES": 128}))  # V = 151,936
# the split pre-pass (verifiers/triton_rows.py): greedy writes tile_first, T > 0 tile_mass next
for logits_type in ("*bf16", "*fp32"):
    for greedy in (True, False):
        variants.append((_tile_best_kernel, [logits_type, "fp32", "*fp32", "*i64" if greedy else "*fp64", "i32"],
                         {"GREEDY": greedy, "BLOCK_V": 2048, "NUM_TILES": 128}))
    variants.append((_tile_mass_kernel, [logits_type, "*fp32", "*fp32", "fp32", "*fp32", "*fp64", "i32"],
                     {"BLOCK_V": 2048, "NUM_TILES": 128}))
part, parts = int(sys.argv[1]), int(sys.argv[2])
for variant in variants[part::parts]:
    build(*variant)
"""


@pytest.mark.slow
def test_kernel_compiles_for_a_gpu():
    """In two processes at once, each compile being single-threaded."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this triton has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    parts = [subprocess.Popen([sys.executable, "-c", COMPILE_FOR_H100, str(part), "2"], env=env,
                              stderr=subprocess.PIPE, text=True) for part in range(2)]
    for process in parts:
        _, errors = process.communicate()
        assert process.returncode == 0, errors
