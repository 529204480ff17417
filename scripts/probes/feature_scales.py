"""Probe: how far from unit scale are the layers an EAGLE-3 head fuses? For SmolLM2 (layers 2, 15,
27) and Gemma 3 270M (2, 9, 15), the median and largest row RMS of each layer's hidden states over
one fixed English sentence (the first token, an attention sink, left out), and the largest entry.
The figures decided train.feature_norm=auto's limit (drafters/training/eagle_training.py,
FEATURE_SCALE_LIMIT).

    python -m scripts.probes.feature_scales

Untested; its figures (2026-12-05) are in docs/NOTES.md, "Problems seen and left alone", In training.
"""

import torch

from specdec.packaged_models import load_packaged

TEXT = ("The quick brown fox jumps over the lazy dog. In 1905, Einstein published four papers that changed "
        "physics, including special relativity.")

torch.set_num_threads(1)
for name, layers in (("smollm2", (2, 15, 27)), ("gemma3_270m", (2, 9, 15))):
    model, tokenizer = load_packaged(name)
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
    for layer in layers:
        rows = states[layer][0, 1:]  # [T - 1, H]
        rms = rows.pow(2).mean(-1).sqrt()  # [T - 1]
        print(f"{name} layer {layer}: row RMS median {rms.median():.1f}, max {rms.max():.1f}; largest entry {rows.abs().max():.1f}")
