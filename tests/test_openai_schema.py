"""OpenAI request bodies become the coordinator's GenerateCall field for field: every option a
client sends reaches the decode (a dropped field would decode with a default, silently)."""

from __future__ import annotations

import pydantic
import pytest

from vericache.errors import InvalidRequestError
from vericache.serve.api_types import ChatTurn, CompressorChoice, SamplingChoice, ServeMode
from vericache.serve.front.openai_schema import (
    DEFAULT_TEMPERATURE,
    ChatCompletionRequest,
    CompletionRequest,
)

EVERY_SAMPLING_FIELD = {
    "temperature": 0.7, "top_p": 0.9, "top_k": 50, "min_p": 0.05, "seed": 11,
    "presence_penalty": 0.5, "repetition_penalty": 1.2, "coupling": "rejection",
}  # fmt: skip
EVERY_VERICACHE_FIELD = {
    "mode": "full_remote", "draft_len": 5, "prefix_id": "pfx-1", "compressor": "kivi",
    "bits": 4, "timeout_s": 2.5,
}  # fmt: skip


def test_a_chat_body_carries_every_field_into_its_call():
    body = ChatCompletionRequest.model_validate({
        "model": "m", "max_tokens": 9, "max_completion_tokens": 7, "stop": ["\n\n", "END"],
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [
                {"type": "text", "text": "Hi "}, {"type": "text", "text": "there"},
            ]},
        ],
        "stream": True, "stream_options": {"include_usage": True},
        "vericache": EVERY_VERICACHE_FIELD, **EVERY_SAMPLING_FIELD,
    })  # fmt: skip
    call = body.generate_call()
    assert call.max_tokens == 7  # max_completion_tokens wins over the deprecated max_tokens
    assert call.stop == ("\n\n", "END")
    assert call.messages == (ChatTurn("system", "Be brief."), ChatTurn("user", "Hi there"))
    assert call.sampling == SamplingChoice(**EVERY_SAMPLING_FIELD)
    assert call.mode is ServeMode.FULL_REMOTE and call.draft_len == 5
    assert call.prefix_id == "pfx-1"
    assert call.compressor == CompressorChoice("kivi", bits=4)
    assert body.timeout_s == 2.5 and body.include_usage and body.stream


def test_a_completion_body_continues_its_text_and_takes_one_stop_string():
    body = CompletionRequest.model_validate(
        {"model": "m", "prompt": "def f(", "stop": "\n", "max_tokens": 4,
         "vericache": {"compressor": "snapkv", "ratio": 4}}
    )  # fmt: skip
    call = body.generate_call()
    assert (call.prompt, call.continues_text, call.stop) == ("def f(", True, ("\n",))
    assert call.max_tokens == 4 and call.compressor == CompressorChoice("snapkv", ratio=4)
    assert call.mode is None and call.prefix_id is None  # the server decides: auto-prefix
    # OpenAI's default temperature, as vLLM keeps it; nothing else set.
    assert call.sampling == SamplingChoice(temperature=DEFAULT_TEMPERATURE)
    assert not body.include_usage


@pytest.mark.parametrize(
    "change",
    [
        {"max_tokens": "5"},  # strict: no coercion of strings
        {"n": 0},
        {"top_p": 0},
        {"temperature": -1},
        {"coupling": "greedy"},
        {"logprobs": True},  # an unknown field is refused, never ignored
        {"vericache": {"draft_len": 0}},
        {"vericache": {"mode": "fast"}},
    ],
)
def test_a_bad_field_is_refused(change):
    with pytest.raises(pydantic.ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", **change})


def test_a_strength_without_its_compressor_is_refused():
    body = CompletionRequest.model_validate({"model": "m", "prompt": "x", "vericache": {"bits": 4}})
    with pytest.raises(InvalidRequestError, match="need a compressor"):
        body.generate_call()


def test_each_choice_is_a_call_seeded_after_the_one_before():
    body = CompletionRequest.model_validate(
        {"model": "m", "prompt": "x", "n": 3, "seed": 2**64 - 2, "temperature": 0.5}
    )
    seeds = [call.sampling.seed for call in body.generate_calls()]
    assert seeds == [2**64 - 2, 2**64 - 1, 0]
    unseeded = CompletionRequest.model_validate({"model": "m", "prompt": "x", "n": 2})
    assert [call.sampling.seed for call in unseeded.generate_calls()] == [None, None]
