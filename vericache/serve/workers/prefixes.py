"""A verifier's registered prefixes: full KV in the LMCache store, compressed KV in the catalog.

Registration runs in three calls, so that the coordinator can report each stage: prefill (staged
here between calls), store (full KV into the store), compress (compressed KV into the catalog). A
prefix whose full KV is stored already skips the first two. A registration abandoned between calls
leaves its staged KV, which expires (staging.py) unless the coordinator discards it at once; a
prefill still running when its registration is discarded stops at its next chunk, and the discard
returns once it has stopped (the coordinator holds the tenant's slot until then).

Repair: stored data is checked wherever it is read (store/full_kv.py, store/catalog.py). Full KV
that fails is rebuilt from the prefix's token ids by the same prefill that made it (the verifier's
kernels give it the same bits) and stored again; compressed KV that fails is compressed again from
the full KV. A request that met either goes on with output identical to an undisturbed one; what
cannot be rebuilt raises DataLossError. Each failure is reported once, with the next load's Traffic.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vericache.compress.context import ModelContext
from vericache.errors import DataLossError, InvalidRequestError, VeriCacheError
from vericache.kv.cache import KVCache
from vericache.kv.codec_errors import CodecError
from vericache.kv.pool import BufferPool
from vericache.kv.state import CacheState
from vericache.model.loader import DTYPES, LoadedModel
from vericache.model.runner import ModelRunner
from vericache.serve.config import VerifierConfig
from vericache.serve.store.catalog import (
    PrefixCatalog,
    PrefixKey,
    PrefixRecord,
    StoredKind,
    compressor_of,
)
from vericache.serve.store.full_kv import FullKVStore, LoadResult, StoreCorruptionError
from vericache.serve.store.staging import StagedPrefixes
from vericache.serve.workers.worker_api import ModelInfo, Traffic

log = logging.getLogger(__name__)


class RegistrationAbandonedError(VeriCacheError):
    """The registration was discarded (cancelled, or past its deadline) while it prefilled."""


@dataclass
class _Prefill:
    """A registration's prefill on its way: `abandoned` asks it to stop, `stopped` says it has."""

    abandoned: threading.Event = field(default_factory=threading.Event)
    stopped: threading.Event = field(default_factory=threading.Event)


class PrefixRegistry:
    def __init__(
        self, config: VerifierConfig, loaded: LoadedModel, runner: ModelRunner, info: ModelInfo
    ):
        self.config = config
        self.runner = runner
        self.tokenizer = loaded.tokenizer
        self.info = info
        self.store = FullKVStore(
            Path(config.root) / "kv",
            loaded.config,
            config.model,
            DTYPES[config.dtype],
            config.store_cpu_bytes,
        )
        self._corruptions: list[StoredKind] = []  # found since the last `take_corruptions`
        self._corruptions_lock = threading.Lock()  # the KV transfer server's thread finds some
        self.catalog = PrefixCatalog(config.root, info.fingerprint, self._report)
        self._staged = StagedPrefixes(config.max_staged_prefixes, config.staged_ttl_s)
        self._prefills: dict[tuple[str, tuple[int, ...]], _Prefill] = {}  # by staged key
        self._prefills_lock = threading.Lock()

    def prefill(self, key: PrefixKey) -> None:
        self.check_tokens(key.token_ids)
        self._staged.expire()
        staged = (key.tenant, key.token_ids)
        if self._staged.get(staged) is not None or self._is_stored(key):
            return
        self._staged.put(staged, self._registration_prefill(key))

    def put_in_store(self, key: PrefixKey) -> Traffic:
        """Puts the prefilled full KV in the store; returns once it is on disk."""
        self._staged.expire()
        staged = (key.tenant, key.token_ids)
        cache = self._staged.get(staged)
        if cache is None:
            if self._is_stored(key):
                return Traffic()
            # Staged KV dropped since the prefill stage (expired, or evicted by newer ones).
            self.check_tokens(key.token_ids)
            cache = self._registration_prefill(key)
            self._staged.put(staged, cache)
        stored = self.store.put(key.token_ids, cache, namespace=key.tenant)
        return Traffic(store_bytes=stored.bytes_written, store_s=stored.seconds)

    def discard_staged(self, key: PrefixKey, stop_timeout_s: float = 60.0) -> bool:
        """Drops the full KV staged for an abandoned registration, once a prefill of it still
        running has stopped; False when none was staged."""
        staged = (key.tenant, key.token_ids)
        with self._prefills_lock:
            running = self._prefills.get(staged)
        if running is not None:
            running.abandoned.set()
            running.stopped.wait(stop_timeout_s)
        return self._staged.take(staged) is not None

    @property
    def staged_bytes(self) -> int:
        """Bytes of full KV staged for registrations in progress (or abandoned, until expired)."""
        return self._staged.nbytes

    def compress(self, key: PrefixKey) -> PrefixRecord:
        """Compresses a stored prefix and registers it."""
        prefix_id = key.prefix_id(self.info.fingerprint)
        full = self._staged.take((key.tenant, key.token_ids))
        if self.catalog.contains(prefix_id):
            return self.catalog.get(prefix_id)
        if full is None:
            full = self.load_full(key.token_ids, key.tenant, 0).cache
        context = ModelContext(self.runner, key.token_ids, self.tokenizer)
        compressed = key.compressor.compress(full, context)
        spec = key.compressor.spec()
        record = PrefixRecord(
            prefix_id, key.token_ids, key.chat, spec, full.nbytes, 0, key.tenant, key.automatic
        )
        return self.catalog.add(record, compressed.to_state())

    def get(self, prefix_id: str) -> PrefixRecord:
        self._staged.expire()  # called for every request and registration: a regular sweep
        return self.catalog.get(prefix_id)

    def records(self) -> list[PrefixRecord]:
        return self.catalog.records()

    def delete(self, prefix_id: str) -> PrefixRecord:
        record = self.catalog.remove(prefix_id)
        # The store shares chunks between prefixes with the same first tokens: keep the full KV
        # while another registered prefix starts like this one.
        head = record.token_ids[: self.store.chunk_size]
        sharing = [r for r in self.catalog.records() if r.tenant == record.tenant]
        if not any(other.token_ids[: len(head)] == head for other in sharing):
            self.store.delete(record.token_ids, namespace=record.tenant)
        return record

    def load_full(
        self,
        token_ids: tuple[int, ...],
        namespace: str,
        capacity: int,
        pool: BufferPool | None = None,
    ) -> LoadResult:
        """A stored prefix's full KV (its owner's `namespace` of the store), with room for
        `capacity` tokens; rebuilt first where it failed its check."""
        try:
            return self.store.load(token_ids, capacity, pool=pool, namespace=namespace)
        except StoreCorruptionError as exc:
            log.error("the full KV of a %d-token prefix is rebuilt: %s", len(token_ids), exc)
            self._report(StoredKind.FULL_KV)
        self.store.discard(token_ids, namespace=namespace)
        self.store.put(token_ids, self._prefilled(token_ids), namespace=namespace)
        try:
            return self.store.load(token_ids, capacity, pool=pool, namespace=namespace)
        except StoreCorruptionError:  # the store damages what it has just written
            raise DataLossError("the full-KV store fails its checks as it is written") from None

    def compressed_state(self, prefix_id: str) -> CacheState:
        """A prefix's compressed KV; compressed again from its full KV where it failed its check."""
        try:
            return self.catalog.compressed_state(prefix_id)
        except (CodecError, FileNotFoundError) as exc:
            log.error("prefix %s: its compressed KV is rebuilt: %s", prefix_id, type(exc).__name__)
            self._report(StoredKind.COMPRESSED_KV)
        record = self.catalog.get(prefix_id)
        full = self.load_full(record.token_ids, record.tenant, 0).cache
        context = ModelContext(self.runner, record.token_ids, self.tokenizer)
        state = compressor_of(record).compress(full, context).to_state()
        self.catalog.replace_compressed(prefix_id, state)
        return state

    def take_corruptions(self) -> tuple[StoredKind, ...]:
        """The failures found since the last call, each reported once."""
        with self._corruptions_lock:
            taken, self._corruptions = tuple(self._corruptions), []
        return taken

    def _report(self, kind: StoredKind) -> None:
        with self._corruptions_lock:
            self._corruptions.append(kind)

    def close(self) -> None:
        self._staged.clear()
        self.store.close()

    def check_tokens(self, token_ids: tuple[int, ...]) -> None:
        if not token_ids:
            raise InvalidRequestError("no token ids given")
        if len(token_ids) >= self.info.max_positions:
            raise InvalidRequestError(
                f"{len(token_ids)} tokens: the model's context is {self.info.max_positions}, "
                "and at least one must remain for output"
            )
        if not all(0 <= t < self.info.vocab_size for t in token_ids):
            raise InvalidRequestError(f"token ids must lie in [0, {self.info.vocab_size})")

    def _is_stored(self, key: PrefixKey) -> bool:
        return self.store.contains(key.token_ids, namespace=key.tenant)

    def _registration_prefill(self, key: PrefixKey) -> KVCache:
        """`_prefilled`, stopped at the next chunk when the registration is discarded."""
        staged = (key.tenant, key.token_ids)
        with self._prefills_lock:
            prefill = self._prefills.setdefault(staged, _Prefill())
        try:
            return self._prefilled(key.token_ids, prefill.abandoned)
        finally:
            with self._prefills_lock:
                self._prefills.pop(staged, None)
            prefill.stopped.set()

    def _prefilled(
        self, token_ids: tuple[int, ...], abandoned: threading.Event | None = None
    ) -> KVCache:
        """The full KV of `token_ids`, prefilled chunk by chunk (the chunks of a registration:
        the same forwards, so the same bits, whoever prefills)."""
        cache = self.runner.new_cache(capacity=len(token_ids))
        ids = torch.tensor(token_ids, dtype=torch.long)
        chunk = self.config.prefill_chunk
        for start in range(0, len(ids), chunk):
            if abandoned is not None and abandoned.is_set():
                raise RegistrationAbandonedError("the registration was abandoned")
            self.runner.prefill(ids[start : start + chunk], cache, num_logits=0, chunk_size=chunk)
        return cache
