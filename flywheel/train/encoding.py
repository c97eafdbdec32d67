"""Conversations as token ids with a mask that is 1 on the assistant's tokens: what SFT and RL train on."""

from __future__ import annotations

from flywheel.policies.toolcalls import canonical_messages
from flywheel.train.templates import has_generation_markers


def encode_conversation(tokenizer, messages: list[dict], tools: list[dict] | None,
                        max_length: int, chat_template: str | None = None) -> tuple[list[int], list[int]]:
    """Token ids of a whole conversation and a mask that is 1 on assistant tokens only, cut to max_length."""
    out = tokenizer.apply_chat_template(canonical_messages(messages), tools=tools or None, tokenize=True,
                                        return_dict=True, return_assistant_tokens_mask=True,
                                        chat_template=chat_template or _masking_template(tokenizer))
    input_ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    if 1 not in mask:
        raise ValueError("the chat template marks no assistant tokens: it needs {% generation %} markers "
                         "around each assistant turn")
    return input_ids[:max_length], mask[:max_length]


def _masking_template(tokenizer) -> str | None:
    """None when the tokenizer's template marks assistant turns; else TRL's training variant, as SFT uses."""
    template = tokenizer.chat_template
    if has_generation_markers(template):
        return None
    from trl.chat_template_utils import get_training_chat_template  # only for templates without markers

    return get_training_chat_template(tokenizer)
