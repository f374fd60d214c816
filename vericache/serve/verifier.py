"""The verifier: the worker beside the full-KV store ("local" side).

It registers prefixes (prefill once, full KV into the LMCache store, compressed KV into the
catalog), serves compressed and full KV to drafters through the KVTransfer service and the link,
and runs the full-KV half of every request: the prefill of its prompt, the verification of each
round of drafts (FULL_LOCAL: plain greedy decoding).

Residency: the verifier holds at most `resident_bytes` of full KV across sessions (a session
larger than that alone). Past it, the least recently used sessions not in use drop their prefix's
KV and keep only the KV of the tokens after it; their next call reloads the prefix from the store
(at `load_bandwidth` where set: emulated PCIe), waiting for room while the full KV of calls in
progress, or loaded ahead of a verification, fills the budget. Every call reports the bytes it
loaded from the store and the time it took.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from vericache.compress import build_compressor
from vericache.compress.context import ModelContext
from vericache.engine.calibration import measure_link_bandwidth
from vericache.engine.device_memory import slot_bytes
from vericache.engine.forward_loop import Job
from vericache.engine.sequence import num_accepted
from vericache.errors import InvalidRequestError
from vericache.kv.cache import KVCache
from vericache.model.loader import DTYPES
from vericache.serve.batching import BatchLoop
from vericache.serve.catalog import PrefixCatalog, PrefixRecord, prefix_id_for
from vericache.serve.config import VerifierConfig
from vericache.serve.kv_transfer import KVKind, KVTransferService, TransferServer
from vericache.serve.link import LinkSpec, ThrottledLink
from vericache.serve.staging import StagedPrefixes
from vericache.serve.store import FullKVStore
from vericache.serve.worker import (
    ExactKV,
    SessionNotFoundError,
    WorkResult,
    first_token,
    load_worker_model,
)

# verify()'s arguments: session_id, pending, drafts.
Verification = tuple[str, list[int], list[int]]


@dataclass
class _Session:
    prefix_tokens: tuple[int, ...]
    capacity: int
    cache: KVCache | None = None  # None: evicted; `tail` holds the tokens after the prefix
    tail: ExactKV | None = None
    in_use: bool = False  # a call is working on it: not to be evicted
    pinned: bool = False  # loaded ahead of its verification (`load`): not to be evicted either


class Verifier:
    def __init__(self, config: VerifierConfig):
        self.config = config
        loaded, self.runner, self.info = load_worker_model(config)
        self.tokenizer = loaded.tokenizer
        self.store = FullKVStore(
            Path(config.root) / "kv",
            loaded.config,
            config.model,
            DTYPES[config.dtype],
            config.store_cpu_bytes,
        )
        self.catalog = PrefixCatalog(config.root, self.info.fingerprint)
        self.link = ThrottledLink(config.link)
        self._device_path = ThrottledLink(LinkSpec(config.load_bandwidth))  # store -> device
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._staged = StagedPrefixes(config.max_staged_prefixes, config.staged_ttl_s)
        self._lock = threading.Lock()  # sessions and residency: calls run on many threads
        self._room = threading.Condition(self._lock)  # signalled when full KV may have freed
        self._loading_bytes = 0  # full KV of the loads in progress, not resident yet
        self._peak_resident_bytes = 0  # full KV resident at once, at most so far
        # One token's full KV in a cache slot, positions included.
        self._slot_bytes = slot_bytes(self.runner.config, self.runner.dtype.itemsize)
        self._loop = BatchLoop(self.runner, "verifier-batch")
        service = KVTransferService(self._kv_for_drafter, self.info.fingerprint, self.link)
        host = config.transfer_host or "127.0.0.1"
        self._transfer = TransferServer(service, host, config.transfer_port)

    @property
    def transfer_address(self) -> str:
        return self._transfer.address

    def describe(self) -> dict:
        """What the coordinator plans with: the model, where to fetch KV, and device memory (the
        weights, the bytes one cache slot of full KV takes, the budget for resident full KV)."""
        return {
            "info": self.info,
            "transfer_address": self.transfer_address,
            "weights_bytes": self.runner.weights.nbytes,
            "slot_bytes": self._slot_bytes,
            "resident_bytes": self.config.resident_bytes,
        }

    def measure_load_bandwidth(self) -> float:
        """A first estimate of the bytes/s of full-KV loads onto the device, for a scheduler
        (which refines it with every load): a host-to-device copy, held to `load_bandwidth`."""
        measured = measure_link_bandwidth(self.runner.device)
        return min(measured, self.config.load_bandwidth or float("inf"))

    # --- Prefixes ---------------------------------------------------------------------------------

    def prefix_id(self, token_ids: list[int], chat: bool, compressor_spec: dict) -> str:
        build_compressor(compressor_spec["name"], **compressor_spec["params"])  # validates
        return prefix_id_for(self.info.fingerprint, token_ids, chat, compressor_spec)

    # Registration runs in three calls, so that the coordinator can report each stage: prefill
    # (staged here between calls), store (full KV into the store), compress (compressed KV into
    # the catalog). A prefix whose full KV is stored already skips the first two. A registration
    # abandoned between calls leaves its staged KV, which expires (staging.py) unless the
    # coordinator discards it at once (`discard_staged`).

    def prefill_prefix(self, token_ids: list[int]) -> None:
        self._check_tokens(token_ids)
        self._staged.expire()
        key = tuple(token_ids)
        if self._staged.get(key) is not None or self.store.contains(token_ids):
            return
        self._staged.put(key, self._prefill(token_ids))

    def store_prefix(self, token_ids: list[int]) -> WorkResult:
        """Puts the prefilled full KV in the store; returns once it is on disk."""
        self._staged.expire()
        key = tuple(token_ids)
        cache = self._staged.get(key)
        if cache is None:
            if self.store.contains(token_ids):
                return WorkResult()
            # Staged KV dropped since the prefill stage (expired, or evicted by newer ones).
            self._check_tokens(token_ids)
            cache = self._prefill(token_ids)
            self._staged.put(key, cache)
        stored = self.store.put(token_ids, cache)
        return WorkResult(store_bytes=stored.bytes_written, store_s=stored.seconds)

    def discard_staged(self, token_ids: list[int]) -> bool:
        """Drops the full KV staged for an abandoned registration; False when none was staged."""
        return self._staged.take(tuple(token_ids)) is not None

    @property
    def staged_bytes(self) -> int:
        """Bytes of full KV staged for registrations in progress (or abandoned, until expired)."""
        return self._staged.nbytes

    def compress_prefix(
        self, token_ids: list[int], chat: bool, compressor_spec: dict
    ) -> PrefixRecord:
        """Compresses a stored prefix and registers it."""
        prefix_id = self.prefix_id(token_ids, chat, compressor_spec)
        full = self._staged.take(tuple(token_ids))
        if self.catalog.contains(prefix_id):
            return self.catalog.get(prefix_id)
        if full is None:
            full = self.store.load(token_ids).cache
        compressor = build_compressor(compressor_spec["name"], **compressor_spec["params"])
        context = ModelContext(self.runner, tuple(token_ids), self.tokenizer)
        compressed = compressor.compress(full, context)
        record = PrefixRecord(prefix_id, tuple(token_ids), chat, compressor.spec(), full.nbytes, 0)
        return self.catalog.add(record, compressed.to_state())

    def get_prefix(self, prefix_id: str) -> PrefixRecord:
        self._staged.expire()  # called for every request and registration: a regular sweep
        return self.catalog.get(prefix_id)

    def list_prefixes(self) -> list[PrefixRecord]:
        return self.catalog.records()

    def delete_prefix(self, prefix_id: str) -> PrefixRecord:
        record = self.catalog.remove(prefix_id)
        # The store shares chunks between prefixes with the same first tokens: keep the full KV
        # while another registered prefix starts like this one.
        head = record.token_ids[: self.store.chunk_size]
        if not any(other.token_ids[: len(head)] == head for other in self.catalog.records()):
            self.store.delete(record.token_ids)
        return record

    def _kv_for_drafter(self, prefix_id: str, kind: int):
        """KVTransfer's source (called from the transfer server's thread)."""
        if kind == KVKind.FULL:
            return self.store.load(self.catalog.get(prefix_id).token_ids).cache.to_state()
        return self.catalog.compressed_state(prefix_id)

    # --- Sessions ---------------------------------------------------------------------------------

    def open(
        self,
        session_id: str,
        prefix_id: str | None,
        prompt_ids: list[int],
        capacity: int,
        exact_for_drafter: bool,
    ) -> WorkResult:
        """Loads the prefix's full KV, prefills the rest of the prompt; returns the first token
        (and the prompt's exact KV after the prefix when a drafter will need it)."""
        self._check_tokens(prompt_ids)
        prefix = self.catalog.get(prefix_id).token_ids if prefix_id else ()
        if tuple(prompt_ids[: len(prefix)]) != prefix or len(prompt_ids) <= len(prefix):
            raise InvalidRequestError("the prompt must extend the prefix by at least one token")
        result = WorkResult()
        with self._lock:
            self._sessions[session_id] = _Session(prefix, capacity)
        try:
            with self._using(session_id, result) as session:
                suffix = torch.tensor(prompt_ids[len(prefix) :], dtype=torch.long)
                chunk = self.config.prefill_chunk
                logits = self.runner.prefill(suffix, session.cache, chunk_size=chunk)
                result.tokens = [first_token(logits)]
                if exact_for_drafter:
                    exact = ExactKV.of(session.cache, len(prefix), len(prompt_ids))
                    self._hand_over(result, exact)
        except BaseException:
            self.close(session_id)
            raise
        return result

    def load(self, session_id: str) -> WorkResult:
        """Brings the session's full KV onto the device ahead of its next verification, and keeps
        it there until then: a scheduled load (scheduled.py), overlapping other requests' work."""
        result = WorkResult()
        with self._using(session_id, result) as session:
            session.pinned = True
        return result

    def verify(self, session_id: str, pending: list[int], drafts: list[int]) -> WorkResult:
        """One forward over [pending + drafts] with the full KV (batched with the other requests
        due): the full-KV greedy choice after each; keeps the KV of pending and accepted drafts
        and hands it to the drafter."""
        result = self.verify_many([(session_id, pending, drafts)])[0]
        if result is None:
            raise SessionNotFoundError(f"the verifier holds no session {session_id!r}")
        return result

    def verify_many(self, verifications: list[Verification]) -> list[WorkResult | None]:
        """`verify` for several sessions (session_id, pending, drafts) in one batched forward. A
        session closed meanwhile (its request cancelled) gets None; the others verify."""
        results: list[WorkResult | None] = []
        batch = []  # (session, its verification, its result, its tokens before)
        with contextlib.ExitStack() as using:
            for verification in verifications:
                result = WorkResult()
                try:
                    session = using.enter_context(self._using(verification[0], result))
                except SessionNotFoundError:
                    results.append(None)
                    continue
                results.append(result)
                batch.append((session, verification, result, session.cache.num_tokens))
            jobs = [
                Job(session.cache, pending + drafts, num_logits=1 + len(drafts), exact=True)
                for session, (_, pending, drafts), _, _ in batch
            ]
            choices = self._loop.run_many(jobs)  # each [1 + len(drafts)] greedy choices
            for (session, (_, pending, drafts), result, before), tokens in zip(batch, choices):
                result.tokens = tokens
                result.num_accepted = num_accepted(drafts, tokens)
                kept = before + len(pending) + result.num_accepted
                session.cache.truncate(kept)
                session.pinned = False
                self._hand_over(result, ExactKV.of(session.cache, before, kept))
        return results

    def decode(
        self, session_id: str, pending: list[int], max_tokens: int, end_ids: list[int]
    ) -> WorkResult:
        """FULL_LOCAL: up to `max_tokens` greedy tokens over the full KV."""
        result = WorkResult()
        with self._using(session_id, result) as session:
            job = Job(session.cache, list(pending), max_tokens, 1, frozenset(end_ids), True)
            result.tokens = self._loop.run(job)
        return result

    def batching(self) -> dict:
        """Steps the batch loop ran, and the largest batch one of them held."""
        return {"steps": self._loop.num_steps, "max_batch": self._loop.max_batch}

    def close(self, session_id: str) -> None:
        with self._lock:
            self._sessions.pop(session_id, None)
            self._room.notify_all()

    def residency(self) -> dict:
        """Full KV resident now and at most so far (its high-water mark), in bytes."""
        with self._lock:
            return {"bytes": self._resident_bytes(), "peak_bytes": self._peak_resident_bytes}

    def shutdown(self) -> None:
        self._loop.stop()
        with self._lock:
            self._sessions.clear()
        self._staged.clear()
        self._transfer.stop()
        self.store.close()

    # --- Internals --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _using(self, session_id: str, result: WorkResult) -> Iterator[_Session]:
        """The session with its full KV resident, safe from eviction while in use. One call per
        session at a time (the coordinator's rounds are sequential); sessions run concurrently."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                raise SessionNotFoundError(f"the verifier holds no session {session_id!r}")
            self._sessions.move_to_end(session_id)
            session.in_use = True
            incoming = 0 if session.cache is not None else session.capacity * self._slot_bytes
            self._wait_for_room(incoming)
            self._loading_bytes += incoming
        try:
            try:
                self._load(session, result)  # outside the lock: other requests go on meanwhile
            finally:
                with self._lock:
                    self._loading_bytes -= incoming
                    resident = self._resident_bytes()
                    self._peak_resident_bytes = max(self._peak_resident_bytes, resident)
            yield session
        finally:
            with self._lock:
                session.in_use = False
                self._evict_beyond_budget()
                self._room.notify_all()

    def _wait_for_room(self, incoming: int) -> None:
        """Evicts idle sessions until a load of `incoming` bytes fits the budget, waiting while
        the full KV in use, pinned or loading does not leave room; a session larger than the
        budget loads once no other full KV is held. Called with the lock held."""
        while incoming:
            self._evict_beyond_budget(incoming)
            held = self._resident_bytes() + self._loading_bytes
            if held + incoming <= self.config.resident_bytes or held == 0:
                return
            self._room.wait()

    def _load(self, session: _Session, result: WorkResult) -> None:
        """Makes the session's full KV resident, loading its prefix from the store if needed."""
        if session.cache is not None:
            return
        if session.prefix_tokens:
            loaded = self.store.load(session.prefix_tokens, capacity=session.capacity)
            cache = loaded.cache
            result.store_bytes += loaded.bytes_loaded
            held = self._device_path.send_blocking(loaded.bytes_loaded, first=True)
            result.store_s += loaded.seconds + held
        else:
            cache = self.runner.new_cache(capacity=session.capacity)
        if session.tail is not None:
            cache.append_exact(session.tail)
        session.cache, session.tail = cache, None

    def _prefill(self, token_ids: list[int]) -> KVCache:
        """The full KV of `token_ids`, prefilled chunk by chunk."""
        cache = self.runner.new_cache(capacity=len(token_ids))
        ids = torch.tensor(token_ids, dtype=torch.long)
        self.runner.prefill(ids, cache, num_logits=0, chunk_size=self.config.prefill_chunk)
        return cache

    def _resident_bytes(self) -> int:
        return sum(s.cache.nbytes for s in self._sessions.values() if s.cache is not None)

    def _evict_beyond_budget(self, incoming: int = 0) -> None:
        """Least recently used sessions not in use drop their prefix's KV (keeping the tokens
        after it) until residency, with `incoming` bytes about to load, fits the budget. Called
        with the lock held."""
        for victim in list(self._sessions.values()):
            if (
                self._resident_bytes() + self._loading_bytes + incoming
                <= self.config.resident_bytes
            ):
                return
            if victim.cache is None or victim.in_use or victim.pinned:
                continue
            num_prefix = len(victim.prefix_tokens)
            victim.tail = ExactKV.of(victim.cache, num_prefix, victim.cache.num_tokens)
            victim.cache = None

    def _hand_over(self, result: WorkResult, exact: ExactKV) -> None:
        """Books the drafter's copy of `exact` on the link toward the drafters."""
        result.exact = exact
        result.link_bytes = exact.nbytes
        result.link_delay_s = self.link.schedule(exact.nbytes, first=True)

    def _check_tokens(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise InvalidRequestError("no token ids given")
        if len(token_ids) >= self.info.max_positions:
            raise InvalidRequestError(
                f"{len(token_ids)} tokens: the model's context is {self.info.max_positions}, "
                "and at least one must remain for output"
            )
        if not all(0 <= t < self.info.vocab_size for t in token_ids):
            raise InvalidRequestError(f"token ids must lie in [0, {self.info.vocab_size})")
