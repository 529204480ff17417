"""Probe: where does generate()'s lead over our plain decoding on Gemma 3's long documents come
from? One long_context document (raw text): our prefill against the model's forward over
transformers' DynamicCache (twice), our cache against DynamicCache under the same forward (twice),
then a plain step's forward, ours against the same forward through transformers' own cache
(median of 15 each).

    python -m scripts.probes.gemma_long_costs

Untested; its figures (from the runs of its three parts on 2026-12-05) are in docs/NOTES.md,
"Problems seen and left alone".
"""

import dataclasses
import time

import torch
from transformers import DynamicCache

from experiments.common import prompt_sets
from experiments.common.long_context import load_long_context
from specdec import packaged_models
from specdec.kv_cache import growing_cache
from specdec.target import HFTarget
from specdec.tree import empty_tree

torch.set_num_threads(2)
model, tok = packaged_models.load_packaged("gemma3_270m", torch.float32)
target = HFTarget(model, packed_gemm_from="auto", key="gemma3_270m")
p = torch.tensor(prompt_sets.encode_prompt(tok, dataclasses.replace(load_long_context(2)[1], chat=False)))
ids = p[None, :-1]
L = ids.shape[1]


def median(f, n):
    times = []
    for _ in range(n):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return sorted(times)[n // 2]


def forward(cache):
    model(input_ids=ids, attention_mask=None, use_cache=True, logits_to_keep=1, past_key_values=cache)


with torch.no_grad():
    for _ in range(2):
        ours = median(lambda: target.prefill([p], ()), 1)
        theirs = median(lambda: forward(DynamicCache(config=model.config)), 1)
        print(f"prefill: target.prefill {ours:.2f} s, the model over DynamicCache {theirs:.2f} s", flush=True)
    for _ in range(2):
        growing = median(lambda: forward(growing_cache()), 1)
        dynamic = median(lambda: forward(DynamicCache(config=model.config)), 1)
        print(f"prefill: our growing cache {growing:.2f} s, DynamicCache {dynamic:.2f} s", flush=True)
    target.prefill([p], ())
    step_ours = median(lambda: target.forward_tree(empty_tree(1), ()), 15)
    cache = DynamicCache(config=model.config)
    forward(cache)
    length = [L]

    def hf_step():  # the cache grows by a column per call, as in generate()
        model(input_ids=p[None, -1:], attention_mask=torch.ones(1, length[0] + 1, dtype=torch.long),
              position_ids=torch.tensor([[length[0]]]), use_cache=True, logits_to_keep=1, past_key_values=cache)
        length[0] += 1

    print(f"step: ours {1000 * step_ours:.1f} ms, transformers' cache {1000 * median(hf_step, 15):.1f} ms")
