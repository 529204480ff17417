"""Probe: what does the prefill's explicit mask cost? One long_context prompt (the second) through
SmolLM2's forward twice under HFTarget's old W x W additive mask and twice with no mask (the model
masking causally), then whether the two give the same logits and cache bits.

    python -m scripts.probes.long_prefill_mask

Untested (scripts/probes/ is not part of the package); its figures are in docs/RESULTS.md, "The
`--standard` grid".
"""
import time
import torch
from transformers import DynamicCache
from experiments.common import prompt_sets
from experiments.common.long_context import load_long_context
from specdec import packaged_models
from specdec.target import HFTarget, _additive
torch.set_num_threads(2)
model, tok = packaged_models.load_smollm2(torch.float32)
target = HFTarget(model, packed_gemm_from="auto", key="smollm2")
p = torch.tensor(prompt_sets.encode_prompt(tok, load_long_context(2)[1]))
ids = p[None, :-1]; W = ids.shape[1]
cols = torch.arange(W)
vis = (cols[:, None] >= cols[None, :])[None]
def run(mask, label):
    for _ in range(2):
        t = time.perf_counter()
        with torch.no_grad():
            out = model(input_ids=ids, position_ids=cols[None], attention_mask=mask, use_cache=True, logits_to_keep=1, past_key_values=DynamicCache())
        print(label, W, f"{time.perf_counter()-t:.2f}s")
    return out
a = run(_additive(vis, torch.float32), "additive4d")
b = run(None, "none")
c = run(torch.ones_like(ids), "2d-ones")
print("logits equal add/none", torch.equal(a.logits, b.logits), (a.logits-b.logits).abs().max().item())
print("kv equal", all(torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values) for x, y in zip(a.past_key_values.layers, b.past_key_values.layers)))
