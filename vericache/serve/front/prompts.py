"""Text to token ids for the serving front: prefixes and prompts, checked, off the event loop.

Tokenizing a few MB of text takes seconds: on the coordinator's event loop it would stall every
other RPC. `Prompts` tokenizes on a thread of its own (one: a fast tokenizer's settings are
mutated per call, and two threads in one tokenizer fail with "Already borrowed"), and refuses text
that cannot fit before tokenizing it: a token covers at most `longest token` characters, so text
longer than that many times the token limit has too many tokens whatever they are.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

from vericache.engine.prompt import PromptIds, build_chat_prompt, build_conversation
from vericache.errors import InvalidRequestError
from vericache.serve.api_types import ChatTurn, FunctionTool, GenerateCall
from vericache.serve.front.auth import TenantLimitError
from vericache.serve.front.tools import conversation_turns
from vericache.serve.store.catalog import PrefixRecord
from vericache.serve.workers.worker_api import ModelInfo


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
        self, record: PrefixRecord | None, call: GenerateCall, limit: int | None
    ) -> PromptIds:
        """Chat prefixes are a system turn: the prompt is the user turn after it, or a whole
        conversation whose system turn is the prefix's. Token prefixes, and prompts that
        continue text, are followed by the prompt's tokens as they are. The prefix part is the
        record's, or a conversation's system turn."""
        if call.messages:
            text = "".join(turn.content for turn in call.messages)
            text += "".join(json.dumps(tool.as_openai()) for tool in call.tools)
            build = self._conversation_ids
            what = (call.messages, call.tools)
        else:
            if not call.prompt:
                raise InvalidRequestError("the prompt is empty")
            text, what = call.prompt, call.prompt
            build = self._text_ids if call.continues_text else self._prompt_ids
        self._check_text_fits(text, limit, "the prompt")
        prompt = await self._run(build, self._need_tokenizer(), record, what)
        self.check_length(prompt.token_ids, "the prompt")
        return prompt

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
    def _prompt_ids(tokenizer, record: PrefixRecord | None, prompt: str) -> PromptIds:
        if record is None:
            return PromptIds(build_chat_prompt(tokenizer, None, prompt).token_ids, 0)
        if record.chat:
            turn = build_chat_prompt(tokenizer, "?", prompt)
            rest = turn.token_ids[turn.num_prefix_tokens :]
        else:
            rest = tokenizer.encode(prompt, add_special_tokens=False)
        return PromptIds((*record.token_ids, *rest), record.num_tokens)

    @staticmethod
    def _text_ids(tokenizer, record: PrefixRecord | None, text: str) -> PromptIds:
        prefix = record.token_ids if record else ()
        ids = (*prefix, *tokenizer.encode(text, add_special_tokens=not prefix))
        return PromptIds(ids, len(prefix))

    def system_text(self, call: GenerateCall) -> str | None:
        """The text of a conversation's system turn as rendered (the default format's tool
        catalogue in it): what registers as its prefix. None without one, or where the chat
        template renders tools beside it, so that its tokens are not its text's alone."""
        if not call.messages or self.tokenizer is None:
            return None
        turns, schemas = conversation_turns(self.tokenizer, call.messages, call.tools)
        if schemas or turns[0]["role"] != "system":
            return None
        return turns[0]["content"]

    @staticmethod
    def _conversation_ids(
        tokenizer,
        record: PrefixRecord | None,
        conversation: tuple[tuple[ChatTurn, ...], tuple[FunctionTool, ...]],
    ) -> PromptIds:
        messages, tools = conversation
        if messages[-1].role == "assistant":
            raise InvalidRequestError("the conversation must end with a user, system or tool turn")
        turns, schemas = conversation_turns(tokenizer, messages, tools)
        prompt = build_conversation(tokenizer, turns, schemas)
        prefix = prompt.token_ids[: prompt.num_prefix_tokens]
        if record is not None and (not record.chat or prefix != record.token_ids):
            raise InvalidRequestError(
                f"the conversation's system turn is not the text of prefix {record.prefix_id}"
            )
        return PromptIds(tuple(prompt.token_ids), prompt.num_prefix_tokens)

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
