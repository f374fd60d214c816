"""The verifier's store of full KV for registered prefixes, built on LMCache.

A registered prefix is a token sequence whose full KV (every layer, every token, in order, exact)
the verifier keeps, so a request that starts with it loads that KV instead of recomputing it.

Tiers: LMCache's local CPU tier (`cpu_bytes`, least recently used chunks evicted first) in front of
an fs:// tier under `root` that persists every chunk until it is deleted. LMCache's `local_disk`
tier is not used: it forgets its index on restart, the fs:// tier does not. `put` returns only once
every chunk of the prefix is on disk, so a prefix that was put survives a crash or restart.

Keys: chunk i of a prefix is keyed by a SHA-256 chain over (model fingerprint, namespace, token
ids of chunks 0..i) (lmcache.py), identical in every process and after restarts. Prefixes of
one namespace that share their first chunks share those chunks' storage; two namespaces (tenants)
share nothing, so neither can tell by a store hit what the other stored.

Tail: the tokens after the last whole chunk are stored by LMCache too (`save_unfull_chunk`), as a
short chunk keyed like the others. Its key covers the exact token ids, so it is found only for this
exact prefix, which is all a registered prefix needs; and it lives in the same tiers, so it is
persisted, evicted, looked up and deleted with the rest instead of through a second file format.

Integrity: every chunk has a BLAKE3 digest in a file of its own (chunk_digests.py), written by
`put` and checked by every `load` before the chunk reaches the cache; a chunk that fails, or has
no digest, makes `load` raise `StoreCorruptionError` and no cache is returned. The caller rebuilds
the prefix from its token ids (`discard`, then `put`).

Deleting: `delete` removes every chunk of the prefix from both tiers, including chunks shared with
another stored prefix; that prefix then reports `contains() == False` (and `load` raises) until it
is put again. The caller, which knows every registered prefix, decides what to delete.

Threads and processes: an LMCache engine is a per-process singleton meant to be driven by one
thread. Each store owns one engine under a unique instance id, and a lock serialises every call
into it, so a store may be shared by threads, one call at a time. Creating an engine sets the
multiprocessing start method to "spawn" for the whole process, and starts threads that are not
daemons: close every store (or use it as a context manager), or the process will not exit.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from vericache.errors import InvalidRequestError, VeriCacheError
from vericache.kv.cache import KVCache
from vericache.kv.codec import model_fingerprint
from vericache.kv.pool import BufferPool
from vericache.model.config import ModelConfig
from vericache.serve.store.chunk_digests import ChunkDigests
from vericache.serve.store.lmcache import (
    PERSISTENT_TIER,
    KVCacheConnector,
    as_token_tensor,
    build_engine,
    chunk_keys,
    destroy_engine,
    namespace_seed,
    tail_mask,
)

# Chunks moved per LMCache call are capped at this fraction of the CPU tier: every chunk passes
# through it, and a call that cannot allocate all its chunks stores only some of them.
_CPU_TIER_SHARE_PER_CALL = 4


class PrefixNotStoredError(VeriCacheError):
    """The prefix's full KV is not (or no longer entirely) in the store."""


class StoreWriteError(VeriCacheError):
    """The store could not make a prefix's KV persistent."""


class StoreCorruptionError(VeriCacheError):
    """A stored chunk of the prefix failed its digest check (or had no digest)."""


class StoreClosedError(VeriCacheError):
    """The store was used after `close()`."""


@dataclass(frozen=True)
class StoredPrefix:
    num_tokens: int
    nbytes: int  # KV bytes of the whole prefix
    bytes_written: int  # KV bytes this put wrote: 0 when the prefix was stored already
    seconds: float


@dataclass
class LoadResult:
    cache: KVCache  # full cache of the prefix: num_tokens == len(prefix), positions 0..T-1
    bytes_loaded: int  # KV bytes of the prefix (keys and values, every layer)
    seconds: float


class FullKVStore:
    """Full KV of registered prefixes for one model and dtype, persisted under `root`.

    Accounting, summed over the store's life: `bytes_stored` and `store_seconds` (puts that wrote),
    `bytes_loaded` and `load_seconds` (loads).
    """

    def __init__(
        self,
        root: Path,
        model_config: ModelConfig,
        model_name: str,
        dtype: torch.dtype,
        cpu_bytes: int,
        chunk_size: int = 256,
        instance_id: str | None = None,
        write_timeout_s: float = 60.0,
    ):
        self.model_config = model_config
        self.dtype = dtype
        self.chunk_size = chunk_size
        self.bytes_per_token = model_config.kv_bytes_per_token(torch.finfo(dtype).bits // 8)
        self._tokens_per_call = self._tokens_per_call_for(cpu_bytes)
        self.write_timeout_s = write_timeout_s
        self.instance_id = instance_id or f"vericache-store-{uuid.uuid4().hex[:12]}"
        self.bytes_stored = 0
        self.store_seconds = 0.0
        self.bytes_loaded = 0
        self.load_seconds = 0.0
        self._lock = threading.Lock()
        Path(root).mkdir(parents=True, exist_ok=True)
        fingerprint = model_fingerprint(model_config, model_name)
        self._fingerprint = fingerprint
        self._digests = ChunkDigests(Path(root))
        self._connector = KVCacheConnector(model_config)
        self._engine = build_engine(
            self.instance_id,
            Path(root),
            model_config,
            fingerprint,
            dtype,
            cpu_bytes,
            chunk_size,
            self._connector,
        )
        self._is_closed = False

    def _tokens_per_call_for(self, cpu_bytes: int) -> int:
        chunk_bytes = self.chunk_size * self.bytes_per_token
        chunks_per_call = cpu_bytes // (_CPU_TIER_SHARE_PER_CALL * chunk_bytes)
        if chunks_per_call < 1:
            raise InvalidRequestError(
                f"cpu_bytes={cpu_bytes} is too small: chunks of {self.chunk_size} tokens need a "
                f"CPU tier of at least {_CPU_TIER_SHARE_PER_CALL * chunk_bytes} bytes"
            )
        return chunks_per_call * self.chunk_size

    # --- Public API ------------------------------------------------------------------------------

    def put(self, token_ids: Sequence[int], cache: KVCache, namespace: str = "") -> StoredPrefix:
        """Store the full KV of prefix `token_ids`; idempotent. Returns once it is on disk."""
        tokens = self._checked_tokens(token_ids)
        self._check_full_cache(cache, len(tokens))
        num_tokens = len(tokens)
        with self._lock:
            self._enter(namespace)
            started = time.perf_counter()
            # Chunks already on disk (this prefix, or another sharing its first chunks) are kept.
            first = self._engine.lookup(tokens, search_range=[PERSISTENT_TIER])
            if first < num_tokens:
                self._connector.keys = self._keys_by_start(tokens)
                self._connector.digests = {}
                for start, end in self._calls(first, num_tokens):
                    self._store_range(tokens[:end], start, cache)
                for key, digest in self._connector.digests.items():
                    self._digests.write(key, digest)
            seconds = time.perf_counter() - started
            bytes_written = (num_tokens - first) * self.bytes_per_token
            if bytes_written:
                self.bytes_stored += bytes_written
                self.store_seconds += seconds
        return StoredPrefix(num_tokens, num_tokens * self.bytes_per_token, bytes_written, seconds)

    def load(
        self,
        token_ids: Sequence[int],
        capacity: int = 0,
        device: torch.device | str = "cpu",
        pool: BufferPool | None = None,
        namespace: str = "",
    ) -> LoadResult:
        """The full KV of a stored prefix, bit-exact; `capacity` reserves slots for later tokens
        (in buffers from `pool` where it has some)."""
        tokens = self._checked_tokens(token_ids)
        num_tokens = len(tokens)
        config = self.model_config
        with self._lock:
            self._enter(namespace)
            started = time.perf_counter()
            cache = KVCache.empty(
                config.num_layers,
                config.num_kv_heads,
                config.head_dim,
                self.dtype,
                device,
                capacity=max(capacity, num_tokens),
                pool=pool,
            )
            self._expect_digests(tokens)
            for start, end in self._calls(0, num_tokens):
                self._engine.retrieve(tokens[:end], mask=tail_mask(end, start), kv=cache)
                if self._connector.corrupt_starts:
                    failed = self._connector.corrupt_starts[0]
                    raise StoreCorruptionError(
                        f"the stored chunk at token {failed} failed its digest check"
                    )
                if cache.num_tokens != end:  # every chunk has its digest: it was put whole
                    raise StoreCorruptionError(
                        f"the stored chunk at token {cache.num_tokens} could not be read"
                    )
            seconds = time.perf_counter() - started
            self.bytes_loaded += cache.nbytes
            self.load_seconds += seconds
        return LoadResult(cache, cache.nbytes, seconds)

    def contains(self, token_ids: Sequence[int], namespace: str = "") -> bool:
        """True when the full KV of exactly this prefix is stored (in any tier)."""
        tokens = self._checked_tokens(token_ids)
        with self._lock:
            self._enter(namespace)
            return self._engine.lookup(tokens) == len(tokens)

    def delete(self, token_ids: Sequence[int], namespace: str = "") -> None:
        """Remove every chunk of a stored prefix from both tiers (see the module note on sharing).
        A prefix that is not entirely stored is left alone: its chunks may belong to others."""
        tokens = self._checked_tokens(token_ids)
        with self._lock:
            self._enter(namespace)
            if self._engine.lookup(tokens) == len(tokens):
                self._clear(tokens)

    def discard(self, token_ids: Sequence[int], namespace: str = "") -> None:
        """Remove whatever is stored of a prefix (a corrupt one, before it is put again)."""
        tokens = self._checked_tokens(token_ids)
        with self._lock:
            self._enter(namespace)
            self._clear(tokens)

    def close(self) -> None:
        """Shut the engine down (its CPU tier is freed; the disk tier stays). Safe to repeat."""
        with self._lock:
            if not self._is_closed:
                self._is_closed = True
                destroy_engine(self.instance_id)

    def __enter__(self) -> FullKVStore:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # --- Helpers ---------------------------------------------------------------------------------

    def _store_range(self, tokens: torch.Tensor, start: int, cache: KVCache) -> None:
        """Store chunks [start, T) of the prefix `tokens` [T]; returns once they are on disk."""
        end = len(tokens)
        self._connector.num_tokens_stored = 0
        self._engine.store(tokens, mask=tail_mask(end, start), kv=cache)
        if self._connector.num_tokens_stored != end - start:
            raise StoreWriteError(
                f"the CPU tier could not take tokens [{start}, {end}): raise cpu_bytes"
            )
        deadline = time.perf_counter() + self.write_timeout_s
        pause = 0.001
        while self._engine.lookup(tokens, search_range=[PERSISTENT_TIER]) < end:
            if time.perf_counter() > deadline:
                raise StoreWriteError(
                    f"tokens [{start}, {end}) were not written to disk within "
                    f"{self.write_timeout_s} s: check free space and permissions of the store root"
                )
            time.sleep(pause)
            pause = min(2 * pause, 0.05)

    def _enter(self, namespace: str) -> None:
        """Starts a call (under the lock): every key it makes chains from `namespace`'s seed."""
        self._check_open()
        self._engine.token_database.seed = namespace_seed(self._fingerprint, namespace)

    def _clear(self, tokens: torch.Tensor) -> None:
        self._engine.clear(tokens=tokens)
        for key in self._keys_by_start(tokens).values():
            self._digests.remove(key)

    def _keys_by_start(self, tokens: torch.Tensor) -> dict[int, int]:
        # The keys LMCache makes in this call, from the seed of its namespace (`_enter`).
        keys = chunk_keys(self._engine.token_database.seed, tokens, self.chunk_size)
        return {index * self.chunk_size: key for index, key in enumerate(keys)}

    def _expect_digests(self, tokens: torch.Tensor) -> None:
        """Arms the connector's check; a chunk without a digest fails before anything is read."""
        keys = self._keys_by_start(tokens)
        expected = {start: self._digests.read(key) for start, key in keys.items()}
        missing = [start for start, digest in expected.items() if digest is None]
        if missing and self._engine.lookup(tokens) < len(tokens):
            raise PrefixNotStoredError("the prefix is not stored: put it before loading it")
        if missing:
            raise StoreCorruptionError(f"the stored chunk at token {missing[0]} has no digest")
        self._connector.keys = keys
        self._connector.expected = expected
        self._connector.corrupt_starts = []

    def _calls(self, first: int, num_tokens: int) -> Iterator[tuple[int, int]]:
        """Token ranges of at most `_tokens_per_call`, on chunk boundaries, covering [first, T)."""
        for start in range(first, num_tokens, self._tokens_per_call):
            yield start, min(start + self._tokens_per_call, num_tokens)

    def _checked_tokens(self, token_ids: Sequence[int]) -> torch.Tensor:
        if len(token_ids) == 0:
            raise InvalidRequestError("a prefix needs at least one token")
        return as_token_tensor(token_ids)

    def _check_full_cache(self, cache: KVCache, num_tokens: int) -> None:
        config = self.model_config
        if not cache.is_full or cache.num_tokens != num_tokens:
            raise InvalidRequestError(
                f"put needs the uncompressed KV of all {num_tokens} prefix tokens "
                f"(got a cache of {cache.num_tokens} tokens, full={cache.is_full})"
            )
        keys, _ = cache.layers[0].keys_values()
        layout = (len(cache.layers), *keys.shape[1:], keys.dtype)
        expected = (config.num_layers, config.num_kv_heads, config.head_dim, self.dtype)
        if layout != expected:
            raise InvalidRequestError(
                f"cache layout (layers, kv_heads, head_dim, dtype) {layout} is not the store's "
                f"{expected}"
            )

    def _check_open(self) -> None:
        if self._is_closed:
            raise StoreClosedError(f"store {self.instance_id} is closed: create a new one")
