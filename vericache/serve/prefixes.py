"""A verifier's registered prefixes: full KV in the LMCache store, compressed KV in the catalog.

Registration runs in three calls, so that the coordinator can report each stage: prefill (staged
here between calls), store (full KV into the store), compress (compressed KV into the catalog). A
prefix whose full KV is stored already skips the first two. A registration abandoned between calls
leaves its staged KV, which expires (staging.py) unless the coordinator discards it at once.
"""

from __future__ import annotations

from pathlib import Path

import torch

from vericache.compress import build_compressor
from vericache.compress.context import ModelContext
from vericache.errors import InvalidRequestError
from vericache.kv.cache import KVCache
from vericache.kv.pool import BufferPool
from vericache.kv.state import CacheState
from vericache.model.loader import DTYPES, LoadedModel
from vericache.model.runner import ModelRunner
from vericache.serve.catalog import PrefixCatalog, PrefixRecord, prefix_id_for
from vericache.serve.config import VerifierConfig
from vericache.serve.kv_transfer import KVKind
from vericache.serve.staging import StagedPrefixes
from vericache.serve.store import FullKVStore, LoadResult
from vericache.serve.worker_api import CompressPrefix, ModelInfo, Traffic


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
        self.catalog = PrefixCatalog(config.root, info.fingerprint)
        self._staged = StagedPrefixes(config.max_staged_prefixes, config.staged_ttl_s)

    def prefill(self, token_ids: tuple[int, ...]) -> None:
        self.check_tokens(token_ids)
        self._staged.expire()
        if self._staged.get(token_ids) is not None or self.store.contains(token_ids):
            return
        self._staged.put(token_ids, self._prefilled(token_ids))

    def put_in_store(self, token_ids: tuple[int, ...]) -> Traffic:
        """Puts the prefilled full KV in the store; returns once it is on disk."""
        self._staged.expire()
        cache = self._staged.get(token_ids)
        if cache is None:
            if self.store.contains(token_ids):
                return Traffic()
            # Staged KV dropped since the prefill stage (expired, or evicted by newer ones).
            self.check_tokens(token_ids)
            cache = self._prefilled(token_ids)
            self._staged.put(token_ids, cache)
        stored = self.store.put(token_ids, cache)
        return Traffic(store_bytes=stored.bytes_written, store_s=stored.seconds)

    def discard_staged(self, token_ids: tuple[int, ...]) -> bool:
        """Drops the full KV staged for an abandoned registration; False when none was staged."""
        return self._staged.take(token_ids) is not None

    @property
    def staged_bytes(self) -> int:
        """Bytes of full KV staged for registrations in progress (or abandoned, until expired)."""
        return self._staged.nbytes

    def compress(self, call: CompressPrefix) -> PrefixRecord:
        """Compresses a stored prefix and registers it."""
        spec = call.compressor_spec
        compressor = build_compressor(spec["name"], **spec["params"])  # validates the spec
        prefix_id = prefix_id_for(self.info.fingerprint, call.token_ids, call.chat, spec)
        full = self._staged.take(call.token_ids)
        if self.catalog.contains(prefix_id):
            return self.catalog.get(prefix_id)
        if full is None:
            full = self.store.load(call.token_ids).cache
        context = ModelContext(self.runner, call.token_ids, self.tokenizer)
        compressed = compressor.compress(full, context)
        record = PrefixRecord(
            prefix_id, call.token_ids, call.chat, compressor.spec(), full.nbytes, 0
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
        if not any(other.token_ids[: len(head)] == head for other in self.catalog.records()):
            self.store.delete(record.token_ids)
        return record

    def load_full(
        self, token_ids: tuple[int, ...], capacity: int, pool: BufferPool | None = None
    ) -> LoadResult:
        """A stored prefix's full KV, with room for `capacity` tokens."""
        return self.store.load(token_ids, capacity=capacity, pool=pool)

    def kv_for_drafter(self, prefix_id: str, kind: int) -> CacheState:
        """KVTransfer's source (called from the transfer server's thread)."""
        if kind == KVKind.FULL:
            return self.store.load(self.catalog.get(prefix_id).token_ids).cache.to_state()
        return self.catalog.compressed_state(prefix_id)

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

    def _prefilled(self, token_ids: tuple[int, ...]) -> KVCache:
        """The full KV of `token_ids`, prefilled chunk by chunk."""
        cache = self.runner.new_cache(capacity=len(token_ids))
        ids = torch.tensor(token_ids, dtype=torch.long)
        self.runner.prefill(ids, cache, num_logits=0, chunk_size=self.config.prefill_chunk)
        return cache
