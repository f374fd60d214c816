"""Prompts as token ids: the context in the system turn (the shared, compressible prefix) and the
user's prompt in the user turn, through the model's chat template."""

from __future__ import annotations

from dataclasses import dataclass

from vericache.errors import UnsupportedModelError


@dataclass(frozen=True)
class PromptIds:
    token_ids: tuple[int, ...]
    num_prefix_tokens: int  # the system turn holding the context


def build_chat_prompt(tokenizer, context: str | None, prompt: str) -> PromptIds:
    """Token ids of [system: context, user: prompt] plus the assistant header.

    The prefix (the system turn) and the rest are tokenized apart, so the prefix's ids do not
    depend on the prompt that follows it: a registered prefix is reusable as is.
    """
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}]
        if context:
            messages.insert(0, {"role": "system", "content": context})
        full = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prefix = ""
        if context:
            prefix = tokenizer.apply_chat_template(messages[:1], tokenize=False)
            if not full.startswith(prefix):
                raise UnsupportedModelError(
                    "the model's chat template does not render the system turn as a prefix"
                )
    else:
        prefix = f"{context}\n\n" if context else ""
        full = prefix + prompt
    prefix_ids = tokenizer.encode(prefix, add_special_tokens=False) if prefix else []
    rest_ids = tokenizer.encode(full[len(prefix) :], add_special_tokens=False)
    return PromptIds(tuple(prefix_ids + rest_ids), len(prefix_ids))
