"""Tiny random Hugging Face models of several architecture families, for structure tests."""

from __future__ import annotations

import torch


def tiny_model(family: str = "llama", vocab_size: int = 128, seed: int = 0, layers: int = 2, sharpness: float = 1.0):
    """A seeded fp32 model; ``sharpness`` scales the output layer so that next-token distributions
    are peaked and context-dependent (a random init is nearly uniform, which hides bugs)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, max_position_embeddings=256)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(num_key_value_heads=2, tie_word_embeddings=False, **common))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(num_key_value_heads=2, tie_word_embeddings=False, **common))
    elif family == "gpt_neox":
        model = GPTNeoXForCausalLM(GPTNeoXConfig(use_parallel_residual=True, tie_word_embeddings=False, **common))
    else:
        raise ValueError(family)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(sharpness)
    return model.eval()


def full_logits(model, sequence: list[int]) -> torch.Tensor:  # [L, V]
    with torch.no_grad():
        return model(torch.tensor([sequence])).logits[0].float()
