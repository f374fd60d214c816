"""Client arguments to vericache.v1 requests, checked before any RPC; stream messages to records.

Shared by the sync and asyncio clients so both accept and return exactly the same things.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc

from vericache.client.errors import InvalidRequestError, ServerError
from vericache.client.types import GenerateOptions, Result, Sampling, stats_to_dict
from vericache.v1 import vericache_pb2

MODES: dict[str, int] = {
    "vericache": vericache_pb2.VERICACHE,
    "full_local": vericache_pb2.FULL_LOCAL,
    "full_remote": vericache_pb2.FULL_REMOTE,
    "lossy": vericache_pb2.LOSSY,
    "auto": vericache_pb2.AUTO,
}
_INT32_MAX = 2**31 - 1


def put_prefix_request(
    text: str | None,
    token_ids: Sequence[int] | None,
    compressor: str,
    ratio: float | None,
    bits: int | None,
    dtype: str | None = None,
) -> vericache_pb2.PutPrefixRequest:
    if (text is None) == (token_ids is None):
        raise InvalidRequestError("put_prefix needs exactly one of text= and token_ids=")
    spec = compressor_spec(compressor, ratio, bits, dtype)
    if text is not None:
        if not isinstance(text, str):
            raise InvalidRequestError(f"text must be a str, got {type(text).__name__}")
        return vericache_pb2.PutPrefixRequest(text=text, compressor=spec)
    ids = vericache_pb2.TokenIds(ids=_check_token_ids(token_ids))
    return vericache_pb2.PutPrefixRequest(token_ids=ids, compressor=spec)


def compressor_spec(
    compressor: str, ratio: float | None, bits: int | None, dtype: str | None = None
) -> vericache_pb2.Compressor:
    if not isinstance(compressor, str) or not compressor:
        raise InvalidRequestError(f"compressor must be a registry name, got {compressor!r}")
    if ratio is not None and not ratio > 0:
        raise InvalidRequestError(f"ratio must be > 0, got {ratio!r}")
    if bits is not None:
        _check_count("bits", bits)
    if dtype is not None and not isinstance(dtype, str):
        raise InvalidRequestError(f"dtype must be a str such as 'bfloat16', got {dtype!r}")
    return vericache_pb2.Compressor(name=compressor, ratio=ratio, bits=bits, dtype=dtype)


def prefix_compressor(
    compressor: str | None, ratio: float | None, bits: int | None
) -> vericache_pb2.Compressor | None:
    """The compressor a Generate asks its prefix for; None: any."""
    if compressor is None:
        if ratio is not None or bits is not None:
            raise InvalidRequestError("ratio and bits are a compressor's strength: give compressor")
        return None
    return compressor_spec(compressor, ratio, bits)


def generate_call(
    prompt: str, options: GenerateOptions
) -> tuple[vericache_pb2.GenerateRequest, float | None]:
    """The Generate request `options` ask for, and the call's timeout. A keyword that is none of
    `GenerateOptions`' is refused with the sampling keywords' check (a misspelt one), before any
    RPC."""
    get = options.get
    named = GenerateOptions.__optional_keys__ - Sampling.__optional_keys__
    sampling = {key: value for key, value in options.items() if key not in named}
    request = generate_request(
        prompt, get("prefix_id"), get("mode"), get("max_tokens"), get("stop", ()),
        get("draft_len"), get("stop_token_ids", ()), sampling,
        prefix_compressor(get("compressor"), get("ratio"), get("bits")), get("steer_every"),
    )  # fmt: skip
    return request, get("timeout")


def generate_request(
    prompt: str,
    prefix_id: str | None,
    mode: str | None,
    max_tokens: int | None,
    stop: Sequence[str],
    draft_len: int | None,
    stop_token_ids: Sequence[int] = (),
    sampling: Mapping[str, Any] | None = None,
    compressor: vericache_pb2.Compressor | None = None,
    steer_every: int | None = None,
) -> vericache_pb2.GenerateRequest:
    if not isinstance(prompt, str):
        raise InvalidRequestError(f"prompt must be a str, got {type(prompt).__name__}")
    if mode is not None and mode not in MODES:
        raise InvalidRequestError(f"unknown mode {mode!r}: choose one of {', '.join(MODES)}")
    if max_tokens is not None:  # None: the server's default, within the API key's limit
        _check_count("max_tokens", max_tokens)
    if draft_len is not None:
        _check_count("draft_len", draft_len)
    if steer_every is not None:  # 0: never; None: the server's default
        _check_count("steer_every", steer_every, least=0)
    stop = (stop,) if isinstance(stop, str) else tuple(stop or ())  # one string, not its letters
    if not all(isinstance(s, str) and s for s in stop):
        raise InvalidRequestError(f"stop must hold non-empty strings, got {stop!r}")
    stop_token_ids = _check_token_ids(stop_token_ids) if stop_token_ids else []
    return vericache_pb2.GenerateRequest(
        prefix_id=prefix_id or "",
        prompt=prompt,
        max_tokens=max_tokens,
        stop=stop,
        mode=MODES[mode] if mode is not None else None,
        draft_len=draft_len,
        stop_token_ids=stop_token_ids,
        compressor=compressor,
        steer_every=steer_every,
        **_sampling_fields(sampling or {}),
    )


# Each sampling keyword: the types it takes, and whether a value is allowed (the server checks
# the same ranges; checking here answers before any RPC).
_SAMPLING_CHECKS: dict[str, tuple[tuple[type, ...], Callable[[Any], bool], str]] = {
    "temperature": ((int, float), lambda v: v >= 0, ">= 0"),
    "top_p": ((int, float), lambda v: 0 < v <= 1, "in (0, 1]"),
    "top_k": ((int,), lambda v: v >= 0, ">= 0"),
    "min_p": ((int, float), lambda v: 0 <= v <= 1, "in [0, 1]"),
    "seed": ((int,), lambda v: 0 <= v < 2**64, "in [0, 2**64)"),
    "repetition_penalty": ((int, float), lambda v: v > 0, "> 0"),
    "presence_penalty": ((int, float), lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "coupling": ((str,), lambda v: v in _COUPLINGS, "'seeded' or 'rejection'"),
}
_COUPLINGS = {"seeded": vericache_pb2.SEEDED, "rejection": vericache_pb2.REJECTION}


def _sampling_fields(sampling: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(sampling) - set(_SAMPLING_CHECKS))
    if unknown:
        raise InvalidRequestError(
            f"unknown sampling keyword {unknown[0]!r}: choose from {', '.join(_SAMPLING_CHECKS)}"
        )
    fields: dict[str, Any] = {}
    for name, value in sampling.items():
        types, allowed, requirement = _SAMPLING_CHECKS[name]
        if isinstance(value, bool) or not isinstance(value, types) or not allowed(value):
            raise InvalidRequestError(f"{name} must be {requirement}, got {value!r}")
        fields[name] = _COUPLINGS[value] if name == "coupling" else value
    return fields


def _check_count(name: str, value: int, least: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not least <= value <= _INT32_MAX:
        raise InvalidRequestError(f"{name} must be an integer >= {least}, got {value!r}")


def _check_token_ids(token_ids: Sequence[int]) -> list[int]:
    try:
        ids = [operator.index(t) for t in token_ids]  # numpy integers too
    except TypeError:
        raise InvalidRequestError("token_ids must be a sequence of integers") from None
    if not ids or not all(0 <= t <= _INT32_MAX for t in ids):
        raise InvalidRequestError("token_ids must be a non-empty sequence of ids >= 0")
    return ids


class GenerateAccumulator:
    """Collects a Generate stream: text deltas as chunks arrive, then the Result."""

    def __init__(self):
        self._texts: list[str] = []
        self._token_ids: list[int] = []
        self.result: Result | None = None  # set by the final stats message

    def add(self, message: vericache_pb2.GenerateResponse) -> str:
        """The text this message adds ("" for the final stats)."""
        if self.result is not None:
            raise _protocol_error("the Generate stream went on after its final statistics")
        if message.WhichOneof("event") == "chunk":
            self._texts.append(message.chunk.text)
            self._token_ids.extend(message.chunk.token_ids)
            return message.chunk.text
        if message.WhichOneof("event") != "stats":
            raise _protocol_error("the Generate stream sent an empty message")
        self.result = Result(
            text="".join(self._texts),
            token_ids=list(self._token_ids),
            finish_reason=message.stats.finish_reason,
            stats=stats_to_dict(message.stats),
        )
        return ""

    def finish(self) -> Result:
        if self.result is None:
            raise _protocol_error("the Generate stream ended without its final statistics")
        return self.result


def _protocol_error(message: str) -> ServerError:
    # The server broke the contract of vericache.v1: its fault, not the caller's.
    return ServerError(message, grpc.StatusCode.INTERNAL)


def prefix_id_from_progress(last: vericache_pb2.PutPrefixProgress | None) -> str:
    if last is None or not last.done or not last.prefix_id:
        raise _protocol_error("the PutPrefix stream ended before its 'done' message")
    return last.prefix_id


def check_prefix_id(prefix_id: str) -> str:
    if not isinstance(prefix_id, str) or not prefix_id:
        raise InvalidRequestError(f"prefix_id must be a non-empty str, got {prefix_id!r}")
    return prefix_id
