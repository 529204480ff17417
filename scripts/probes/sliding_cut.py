"""Probe: what the sliding-window cut saves. Gemma 3 270M, a 3,800-token random prompt, a plain
step's forward with the sliding layers' masks cut to their window and uncut (median of 20 each).

    python -m scripts.probes.sliding_cut

Untested; figures in docs/NOTES.md ("Which Hugging Face families HFTarget serves").
"""
import time
import torch
from specdec import packaged_models, cpu_kernels
from specdec.target import HFTarget
from specdec.tree import empty_tree
torch.set_num_threads(2)
model, tok = packaged_models.load_packaged("gemma3_270m", torch.float32)
target = HFTarget(model, packed_gemm_from="auto", key="gemma3_270m")
print("cut", target._cut_window, model.config._attn_implementation, target._window)
p = torch.randint(0, 1000, (3800,))
target.prefill([p], ())
reads = []
orig = cpu_kernels.keys_under_mask
def spy(m, k, v):
    reads.append((None if m is None else m.shape[-1], k.shape[2])); return orig(m, k, v)
cpu_kernels.keys_under_mask = spy
target.forward_tree(empty_tree(1), ()); print(reads[:3], len(reads))
for cut in (True, False):
    target._cut_window = cut
    ts = []
    for _ in range(20):
        t = time.perf_counter(); target.forward_tree(empty_tree(1), ()); ts.append(time.perf_counter() - t)
    print(cut, f"median {1000*sorted(ts)[10]:.1f} ms")
