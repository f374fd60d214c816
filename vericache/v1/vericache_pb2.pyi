from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODE_UNSPECIFIED: _ClassVar[Mode]
    VERICACHE: _ClassVar[Mode]
    FULL_LOCAL: _ClassVar[Mode]
    FULL_REMOTE: _ClassVar[Mode]
    LOSSY: _ClassVar[Mode]
    AUTO: _ClassVar[Mode]

class Coupling(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COUPLING_UNSPECIFIED: _ClassVar[Coupling]
    SEEDED: _ClassVar[Coupling]
    REJECTION: _ClassVar[Coupling]
MODE_UNSPECIFIED: Mode
VERICACHE: Mode
FULL_LOCAL: Mode
FULL_REMOTE: Mode
LOSSY: Mode
AUTO: Mode
COUPLING_UNSPECIFIED: Coupling
SEEDED: Coupling
REJECTION: Coupling

class Compressor(_message.Message):
    __slots__ = ("name", "ratio", "bits", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RATIO_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    ratio: float
    bits: int
    dtype: str
    def __init__(self, name: _Optional[str] = ..., ratio: _Optional[float] = ..., bits: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class PutPrefixRequest(_message.Message):
    __slots__ = ("text", "token_ids", "compressor")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPRESSOR_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    compressor: Compressor
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., compressor: _Optional[_Union[Compressor, _Mapping]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PutPrefixProgress(_message.Message):
    __slots__ = ("prefix_id", "stage", "num_tokens", "done", "existed")
    PREFIX_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    prefix_id: str
    stage: str
    num_tokens: int
    done: bool
    existed: bool
    def __init__(self, prefix_id: _Optional[str] = ..., stage: _Optional[str] = ..., num_tokens: _Optional[int] = ..., done: bool = ..., existed: bool = ...) -> None: ...

class GetPrefixRequest(_message.Message):
    __slots__ = ("prefix_id",)
    PREFIX_ID_FIELD_NUMBER: _ClassVar[int]
    prefix_id: str
    def __init__(self, prefix_id: _Optional[str] = ...) -> None: ...

class PrefixInfo(_message.Message):
    __slots__ = ("prefix_id", "num_tokens", "compressor", "full_kv_bytes", "compressed_kv_bytes", "automatic")
    PREFIX_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPRESSOR_FIELD_NUMBER: _ClassVar[int]
    FULL_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPRESSED_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    AUTOMATIC_FIELD_NUMBER: _ClassVar[int]
    prefix_id: str
    num_tokens: int
    compressor: Compressor
    full_kv_bytes: int
    compressed_kv_bytes: int
    automatic: bool
    def __init__(self, prefix_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., compressor: _Optional[_Union[Compressor, _Mapping]] = ..., full_kv_bytes: _Optional[int] = ..., compressed_kv_bytes: _Optional[int] = ..., automatic: bool = ...) -> None: ...

class ListPrefixesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListPrefixesResponse(_message.Message):
    __slots__ = ("prefixes",)
    PREFIXES_FIELD_NUMBER: _ClassVar[int]
    prefixes: _containers.RepeatedCompositeFieldContainer[PrefixInfo]
    def __init__(self, prefixes: _Optional[_Iterable[_Union[PrefixInfo, _Mapping]]] = ...) -> None: ...

class DeletePrefixRequest(_message.Message):
    __slots__ = ("prefix_id",)
    PREFIX_ID_FIELD_NUMBER: _ClassVar[int]
    prefix_id: str
    def __init__(self, prefix_id: _Optional[str] = ...) -> None: ...

class DeletePrefixResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: bool = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prefix_id", "prompt", "max_tokens", "stop", "mode", "draft_len", "stop_token_ids", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty", "coupling", "compressor", "steer_every")
    PREFIX_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LEN_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    COUPLING_FIELD_NUMBER: _ClassVar[int]
    COMPRESSOR_FIELD_NUMBER: _ClassVar[int]
    STEER_EVERY_FIELD_NUMBER: _ClassVar[int]
    prefix_id: str
    prompt: str
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    mode: Mode
    draft_len: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    repetition_penalty: float
    presence_penalty: float
    coupling: Coupling
    compressor: Compressor
    steer_every: int
    def __init__(self, prefix_id: _Optional[str] = ..., prompt: _Optional[str] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., mode: _Optional[_Union[Mode, str]] = ..., draft_len: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., coupling: _Optional[_Union[Coupling, str]] = ..., compressor: _Optional[_Union[Compressor, _Mapping]] = ..., steer_every: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("chunk", "stats")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    chunk: TokenChunk
    stats: GenerateStats
    def __init__(self, chunk: _Optional[_Union[TokenChunk, _Mapping]] = ..., stats: _Optional[_Union[GenerateStats, _Mapping]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("text", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateStats(_message.Message):
    __slots__ = ("finish_reason", "num_tokens", "rounds", "mean_accepted_per_round", "accepted_per_round", "link_bytes", "store_bytes", "link_wait_s", "store_wait_s", "ttft_s", "tokens_per_s", "total_s", "seed", "prompt_tokens", "local_rounds", "path", "cached_tokens", "kept_set_refreshes", "kept_set_refreshes_dropped")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    LINK_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LINK_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    STORE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KEPT_SET_REFRESHES_FIELD_NUMBER: _ClassVar[int]
    KEPT_SET_REFRESHES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    num_tokens: int
    rounds: int
    mean_accepted_per_round: float
    accepted_per_round: _containers.RepeatedScalarFieldContainer[int]
    link_bytes: int
    store_bytes: int
    link_wait_s: float
    store_wait_s: float
    ttft_s: float
    tokens_per_s: float
    total_s: float
    seed: int
    prompt_tokens: int
    local_rounds: int
    path: str
    cached_tokens: int
    kept_set_refreshes: int
    kept_set_refreshes_dropped: int
    def __init__(self, finish_reason: _Optional[str] = ..., num_tokens: _Optional[int] = ..., rounds: _Optional[int] = ..., mean_accepted_per_round: _Optional[float] = ..., accepted_per_round: _Optional[_Iterable[int]] = ..., link_bytes: _Optional[int] = ..., store_bytes: _Optional[int] = ..., link_wait_s: _Optional[float] = ..., store_wait_s: _Optional[float] = ..., ttft_s: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., total_s: _Optional[float] = ..., seed: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., local_rounds: _Optional[int] = ..., path: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., kept_set_refreshes: _Optional[int] = ..., kept_set_refreshes_dropped: _Optional[int] = ...) -> None: ...
