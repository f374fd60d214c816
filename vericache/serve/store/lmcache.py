"""The LMCache side of the full-KV store: stable chunk keys, a CPU connector, and the engine.

LMCache (v1 API) hands its chunks to a connector and never copies KV itself; none ships for plain
CPU tensors, so `KVCacheConnector` copies between a `KVCache` and LMCache chunks. A chunk is
[2, num_layers, num_tokens, num_kv_heads * head_dim] (keys then values), num_tokens <= chunk_size.

Keys: without vLLM, LMCache chains Python's `hash` over token tuples, which is not tied to the model
and is only as stable as the interpreter's hash. `PrefixChunkDatabase` chains SHA-256 instead,
seeded with the model fingerprint, so the key of a chunk is the same in every process and after a
restart, and identifies (model, dtype, every token id up to the chunk's end).

Integrity: the connector digests every chunk it hands to LMCache and checks every chunk LMCache
hands back against the digest the store expects (chunk_digests.py); a chunk that fails is not
copied into the cache, and the store raises.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from lmcache.utils import mock_up_broadcast_fn, mock_up_broadcast_object_fn
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.token_database import ChunkedTokenDatabase

from vericache.errors import CacheStateError, InvalidRequestError
from vericache.kv.cache import KVCache
from vericache.model.config import ModelConfig
from vericache.serve.store.chunk_digests import chunk_digest

# Names LMCache gives its tiers (values of `search_range` and `locations`).
CPU_TIER = "LocalCPUBackend"
PERSISTENT_TIER = "RemoteBackend"

_HASH_BYTES = 8
_HASH_MASK = (1 << 63) - 1  # non-negative and within int64 wherever LMCache packs a key


def chained_chunk_hash(previous: int, token_ids: np.ndarray) -> int:
    """Key of a chunk: SHA-256 of the previous chunk's key and this chunk's token ids."""
    payload = previous.to_bytes(_HASH_BYTES, "big") + token_ids.astype("<i8").tobytes()
    digest = hashlib.sha256(payload).digest()
    return int.from_bytes(digest[:_HASH_BYTES], "big") & _HASH_MASK


def fingerprint_seed(fingerprint: str) -> int:
    """Key 'before the first chunk': ties every chain to one model and model name."""
    digest = hashlib.sha256(fingerprint.encode()).digest()
    return int.from_bytes(digest[:_HASH_BYTES], "big") & _HASH_MASK


def chunk_keys(seed: int, token_ids: torch.Tensor, chunk_size: int) -> list[int]:
    """The key of each chunk of a prefix [T], as `PrefixChunkDatabase` makes them."""
    token_ids = token_ids.numpy()
    keys, previous = [], seed
    for start in range(0, len(token_ids), chunk_size):
        previous = chained_chunk_hash(previous, token_ids[start : start + chunk_size])
        keys.append(previous)
    return keys


def namespace_seed(fingerprint: str, namespace: str) -> int:
    """The chain's start for one namespace of the store (a tenant): the same token ids in two
    namespaces share no chunk. The empty namespace keeps the model's own seed."""
    return fingerprint_seed(f"{fingerprint}\0namespace={namespace}" if namespace else fingerprint)


class PrefixChunkDatabase(ChunkedTokenDatabase):
    """LMCache's chunking (chunk_size tokens, last chunk possibly shorter) with SHA-256 keys,
    chained from `seed`: the store sets it to its namespace's before each call into LMCache."""

    def __init__(self, config: LMCacheEngineConfig, metadata: LMCacheMetadata, fingerprint: str):
        super().__init__(config, metadata)
        self.seed = fingerprint_seed(fingerprint)

    def _get_init_hash(self) -> int:
        return self.seed

    def _hash_tokens(self, tokens, prefix_hash=None, extra_keys=None) -> int:
        token_ids = tokens.cpu().numpy() if isinstance(tokens, torch.Tensor) else np.array(tokens)
        return chained_chunk_hash(self.seed if prefix_hash is None else prefix_hash, token_ids)


class KVCacheConnector(GPUConnectorInterface):
    """Copies between the `KVCache` passed as `kv=` and LMCache chunks, on the CPU.

    Store path (`from_gpu`): reads tokens [start, end) of a full cache and digests the chunk (key:
    `keys[start]`). Retrieve path (`to_gpu`): checks each chunk against `expected[start]` and
    appends it to the cache being filled, which must hold exactly `start` tokens; chunks are applied
    in token order. After the first chunk that fails, none is applied (`corrupt_starts` says which
    failed). The store sets `keys` and `expected` before each call into LMCache.
    """

    def __init__(self, model_config: ModelConfig):
        self.num_layers = model_config.num_layers
        self.num_kv_heads = model_config.num_kv_heads
        self.head_dim = model_config.head_dim
        # Tokens copied into LMCache chunks since the last reset: LMCache stores only the chunks
        # it could allocate in its CPU tier and says so only in a log line.
        self.num_tokens_stored = 0
        self.keys: dict[int, int] = {}  # chunk start -> chunk key, of the prefix in hand
        self.digests: dict[int, bytes] = {}  # chunk key -> digest, of the chunks stored
        self.expected: dict[int, bytes | None] = {}  # chunk start -> digest, for a retrieve
        self.corrupt_starts: list[int] = []

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.num_kv_heads * self.head_dim])

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, *, kv: KVCache, **_) -> None:
        # [2, L, t, H * D] -> [2, L, t, H, D]
        chunk = memory_obj.tensor.unflatten(-1, (self.num_kv_heads, self.head_dim))
        for index, layer in enumerate(kv.layers):
            keys, values = layer.keys_values()  # [T, H, D], strided views
            chunk[0, index].copy_(keys[start:end])
            chunk[1, index].copy_(values[start:end])
        key = self.keys[start]
        self.digests[key] = chunk_digest(key, memory_obj.tensor[:, :, : end - start])
        self.num_tokens_stored += end - start

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, *, kv: KVCache, **_) -> None:
        num_tokens = end - start
        chunk = memory_obj.tensor[:, :, :num_tokens]  # [2, L, t, H * D]
        if self.corrupt_starts or not self._is_intact(start, chunk):
            self.corrupt_starts.append(start)
            return
        if start != kv.num_tokens:
            raise CacheStateError(
                f"chunk [{start}, {end}) arrived while the cache holds {kv.num_tokens} tokens"
            )
        chunk = chunk.unflatten(-1, (self.num_kv_heads, self.head_dim))  # [2, L, t, H, D]
        positions = torch.arange(start, end, dtype=torch.int32, device=kv.device)  # [t]
        for index, layer in enumerate(kv.layers):
            layer.append(chunk[0, index], chunk[1, index], positions)
        kv.advance(num_tokens)

    def _is_intact(self, start: int, chunk: torch.Tensor) -> bool:
        expected = self.expected.get(start)
        return expected is not None and chunk_digest(self.keys[start], chunk) == expected

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(memory_obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs) -> None:
        # Chunks arrive grouped by tier (CPU hits first), not necessarily in token order.
        in_order = sorted(zip(starts, ends, memory_objs, strict=True), key=lambda item: item[0])
        for start, end, memory_obj in in_order:
            self.to_gpu(memory_obj, start, end, **kwargs)


def build_engine(
    instance_id: str,
    root: Path,
    model_config: ModelConfig,
    fingerprint: str,
    dtype: torch.dtype,
    cpu_bytes: int,
    chunk_size: int,
    connector: KVCacheConnector,
) -> LMCacheEngine:
    """A ready LMCache engine: a CPU tier of `cpu_bytes` and an fs:// tier under `root`."""
    # Read when the engine starts; without it LMCache reports usage to an outside host.
    os.environ["LMCACHE_TRACK_USAGE"] = "false"
    if LMCacheEngineBuilder.get(instance_id) is not None:
        raise InvalidRequestError(
            f"an LMCache engine {instance_id!r} exists already in this process: pick another id"
        )
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=chunk_size,
        local_cpu=True,
        max_local_cpu_size=cpu_bytes / 2**30,
        # The host part is required: `fs:///abs/dir` is rejected, silently, as a miss.
        remote_url=f"fs://localhost:0/{root.resolve().as_posix().lstrip('/')}/",
        remote_serde="naive",
        save_unfull_chunk=True,
        # Existence checks as plain stat calls, not round trips through LMCache's event loop.
        extra_config={"use_exists_sync": True},
    )
    num_layers, num_kv_heads = model_config.num_layers, model_config.num_kv_heads
    metadata = LMCacheMetadata(
        model_name=fingerprint.replace(":", "-"),
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=dtype,
        kv_shape=(num_layers, 2, chunk_size, num_kv_heads, model_config.head_dim),
        chunk_size=chunk_size,
    )
    engine = LMCacheEngineBuilder.get_or_create(
        instance_id, config, metadata, connector, mock_up_broadcast_fn, mock_up_broadcast_object_fn
    )
    # The builder offers no hook for the token database; swap ours in before anything is keyed
    # (store, lookup, retrieve and clear all go through `engine.token_database`). The PYTHONHASHSEED
    # warnings LMCache logs while building its default database do not apply to these keys.
    engine.token_database = PrefixChunkDatabase(config, metadata, fingerprint)
    engine.post_init(async_lookup_server=None)
    return engine


def destroy_engine(instance_id: str) -> None:
    LMCacheEngineBuilder.destroy(instance_id)


def tail_mask(num_tokens: int, start: int) -> torch.Tensor:
    """LMCache's mask for 'only tokens [start, num_tokens)'; start is a chunk boundary. # [T]"""
    mask = torch.ones(num_tokens, dtype=torch.bool)
    mask[:start] = False
    return mask


def as_token_tensor(token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    if isinstance(token_ids, torch.Tensor):
        return token_ids.to("cpu", torch.int64).flatten()  # [T]
    return torch.tensor(list(token_ids), dtype=torch.int64)  # [T]
