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
    """Token ids of [system: context, user: prompt] plus the assistant header."""
    messages = [{"role": "user", "content": prompt}]
    if context:
        messages.insert(0, {"role": "system", "content": context})
    return build_conversation(tokenizer, messages)


def build_conversation(
    tokenizer, messages: list[dict], tools: list[dict] | None = None
) -> PromptIds:
    """Token ids of a conversation ({"role", "content"} turns) plus the assistant header; its
    prefix is the leading system turn, if any. `tools` (OpenAI's function tools) go to a chat
    template that renders them, with the system turn where it puts them there.

    The prefix (the system turn) and the rest are tokenized apart, so the prefix's ids do not
    depend on what follows it: a registered prefix is reusable as is.
    """
    system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
    if getattr(tokenizer, "chat_template", None):
        with_tools = {"tools": tools} if tools else {}
        full = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **with_tools
        )
        prefix = ""
        if system:
            prefix = tokenizer.apply_chat_template(messages[:1], tokenize=False, **with_tools)
            if not full.startswith(prefix):
                raise UnsupportedModelError(
                    "the model's chat template does not render the system turn as a prefix"
                )
    else:
        turns = messages[1:] if system is not None else messages
        prefix = f"{system}\n\n" if system else ""
        full = prefix + "\n\n".join(turn["content"] for turn in turns)
    prefix_ids = tokenizer.encode(prefix, add_special_tokens=False) if prefix else []
    rest_ids = tokenizer.encode(full[len(prefix) :], add_special_tokens=False)
    return PromptIds(tuple(prefix_ids + rest_ids), len(prefix_ids))
