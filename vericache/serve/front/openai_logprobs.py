"""Log-probabilities in OpenAI's shapes: chat's `logprobs.content` entries and the completions
API's `tokens` / `token_logprobs` / `top_logprobs` / `text_offset` lists.

The values are the engine's (`TokenLogprob`: vLLM's processed logprobs, from the verifier's
full-KV logits for a vericache request). A token's text is the token decoded alone, as vLLM
reports it (a piece of a multi-byte character decodes to U+FFFD), its `bytes` that text's UTF-8.
A masked token's -inf is reported as -9999.0, as vLLM does: JSON has no infinity.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

from vericache.engine.request import TokenLogprob

MASKED_LOGPROB = -9999.0


class TokenTexts:
    """Each token's text alone, decoded once."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.text = lru_cache(maxsize=1 << 16)(self._decode)

    def _decode(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id])


def chat_logprobs(texts: TokenTexts, logprobs: Sequence[TokenLogprob]) -> dict:
    """A chat choice's (or chunk's) `logprobs`: one `content` entry per token."""
    content = []
    for token in logprobs:
        entry = _chat_entry(texts, token.token_id, token.logprob)
        entry["top_logprobs"] = [_chat_entry(texts, id_, value) for id_, value in token.top]
        content.append(entry)
    return {"content": content}


def _chat_entry(texts: TokenTexts, token_id: int, logprob: float) -> dict:
    text = texts.text(token_id)
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}


def completion_logprobs(
    texts: TokenTexts, logprobs: Sequence[TokenLogprob], text_offset: int = 0
) -> dict:
    """A completion choice's (or chunk's) `logprobs`. top_logprobs: per token, the most likely
    tokens' texts and the chosen one's (vLLM's); text_offset: where each token's text starts in
    the choice's text, counting from `text_offset` (the characters sent before)."""
    tokens, values, tops, offsets = [], [], [], []
    for token in logprobs:
        text = texts.text(token.token_id)
        tokens.append(text)
        values.append(_finite(token.logprob))
        top = {texts.text(id_): _finite(value) for id_, value in token.top}
        top.setdefault(text, _finite(token.logprob))
        tops.append(top)
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets,
    }  # fmt: skip


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MASKED_LOGPROB
