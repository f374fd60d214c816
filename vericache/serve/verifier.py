"""The verifier: the worker beside the full-KV store ("local" side).

It registers prefixes (prefill once, full KV into the LMCache store, compressed KV into the
catalog), serves compressed and full KV to drafters through the KVTransfer service and the link,
and runs the full-KV half of every request: the prefill of its prompt, the verification of each
round of drafts (FULL_LOCAL: plain greedy decoding).

Residency: between rounds the verifier keeps at most `resident_bytes` of full KV across sessions.
Past that, the least recently used sessions drop their prefix's KV and keep only the KV of the
tokens after it; their next round reloads the prefix from the store. Every call reports the bytes
it loaded from the store and the time it took.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from vericache.compress import build_compressor
from vericache.compress.context import ModelContext
from vericache.engine.engine import num_accepted
from vericache.errors import InvalidRequestError
from vericache.kv.cache import KVCache
from vericache.model.loader import DTYPES
from vericache.model.runner import SequenceInput
from vericache.serve.catalog import PrefixCatalog, PrefixRecord, prefix_id_for
from vericache.serve.config import VerifierConfig
from vericache.serve.kv_transfer import KVKind, KVTransferService, TransferServer
from vericache.serve.link import ThrottledLink
from vericache.serve.store import FullKVStore
from vericache.serve.worker import (
    ExactKV,
    SessionNotFoundError,
    WorkResult,
    decode_greedy,
    first_token,
    load_worker_model,
)


@dataclass
class _Session:
    prefix_tokens: tuple[int, ...]
    capacity: int
    cache: KVCache | None = None  # None: evicted; `tail` holds the tokens after the prefix
    tail: ExactKV | None = None


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
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._staged: dict[tuple[int, ...], KVCache] = {}  # prefilled prefixes being registered
        service = KVTransferService(self._kv_for_drafter, self.info.fingerprint, self.link)
        host = config.transfer_host or "127.0.0.1"
        self._transfer = TransferServer(service, host, config.transfer_port)

    @property
    def transfer_address(self) -> str:
        return self._transfer.address

    def describe(self) -> dict:
        return {"info": self.info, "transfer_address": self.transfer_address}

    # --- Prefixes ---------------------------------------------------------------------------------

    def prefix_id(self, token_ids: list[int], chat: bool, compressor_spec: dict) -> str:
        build_compressor(compressor_spec["name"], **compressor_spec["params"])  # validates
        return prefix_id_for(self.info.fingerprint, token_ids, chat, compressor_spec)

    # Registration runs in three calls, so that the coordinator can report each stage: prefill
    # (kept here between calls), store (full KV into the store), compress (compressed KV into the
    # catalog). A prefix whose full KV is stored already skips the first two.

    def prefill_prefix(self, token_ids: list[int]) -> None:
        self._check_tokens(token_ids)
        key = tuple(token_ids)
        if key in self._staged or self.store.contains(token_ids):
            return
        cache = self.runner.new_cache(capacity=len(token_ids))
        ids = torch.tensor(token_ids, dtype=torch.long)
        self.runner.prefill(ids, cache, num_logits=0, chunk_size=self.config.prefill_chunk)
        self._staged[key] = cache

    def store_prefix(self, token_ids: list[int]) -> WorkResult:
        """Puts the prefilled full KV in the store; returns once it is on disk."""
        cache = self._staged.get(tuple(token_ids))
        if cache is None:  # stored already
            return WorkResult()
        stored = self.store.put(token_ids, cache)
        return WorkResult(store_bytes=stored.bytes_written, store_s=stored.seconds)

    def compress_prefix(
        self, token_ids: list[int], chat: bool, compressor_spec: dict
    ) -> PrefixRecord:
        """Compresses a stored prefix and registers it."""
        prefix_id = self.prefix_id(token_ids, chat, compressor_spec)
        full = self._staged.pop(tuple(token_ids), None)
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
        session = _Session(prefix, capacity)
        result = WorkResult()
        self._sessions[session_id] = session
        try:
            self._load(session, result)
            suffix = torch.tensor(prompt_ids[len(prefix) :], dtype=torch.long)
            chunk = self.config.prefill_chunk
            logits = self.runner.prefill(suffix, session.cache, chunk_size=chunk)
        except BaseException:
            self._sessions.pop(session_id, None)
            raise
        result.tokens = [first_token(logits)]
        if exact_for_drafter:
            self._hand_over(result, ExactKV.slice(session.cache, len(prefix), len(prompt_ids)))
        self._release(session_id)
        return result

    def verify(self, session_id: str, pending: list[int], drafts: list[int]) -> WorkResult:
        """One forward over [pending + drafts] with the full KV: the full-KV greedy choice after
        each; keeps the KV of pending and accepted drafts, hands it to the drafter."""
        session = self._session(session_id)
        result = WorkResult()
        self._load(session, result)
        cache = session.cache
        before = cache.num_tokens
        ids = torch.tensor(pending + drafts, dtype=torch.long)
        (logits,) = self.runner.forward([SequenceInput(ids, cache, 1 + len(drafts))], True)
        # [1 + len(drafts)] greedy choices; argmax ties go to the lowest id, as in the engine.
        result.tokens = logits.argmax(dim=-1).tolist()
        result.num_accepted = num_accepted(drafts, result.tokens)
        kept = before + len(pending) + result.num_accepted
        cache.truncate(kept)
        self._hand_over(result, ExactKV.slice(cache, before, kept))
        self._release(session_id)
        return result

    def decode(
        self, session_id: str, pending: list[int], max_tokens: int, end_ids: list[int]
    ) -> WorkResult:
        """FULL_LOCAL: up to `max_tokens` greedy tokens over the full KV."""
        session = self._session(session_id)
        result = WorkResult()
        self._load(session, result)
        result.tokens = decode_greedy(
            self.runner, session.cache, pending, max_tokens, frozenset(end_ids), invariant=True
        )
        self._release(session_id)
        return result

    def close(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    @property
    def resident_bytes(self) -> int:
        return sum(s.cache.nbytes for s in self._sessions.values() if s.cache is not None)

    def shutdown(self) -> None:
        self._sessions.clear()
        self._transfer.stop()
        self.store.close()

    # --- Internals --------------------------------------------------------------------------------

    def _session(self, session_id: str) -> _Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionNotFoundError(f"the verifier holds no session {session_id!r}")
        self._sessions.move_to_end(session_id)
        return session

    def _load(self, session: _Session, result: WorkResult) -> None:
        """Makes the session's full KV resident, loading its prefix from the store if needed."""
        if session.cache is not None:
            return
        if session.prefix_tokens:
            loaded = self.store.load(session.prefix_tokens, capacity=session.capacity)
            session.cache = loaded.cache
            result.store_bytes += loaded.bytes_loaded
            result.store_s += loaded.seconds
        else:
            session.cache = self.runner.new_cache(capacity=session.capacity)
        if session.tail is not None:
            session.tail.append_to(session.cache)
            session.tail = None

    def _release(self, session_id: str) -> None:
        """Evicts least recently used sessions (this one last) until residency fits the budget."""
        for victim_id in [*self._sessions.keys() - {session_id}, session_id]:
            if self.resident_bytes <= self.config.resident_bytes:
                return
            victim = self._sessions[victim_id]
            if victim.cache is None:
                continue
            num_prefix = len(victim.prefix_tokens)
            victim.tail = ExactKV.slice(victim.cache, num_prefix, victim.cache.num_tokens)
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
