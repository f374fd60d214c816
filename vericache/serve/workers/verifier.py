"""The verifier: the worker beside the full-KV store ("local" side).

It registers prefixes (prefixes.py: prefill once, full KV into the LMCache store, compressed KV
into the catalog), serves compressed and full KV to drafters through the KVTransfer service and
the link, and runs the full-KV half of every request: the prefill of its prompt, the verification
of each round of drafts (FULL_LOCAL: plain greedy decoding). Its forwards go through the engine's
forward loop, batched across sessions: verifications whose drafts arrive together share forwards.

Prefixes are shared (kv/shared_prefix.py): the verifier holds one copy of each prefix's full KV
within `prefix_cache_bytes`, loaded from the store (at `load_bandwidth` where set: emulated PCIe)
by the first session that needs it and pinned while any session uses it; drafters fetching a
prefix's full KV read that copy too. A session's cache reads the copy in place and holds only
what follows it (kv/prefixed.py). Residency (residency.py): the verifier holds at
most `resident_bytes` of sessions' own full KV; an evicted session's next call rebuilds its cache
over the shared copy, reading nothing from the store. Every call reports
the bytes it loaded from the store and the time it took.
"""

from __future__ import annotations

import logging
import time

import torch

from vericache.engine.calibration import measure_link_bandwidth
from vericache.engine.device_memory import prefix_budget_left, slot_bytes
from vericache.engine.forward_loop import Job, choose_first
from vericache.engine.link import LinkSpec, ThrottledLink
from vericache.errors import InvalidRequestError, WorkerUnavailableError
from vericache.kv.cache import KVCache
from vericache.kv.exact import ExactKV
from vericache.kv.pool import BufferPool
from vericache.kv.prefixed import shared_clone
from vericache.kv.shared_prefix import HeldPrefix, SharedPrefixes
from vericache.kv.state import CacheState
from vericache.serve.cluster_secret import required
from vericache.serve.config import VerifierConfig
from vericache.serve.store.catalog import PrefixKey, PrefixRecord
from vericache.serve.workers.batching import BatchLoop
from vericache.serve.workers.kv_transfer import KVKind, KVTransferService, TransferServer
from vericache.serve.workers.prefixes import PrefixRegistry
from vericache.serve.workers.residency import ResidentSessions, Session
from vericache.serve.workers.steered_sessions import SteeredSessions
from vericache.serve.workers.turn_cache import TurnCache, TurnTokens
from vericache.serve.workers.verification import verify_round
from vericache.serve.workers.worker import (
    DraftFailedError,
    SessionNotFoundError,
    load_worker_model,
    session_grammars,
)
from vericache.serve.workers.worker_api import (
    BatchingStats,
    DecodeCall,
    Decoded,
    DraftAnswer,
    Drafted,
    OpenVerifier,
    Residency,
    Traffic,
    Verified,
    VerifierInfo,
    VerifierOpened,
    VerifyCall,
)

log = logging.getLogger(__name__)

# How often a verification waiting for its drafts looks whether its session closed meanwhile.
_DRAFT_POLL_S = 0.05


class Verifier:
    def __init__(self, config: VerifierConfig):
        self.config = config
        model = load_worker_model(config)
        self.runner, self.info = model.runner, model.info
        self.prefixes = PrefixRegistry(config, model.loaded, self.runner, self.info)
        self.link = ThrottledLink(config.link)  # toward the drafters
        self._device_path = ThrottledLink(LinkSpec(config.load_bandwidth))  # store -> device
        self._slot_bytes = slot_bytes(self.runner.config, self.runner.dtype.itemsize)
        self._buffers = BufferPool(config.resident_bytes)  # of closed and evicted sessions
        # One copy of each prefix's full KV, shared by the sessions and fetches that use it.
        budget = config.prefix_cache_bytes or prefix_budget_left(
            self.runner.device, config.resident_bytes + config.turn_cache_bytes
        )
        self._prefix_copies: SharedPrefixes[KVCache] = SharedPrefixes(budget)
        self._turns = TurnCache(config.turn_cache_bytes, host_bytes=config.turn_host_bytes)
        self._sessions = ResidentSessions(
            config.resident_bytes, self._slot_bytes, self._load, self._buffers,
            release_prefix=self._prefix_copies.release, on_closed=self._keep_turn,
        )  # fmt: skip
        self._loop = BatchLoop(self.runner, "verifier-batch")
        self._grammars = session_grammars(model)
        self._steered = SteeredSessions(self.prefixes.compressed_state)
        log.info("verifier prefix cache: %.2f GiB", budget / 2**30)
        service = KVTransferService(
            self._kv_for_drafter, self.info.fingerprint, self.link, required(config.secret),
            is_registered=self.prefixes.catalog.contains,
        )  # fmt: skip
        host = config.transfer_host or "127.0.0.1"
        self._transfer = TransferServer(service, host, config.transfer_port)
        self.startup = model.startup()

    @property
    def transfer_address(self) -> str:
        return self._transfer.address

    def describe(self) -> VerifierInfo:
        return VerifierInfo(
            model=self.info,
            transfer_address=self.transfer_address,
            weights_bytes=self.runner.weights.nbytes,
            slot_bytes=self._slot_bytes,
            resident_bytes=self.config.resident_bytes,
            startup=self.startup,
            prefix_cache=self._prefix_copies.stats(),
            link=self.config.link,
            turn_cache_bytes=self.config.kept_turn_bytes,
        )

    def measure_load_bandwidth(self) -> float:
        """A first estimate of the bytes/s of full-KV loads onto the device, for a scheduler
        (which refines it with every load): a host-to-device copy, held to `load_bandwidth`."""
        measured = measure_link_bandwidth(self.runner.device)
        return min(measured, self.config.load_bandwidth or float("inf"))

    # --- Prefixes ---------------------------------------------------------------------------------

    def prefill_prefix(self, key: PrefixKey) -> None:
        self.prefixes.prefill(key)

    def store_prefix(self, key: PrefixKey) -> Traffic:
        return self.prefixes.put_in_store(key)

    def compress_prefix(self, key: PrefixKey) -> PrefixRecord:
        return self.prefixes.compress(key)

    def discard_staged(self, key: PrefixKey) -> bool:
        return self.prefixes.discard_staged(key)

    def get_prefix(self, prefix_id: str) -> PrefixRecord:
        return self.prefixes.get(prefix_id)

    def list_prefixes(self) -> list[PrefixRecord]:
        return self.prefixes.records()

    def delete_prefix(self, prefix_id: str) -> PrefixRecord:
        record = self.prefixes.delete(prefix_id)
        self._steered.forget_prefix(prefix_id)
        # Sessions using it keep its copy until they close; no new one gets it.
        self._prefix_copies.retire((record.tenant, record.token_ids))
        return record

    # --- Sessions ---------------------------------------------------------------------------------

    def open(self, call: OpenVerifier) -> VerifierOpened:
        """Loads the prefix's full KV, prefills the rest of the prompt; returns the first token
        (and the prompt's exact KV after the prefix when a drafter will need it)."""
        prompt = call.prompt_ids
        self.prefixes.check_tokens(prompt)
        record = self.prefixes.get(call.prefix_id) if call.prefix_id else None
        prefix = record.token_ids if record else ()
        if prompt[: len(prefix)] != prefix or len(prompt) <= len(prefix):
            raise InvalidRequestError("the prompt must extend the prefix by at least one token")
        owner = record.tenant if record else ""
        after_prefix = prompt[len(prefix) :]
        # A finished turn's KV of the prompt's first tokens after the prefix, where one is kept:
        # the session starts from it as from an evicted tail (residency.py).
        reused = self._turns.match((owner, prefix), after_prefix)
        session = Session(
            prefix, call.capacity, tail=reused, namespace=owner, history=TurnTokens(after_prefix)
        )
        self._sessions.add(call.session_id, session)
        try:
            if call.steer_every:
                if record is None or not call.for_drafter:
                    raise InvalidRequestError("steering needs a prefix and a drafter")
                self._steered.open(call.session_id, record, call.steer_every)
            shared = self._hold_prefix(session) if prefix else Traffic()
            with self._sessions.using(call.session_id) as (session, loaded):
                start = _num_cached(session)  # the tokens a kept turn gave it
                suffix = torch.tensor(after_prefix[start:], dtype=torch.long)
                chunk = self.config.prefill_chunk
                logits = self.runner.prefill(suffix, session.cache, chunk_size=chunk)
                grammar = self._grammars.constraint(call.session_id, call.grammar)
                first = choose_first(logits, call.sampler, grammar)
                session.history.commit([first.token_id])
                exact, delay = None, 0.0
                if call.for_drafter:
                    exact = ExactKV.of(session.cache, len(prefix), len(prompt))
                    delay = self._hand_over(exact.nbytes)
        except BaseException:
            self.close_session(call.session_id)
            raise
        traffic = shared + loaded + self._found() + Traffic(link_bytes=exact.nbytes if exact else 0)
        return VerifierOpened(
            first.token_id, exact, delay, traffic, reused_tokens=start, logprobs=first.logprobs
        )

    def verify(self, call: VerifyCall) -> Verified:
        """One forward over [pending + drafts] with the full KV (batched with the other
        verifications due): the full-KV greedy choice after each; keeps the KV of pending and the
        accepted drafts and hands it to the drafter. A scheduled round's call comes while its
        drafts are still being drafted: its load, if it carries one, starts at once and overlaps
        the drafting and other requests' verifications."""
        if call.load_first:
            self._sessions.load_ahead(call.session_id)
        drafted = self._drafted(call)
        with self._sessions.using(call.session_id) as (session, loaded):
            session.history.feed(_num_cached(session), call.pending)
            grammar = self._grammars.constraint(call.session_id, call.grammar)
            done = verify_round(
                self._loop, session.cache, call.pending, drafted, call.sampler, grammar,
                self._steered.observer(call.session_id),
            )  # fmt: skip
            committed = done.tokens[: done.num_accepted + 1]  # the rest: rejected
            session.history.commit(committed)
            refresh = None  # where no draft call follows, nothing would carry it
            if call.is_followed_by_drafts(committed):
                refresh = self._steered.after_round(
                    call.session_id, session.cache, drafted.kept_set_version
                )
        nbytes = done.exact.nbytes + (refresh.nbytes if refresh is not None else 0)
        delay = self._hand_over(nbytes)
        traffic = loaded + self._found() + Traffic(link_bytes=nbytes)
        return Verified(
            done.tokens, done.num_accepted, done.exact, delay, traffic, done.forward_s,
            done.logprobs, refresh,
        )  # fmt: skip

    def _drafted(self, call: VerifyCall) -> Drafted:
        """The call's drafts, waiting for the draft call's answer where it carries one (bounded:
        a session closed meanwhile, or a drafter that never answers, ends the wait)."""
        if isinstance(call.drafts, tuple):
            return Drafted(call.drafts, 0.0)
        deadline = time.monotonic() + self.config.draft_wait_s
        while (drafted := _answered(call.drafts)) is None:
            if call.session_id not in self._sessions:
                raise SessionNotFoundError(f"the verifier holds no session {call.session_id!r}")
            if time.monotonic() > deadline:
                raise WorkerUnavailableError(
                    f"the drafts of session {call.session_id!r} did not come within "
                    f"{self.config.draft_wait_s:g} s"
                )
        return drafted

    def decode(self, call: DecodeCall) -> Decoded:
        """FULL_LOCAL: up to `max_tokens` greedy tokens over the full KV."""
        with self._sessions.using(call.session_id) as (session, loaded):
            session.history.feed(_num_cached(session), call.pending)
            job = Job(
                session.cache, list(call.pending), call.max_tokens, 1, call.end_ids,
                is_full_kv=True, sampler=call.sampler, reports_logprobs=True,
                constraint=self._grammars.constraint(call.session_id, call.grammar),
            )  # fmt: skip
            tokens = self._loop.run(job)
            session.history.commit(tokens)
        return Decoded(tuple(tokens), loaded, tuple(job.logprobs))

    def close_session(self, session_id: str) -> None:
        # Its prefix stays pinned until a call still using the session ends.
        self._sessions.remove(session_id)
        self._grammars.drop(session_id)
        self._steered.close(session_id)

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    def batching(self) -> BatchingStats:
        loop = self._loop.forward_loop
        return BatchingStats(
            loop.num_steps, loop.max_batch, loop.num_rows, loop.cpu_s, loop.exact_cpu_s
        )

    def residency(self) -> Residency:
        return self._sessions.residency()

    def shutdown(self) -> None:
        self._loop.stop()
        self._sessions.clear()
        self._transfer.stop()
        self.prefixes.close()

    # --- Internals --------------------------------------------------------------------------------

    def _load(self, session: Session) -> tuple[KVCache, Traffic]:
        """A session's cache with room for its capacity: over its prefix's shared full KV (read
        in place, nothing from the store), or an empty one."""
        if session.shared is None:
            return self.runner.new_cache(session.capacity, self._buffers), Traffic()
        cache = shared_clone(session.shared.cache, session.capacity, self._buffers)
        return cache, Traffic()

    def _hold_prefix(self, session: Session) -> Traffic:
        """Pins the session's prefix's shared copy until it closes, loading it from the store if
        this worker holds none; what the session's own load cost (nothing where it was held)."""
        loaded, session.shared = self._shared_prefix(session.namespace, session.prefix_tokens)
        return loaded

    def _shared_prefix(
        self, namespace: str, token_ids: tuple[int, ...]
    ) -> tuple[Traffic, HeldPrefix[KVCache]]:
        loads = []

        def load() -> KVCache:
            loads.append(self.prefixes.load_full(token_ids, namespace, 0))
            return loads[0].cache

        estimate = len(token_ids) * self._slot_bytes
        held = self._prefix_copies.acquire((namespace, token_ids), load, nbytes=estimate)
        if not loads:
            return Traffic(), held
        moved_s = self._device_path.send_blocking(loads[0].bytes_loaded, first=True)
        traffic = Traffic(store_bytes=loads[0].bytes_loaded, store_s=loads[0].seconds + moved_s)
        return traffic, held

    def _found(self) -> Traffic:
        """Stored data found failing its check since the last call reported (by any session's
        load, or a drafter's fetch), for the request at hand to report."""
        return Traffic(corruptions=self.prefixes.take_corruptions())

    def _keep_turn(self, session: Session) -> None:
        """A closed session's KV after its prefix, for a later turn (turn_cache.py)."""
        owner = (session.namespace, session.prefix_tokens)
        session.history.keep(self._turns, owner, session.kv_after_prefix)

    def _kv_for_drafter(self, prefix_id: str, kind: int) -> CacheState:
        """KVTransfer's source (the transfer server's thread): a prefix's compressed KV, or its
        full KV from the shared copy (loaded once)."""
        if kind != KVKind.FULL:
            return self.prefixes.compressed_state(prefix_id)
        record = self.prefixes.get(prefix_id)
        _, held = self._shared_prefix(record.tenant, record.token_ids)
        try:
            return held.cache.to_state()
        finally:
            self._prefix_copies.release(held)

    def _hand_over(self, nbytes: int) -> float:
        """Books `nbytes` for a drafter (exact KV, a kept-set refresh) on the link toward the
        drafters; returns the seconds until they have crossed. The call that carries them pays
        the link's latency."""
        return self.link.schedule(nbytes, first=False)


def _num_cached(session: Session) -> int:
    """Tokens after the prefix whose KV the session's cache holds."""
    return session.cache.num_tokens - len(session.prefix_tokens)


def _answered(answer: DraftAnswer) -> Drafted | None:
    try:
        return answer.wait(_DRAFT_POLL_S)
    except Exception as exc:  # noqa: BLE001 - its kind is the draft call's to report
        raise DraftFailedError(f"the draft call failed: {type(exc).__name__}") from None
