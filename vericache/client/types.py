"""The records the client SDK returns, each built from its vericache.v1 message."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

from vericache.v1 import vericache_pb2

# How `generate` decodes; see `Mode` in proto/vericache/v1/vericache.proto.
ModeName = Literal["vericache", "full_local", "full_remote", "lossy", "auto"]


class Sampling(TypedDict, total=False):
    """`generate`'s sampling keywords, as vLLM defines them (unset: greedy decoding).

    With temperature > 0 each token is sampled after the penalties, the temperature and the
    top-k / top-p / min-p masks. coupling "seeded" (the default) gives exactly the tokens full-KV
    sampling gives with the same seed, in every mode; "rejection" keeps the model's distribution
    but gives another sample. Without a seed the server draws one and reports it in
    `Result.stats["seed"]`."""

    temperature: float  # >= 0; 0: greedy
    top_p: float  # (0, 1]
    top_k: int  # >= 0; 0: every token
    min_p: float  # [0, 1]
    seed: int  # [0, 2**64)
    repetition_penalty: float  # > 0, over prompt and output tokens
    presence_penalty: float  # [-2, 2], once per token in the output
    coupling: Literal["seeded", "rejection"]


class GenerateOptions(Sampling, total=False):
    """`generate`'s and `stream`'s keywords after the prompt, every one optional: written once here
    for the sync and asyncio clients both.

    `prefix_id`: the registered prefix the prompt follows (None: none, or the one the server
    finds). `mode` is "auto" (the server chooses the fastest lossless path), "vericache" (lossless
    speculative decoding), "full_local", "full_remote" or "lossy" (None: the server's default, auto
    where a prefix is found); `draft_len` is the number of tokens drafted per round (None: the
    server's), and `max_tokens` the most tokens generated (None: the server's default, within the
    API key's limit). Decoding stops at the first of `stop` (the text ends before it) or of
    `stop_token_ids` (end tokens besides the model's EOS, kept in the output). `compressor` (with
    `ratio` or `bits`) asks for the prefix's compressor: a named prefix must have been registered
    with it, and without `prefix_id` only the prefixes registered with it are looked up (None:
    any). `steer_every` (vericache over a token dropper's prefix: snapkv, pyramidkv, kvzip, alone
    or composed with kivi): the
    verifier refreshes the drafter's kept prefix positions every this many rounds, from the
    attention its verifications pay them (0: never; None: the server's default, every round
    over a prefix of 1024 tokens or more; the output is the same either way).
    `timeout`: seconds for the call (None: the client's). The sampling keywords
    (`Sampling`); none given: greedy decoding."""

    prefix_id: str | None
    mode: ModeName | None
    max_tokens: int | None
    stop: Sequence[str]
    stop_token_ids: Sequence[int]
    draft_len: int | None
    compressor: str | None
    ratio: float | None
    bits: int | None
    steer_every: int | None
    timeout: float | None


@dataclass(frozen=True)
class Compressor:
    name: str  # a registry name, e.g. "snapkv"
    ratio: float | None = None  # token dropping; None: the compressor's default
    bits: int | None = None  # quantization; None: the compressor's default
    dtype: str | None = None  # token dropping's storage ("bfloat16", "float16"); None: the model's

    @classmethod
    def from_proto(cls, message: vericache_pb2.Compressor) -> Compressor:
        return cls(
            name=message.name,
            ratio=message.ratio if message.HasField("ratio") else None,
            bits=message.bits if message.HasField("bits") else None,
            dtype=message.dtype if message.HasField("dtype") else None,
        )


@dataclass(frozen=True)
class PrefixInfo:
    prefix_id: str
    num_tokens: int
    compressor: Compressor
    full_kv_bytes: int
    compressed_kv_bytes: int  # as streamed to drafters
    # Registered by the server's automatic prefix caching, which may delete it to make room (a
    # prefix a client registered is never deleted but by a client).
    automatic: bool = False

    @classmethod
    def from_proto(cls, message: vericache_pb2.PrefixInfo) -> PrefixInfo:
        return cls(
            prefix_id=message.prefix_id,
            num_tokens=message.num_tokens,
            compressor=Compressor.from_proto(message.compressor),
            full_kv_bytes=message.full_kv_bytes,
            compressed_kv_bytes=message.compressed_kv_bytes,
            automatic=message.automatic,
        )


@dataclass(frozen=True)
class Progress:
    """One step of `put_prefix`, as passed to its `on_progress` callback."""

    prefix_id: str
    stage: str  # "queued", "prefill", "store", "compress", "done"
    num_tokens: int
    is_done: bool
    existed: bool  # the prefix was already registered: nothing was recomputed

    @classmethod
    def from_proto(cls, message: vericache_pb2.PutPrefixProgress) -> Progress:
        return cls(
            prefix_id=message.prefix_id,
            stage=message.stage,
            num_tokens=message.num_tokens,
            is_done=message.done,
            existed=message.existed,
        )


@dataclass(frozen=True)
class Result:
    """A finished generation."""

    text: str
    token_ids: list[int]  # [num_tokens]
    finish_reason: str  # "stop", "length"
    # Every GenerateStats field by its proto name: rounds, mean_accepted_per_round,
    # accepted_per_round (a list), link_bytes, store_bytes, link_wait_s, store_wait_s, ttft_s,
    # tokens_per_s, total_s, num_tokens, finish_reason.
    stats: dict[str, Any]


def stats_to_dict(stats: vericache_pb2.GenerateStats) -> dict[str, Any]:
    # Read from the descriptor so a field added to the proto shows up without a change here; an
    # optional field left unset (the seed of a greedy request) is None.
    fields = {
        field.name: getattr(stats, field.name)
        if not field.has_presence or stats.HasField(field.name)
        else None
        for field in stats.DESCRIPTOR.fields
    }
    return {
        name: value if value is None or isinstance(value, (str, int, float)) else list(value)
        for name, value in fields.items()
    }
