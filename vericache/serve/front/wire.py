"""vericache.v1 messages to and from the serving front's records (api_types.py): the one module of
the server that reads or builds them, besides the servicer that receives and sends them (api.py).
"""

from __future__ import annotations

from vericache.errors import InvalidRequestError
from vericache.serve.api_types import (
    CompressorChoice,
    GenerateCall,
    GenerateEvent,
    GenerateSummary,
    OutputChunk,
    PutPrefixCall,
    RegistrationProgress,
    SamplingChoice,
    ServeMode,
)
from vericache.serve.store.catalog import PrefixRecord
from vericache.v1 import vericache_pb2 as pb

_MODES = {
    pb.VERICACHE: ServeMode.VERICACHE,
    pb.FULL_LOCAL: ServeMode.FULL_LOCAL,
    pb.FULL_REMOTE: ServeMode.FULL_REMOTE,
    pb.LOSSY: ServeMode.LOSSY,
    pb.AUTO: ServeMode.AUTO,
}


def _optional(message, name: str):
    return getattr(message, name) if message.HasField(name) else None


def compressor_choice(message: pb.Compressor) -> CompressorChoice:
    return CompressorChoice(
        name=message.name,
        ratio=_optional(message, "ratio"),
        bits=_optional(message, "bits"),
        dtype=_optional(message, "dtype"),
    )


def put_prefix_call(message: pb.PutPrefixRequest) -> PutPrefixCall:
    content = message.WhichOneof("content")
    compressor = compressor_choice(message.compressor)
    if content == "token_ids":
        return PutPrefixCall(compressor, token_ids=tuple(message.token_ids.ids))
    if content == "text":
        return PutPrefixCall(compressor, text=message.text)
    return PutPrefixCall(compressor)  # neither: the coordinator refuses it


def progress_message(progress: RegistrationProgress) -> pb.PutPrefixProgress:
    return pb.PutPrefixProgress(
        prefix_id=progress.prefix_id,
        stage=progress.stage,
        num_tokens=progress.num_tokens,
        done=progress.is_done,
        existed=progress.existed,
    )


def prefix_info(record: PrefixRecord) -> pb.PrefixInfo:
    params = record.compressor["params"]
    compressor = pb.Compressor(
        name=record.compressor["name"],
        ratio=params.get("ratio"),
        bits=params.get("bits"),
        dtype=params.get("dtype"),
    )
    return pb.PrefixInfo(
        prefix_id=record.prefix_id,
        num_tokens=record.num_tokens,
        compressor=compressor,
        full_kv_bytes=record.full_kv_bytes,
        compressed_kv_bytes=record.compressed_kv_bytes,
        automatic=record.automatic,
    )


def prefix_list(records: list[PrefixRecord]) -> pb.ListPrefixesResponse:
    return pb.ListPrefixesResponse(prefixes=[prefix_info(r) for r in records])


_COUPLINGS = {pb.COUPLING_UNSPECIFIED: None, pb.SEEDED: "seeded", pb.REJECTION: "rejection"}


def sampling_choice(message: pb.GenerateRequest) -> SamplingChoice:
    if message.coupling not in _COUPLINGS:
        raise InvalidRequestError(f"unknown coupling {message.coupling}")
    return SamplingChoice(
        temperature=_optional(message, "temperature"),
        top_p=_optional(message, "top_p"),
        top_k=_optional(message, "top_k"),
        min_p=_optional(message, "min_p"),
        seed=_optional(message, "seed"),
        repetition_penalty=_optional(message, "repetition_penalty"),
        presence_penalty=_optional(message, "presence_penalty"),
        coupling=_COUPLINGS[message.coupling],
    )


def generate_call(message: pb.GenerateRequest) -> GenerateCall:
    if message.mode != pb.MODE_UNSPECIFIED and message.mode not in _MODES:
        raise InvalidRequestError(f"unknown mode {message.mode}")
    return GenerateCall(
        prompt=message.prompt,
        prefix_id=message.prefix_id or None,
        max_tokens=_optional(message, "max_tokens"),  # None: the server's default
        stop=tuple(message.stop),
        stop_token_ids=tuple(message.stop_token_ids),
        mode=_MODES.get(message.mode),
        draft_len=_optional(message, "draft_len"),
        sampling=sampling_choice(message),
        compressor=(
            compressor_choice(message.compressor) if message.HasField("compressor") else None
        ),
        steer_every=_optional(message, "steer_every"),  # None: the default
    )


def generate_response(event: GenerateEvent) -> pb.GenerateResponse:
    if isinstance(event, OutputChunk):
        return pb.GenerateResponse(chunk=pb.TokenChunk(text=event.text, token_ids=event.token_ids))
    return pb.GenerateResponse(stats=_stats(event))


def _stats(summary: GenerateSummary) -> pb.GenerateStats:
    return pb.GenerateStats(
        finish_reason=summary.finish_reason,
        num_tokens=summary.num_tokens,
        rounds=summary.rounds,
        mean_accepted_per_round=summary.mean_accepted_per_round,
        accepted_per_round=summary.accepted_per_round,
        link_bytes=summary.link_bytes,
        store_bytes=summary.store_bytes,
        link_wait_s=summary.link_wait_s,
        store_wait_s=summary.store_wait_s,
        ttft_s=summary.ttft_s,
        tokens_per_s=summary.tokens_per_s,
        total_s=summary.total_s,
        seed=summary.seed,
        prompt_tokens=summary.prompt_tokens,
        local_rounds=summary.local_rounds,
        kept_set_refreshes=summary.kept_set_refreshes,
        kept_set_refreshes_dropped=summary.kept_set_refreshes_dropped,
        path=summary.path,
        cached_tokens=summary.cached_tokens,
    )
