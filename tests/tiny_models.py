"""Tiny random Hugging Face models of several architecture families, for structure tests."""

from __future__ import annotations

import torch


def tiny_model(family: str = "llama", vocab_size: int = 128, seed: int = 0, layers: int = 2, sharpness: float = 1.0):
    """A seeded fp32 model; ``sharpness`` scales the output layer so that next-token distributions
    are peaked and context-dependent (a random init is nearly uniform, which hides bugs)."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, max_position_embeddings=256)
    if family == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(num_key_value_heads=2, tie_word_embeddings=False, **common))
    elif family == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(num_key_value_heads=2, tie_word_embeddings=False, **common))
    elif family == "gpt_neox":
        model = tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(use_parallel_residual=True, tie_word_embeddings=False, **common))
    elif family == "gpt2":  # learned absolute positions, Conv1D projections, blocks at transformer.h
        model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=vocab_size, n_embd=64, n_layer=layers, n_head=4,
                                                 n_positions=256, bos_token_id=0, eos_token_id=0))
    elif family == "opt":  # learned positions with an offset, blocks two levels down (model.decoder.layers)
        model = tf.OPTForCausalLM(tf.OPTConfig(vocab_size=vocab_size, hidden_size=64, ffn_dim=128, num_hidden_layers=layers,
                                               num_attention_heads=4, max_position_embeddings=256,
                                               word_embed_proj_dim=64, bos_token_id=0, eos_token_id=0, pad_token_id=0))
    elif family == "phi":  # partial rotary, parallel attention/MLP, final_layernorm
        model = tf.PhiForCausalLM(tf.PhiConfig(**common))
    elif family == "gemma2":  # alternating sliding-window (8 tokens) and global layers, logit soft-capping
        model = tf.Gemma2ForCausalLM(tf.Gemma2Config(num_key_value_heads=2, head_dim=16, sliding_window=8, **common))
    elif family == "gemma3":  # Gemma 3's layout: sliding-window (8 tokens) and global layers with their own RoPE bases, q/k norms
        kinds = ["full_attention" if i % 2 else "sliding_attention" for i in range(layers)]
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(num_key_value_heads=1, head_dim=16, sliding_window=8,
                                                         layer_types=kinds, query_pre_attn_scalar=16, **common))
    elif family == "mistral":  # every layer slides over 8 tokens
        model = tf.MistralForCausalLM(tf.MistralConfig(num_key_value_heads=2, sliding_window=8, **common))
    else:
        raise ValueError(family)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(sharpness)
    return model.eval()


def full_logits(model, sequence: list[int]) -> torch.Tensor:  # [L, V]
    with torch.no_grad():
        return model(torch.tensor([sequence])).logits[0].float()


def save_base_model(path):
    """A GPT-2-family model with a character tokenizer and no chat template, as base models ship."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tiny_model("gpt2", sharpness=4.0).save_pretrained(path)
    characters = Tokenizer(models.WordLevel({chr(i): i - 32 for i in range(32, 127)} | {"[UNK]": 95}, unk_token="[UNK]"))
    characters.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=characters, unk_token="[UNK]", eos_token="~").save_pretrained(path)
    return path


def sharp_llama():
    """A tiny llama target with peaked next-token distributions: its greedy text repeats itself, so
    drafters that copy from context or from the target's own earlier logits get drafts accepted."""
    from specdec.target import HFTarget

    return HFTarget(tiny_model("llama", sharpness=4.0))


def greedy_outputs(target, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Plain greedy decoding through the same loop: what every drafter's greedy output must equal."""
    from specdec.decode import SpecDecoder
    from specdec.sampling import SamplingParams
    from verifiers import reference

    return SpecDecoder(target, None, reference.verify).generate(prompts, max_new_tokens, SamplingParams(0.0)).outputs


def save_chat_model(path, template: str):
    """save_base_model, with ``template`` as the tokenizer's chat template."""
    import json

    path = save_base_model(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path
