"""Training sequences from chat conversations, tokenised with the target's chat template."""

from __future__ import annotations

from collections.abc import Sequence

from specdec.assets import Conversation


def chat_sequences(tokenizer, conversations: Sequence[Conversation], max_length: int, min_length: int = 16) -> list[list[int]]:
    """Each conversation through the chat template (all turns), cut to max_length tokens; sequences
    shorter than min_length carry too little context to train on and are dropped."""
    sequences = []
    for conversation in conversations:
        messages = [{"role": role, "content": text} for role, text in conversation.turns if text.strip()]
        if not messages:
            continue
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_length]
        if len(ids) >= min_length:
            sequences.append(ids)
    if not sequences:
        raise ValueError(
            f"none of the {len(conversations)} conversations gave a usable training sequence "
            f"(>= {min_length} tokens); check the data source"
        )
    return sequences
