"""Probe: our plain decoding against transformers' generate() on long documents, split into the
prefill and the per-token step. Two long_context prompts, 64 tokens each; M=gemma3_270m for Gemma 3
(raw text), SmolLM2 (chat) otherwise.

    python -m scripts.probes.long_plain_steps
    M=gemma3_270m python -m scripts.probes.long_plain_steps

Untested; figures in docs/RESULTS.md ("The `--standard` grid") and docs/NOTES.md.
"""
import dataclasses
import os
import time
import torch
from experiments.common import prompt_sets
from experiments.common.long_context import load_long_context
from specdec import packaged_models
from specdec.decode import SpecDecoder
from specdec.sampling import SamplingParams
from specdec.target import HFTarget
from verifiers import reference
torch.set_num_threads(2)
name = os.environ.get("M", "smollm2")
model, tok = packaged_models.load_packaged(name, torch.float32)
target = HFTarget(model, packed_gemm_from="auto", key=name)
prompts = [torch.tensor(prompt_sets.encode_prompt(tok, dataclasses.replace(p, chat=name == "smollm2"))) for p in load_long_context(4)]
greedy = SamplingParams(0.0)
dec = SpecDecoder(target, None, reference.verify)
dec.generate(prompts[:1], 4, greedy)
def gen(ids, n):
    t = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return time.perf_counter() - t
for p in prompts[1:3]:
    g = dec.generate([p], 65, greedy, max_batch=1)
    ours_step = g.stats.time.target_s / 64
    a, b = gen(p[None], 1), gen(p[None], 65)
    print(f"{name} len {len(p)}: ours prefill {g.stats.time.prefill_s:.2f}s step {1000*ours_step:.1f}ms | generate 1-token {a:.2f}s step {1000*(b-a)/64:.1f}ms")
