"""Text to token ids for the serving front: prefixes and prompts, checked, off the event loop.

Tokenizing a few MB of text takes seconds: on the coordinator's event loop it would stall every
other RPC. `Prompts` tokenizes on a thread of its own (one: a fast tokenizer's settings are
mutated per call, and two threads in one tokenizer fail with "Already borrowed"), and refuses text
that cannot fit before tokenizing it: a token covers at most `longest token` characters, so text
longer than that many times the token limit has too many tokens whatever they are.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from vericache.engine.prompt import build_chat_prompt
from vericache.errors import InvalidRequestError
from vericache.serve.auth import TenantLimitError
from vericache.serve.catalog import PrefixRecord
from vericache.serve.worker_api import ModelInfo


class Prompts:
    def __init__(self, tokenizer, info: ModelInfo):
        self.tokenizer = tokenizer  # None: token ids only
        self.info = info
        self._longest_token = _longest_token_chars(tokenizer) if tokenizer is not None else 0
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tokenize")

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    async def prefix_tokens(
        self, text: str | None, token_ids: tuple[int, ...] | None, limit: int | None
    ) -> tuple[tuple[int, ...], bool]:
        """A prefix's token ids, and whether they are a chat system turn (text) or raw ids.
        `limit`: the caller's most prompt tokens (None: the model's context alone)."""
        if token_ids is not None:
            token_ids, chat = tuple(token_ids), False
        elif text is not None:
            if not text:
                raise InvalidRequestError("the prefix text is empty")
            self._check_text_fits(text, limit, "the prefix")
            prompt = await self._run(build_chat_prompt, self._need_tokenizer(), text, "?")
            token_ids, chat = tuple(prompt.token_ids[: prompt.num_prefix_tokens]), True
        else:
            raise InvalidRequestError("PutPrefix needs text or token_ids")
        self.check_length(token_ids, "the prefix")
        self.check_token_ids(token_ids, "token ids")
        return token_ids, chat

    async def prompt_ids(
        self, record: PrefixRecord | None, prompt: str, limit: int | None
    ) -> tuple[int, ...]:
        """Chat prefixes are a system turn: the prompt is the user turn after it. Token prefixes
        are continued by the prompt's tokens as they are."""
        if not prompt:
            raise InvalidRequestError("the prompt is empty")
        self._check_text_fits(prompt, limit, "the prompt")
        prompt_ids = await self._run(self._prompt_ids, self._need_tokenizer(), record, prompt)
        self.check_length(prompt_ids, "the prompt")
        return prompt_ids

    def check_length(self, token_ids: tuple[int, ...], what: str) -> None:
        if not token_ids:
            raise InvalidRequestError(f"{what} has no tokens")
        if len(token_ids) >= self.info.max_positions:
            raise InvalidRequestError(
                f"{what} has {len(token_ids)} tokens; the model's context is "
                f"{self.info.max_positions}, and at least one must remain for output"
            )

    def check_token_ids(self, token_ids: tuple[int, ...], what: str) -> None:
        if not all(0 <= t < self.info.vocab_size for t in token_ids):
            raise InvalidRequestError(f"{what} must lie in [0, {self.info.vocab_size})")

    def _check_text_fits(self, text: str, limit: int | None, what: str) -> None:
        context = self.info.max_positions - 1
        if len(text) > context * self._longest_token:
            raise InvalidRequestError(
                f"{what} is {len(text)} characters: more than the model's {context} tokens hold"
            )
        if limit is not None and len(text) > limit * self._longest_token:
            raise TenantLimitError(
                f"{what} is {len(text)} characters: more than this API key's limit of {limit} "
                "prompt tokens holds"
            )

    @staticmethod
    def _prompt_ids(tokenizer, record: PrefixRecord | None, prompt: str) -> tuple[int, ...]:
        if record is None:
            return tuple(build_chat_prompt(tokenizer, None, prompt).token_ids)
        if record.chat:
            turn = build_chat_prompt(tokenizer, "?", prompt)
            return (*record.token_ids, *turn.token_ids[turn.num_prefix_tokens :])
        return (*record.token_ids, *tokenizer.encode(prompt, add_special_tokens=False))

    async def _run(self, function, *args):
        return await asyncio.get_running_loop().run_in_executor(self._thread, function, *args)

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise InvalidRequestError(f"model {self.info.model} has no tokenizer: text needs one")
        return self.tokenizer


def _longest_token_chars(tokenizer) -> int:
    """The most characters of text one token can stand for: a vocabulary entry spells its text
    with at least one character per character (byte-level BPE: one per byte; SentencePiece: one
    per character, `<0x..>` byte tokens six for one byte; special tokens: their spelling)."""
    return max(len(token) for token in tokenizer.get_vocab())
