"""The drafter: the worker on a remote GPU, across the slow link from the store.

It fetches a prefix's KV from a verifier's KVTransfer service and keeps one copy of it
(kv/shared_prefix.py, within `kv_cache_bytes`: pinned while a session reads it, so later requests
on the prefix pay no transfer); its sessions read that copy in place and hold their own tokens
alone (kv/prefixed.py). It decodes greedily over it, in one of three roles
(`DraftRole`):
- DRAFT (VERICACHE): each round is one `draft` call for the whole draft; before it drafts, the
  exact KV the verifier computed for the tokens committed since replaces the drafts' own, as in
  the in-process engine;
- LOSSY: decodes alone over the compressed KV, which online compressors update each step;
- FULL (FULL_REMOTE): decodes alone over the full KV it fetched, with the verifier's kernels (on
  a node warm for the prefix, over its host tier's copy: nothing crosses the link); a finished
  session's KV after the prefix is kept for a later turn to reuse (turn_cache.py).
With a host tier (`host_tier_bytes`, warm_node.py) it also streams the full KV of the prefixes it
drafts on, and once warm verifies its own DRAFT sessions' rounds (`open_local`, `local_round`).
Its forwards go through the engine's forward loop, batched across sessions.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from vericache.compress.steering import KeptSetSteering
from vericache.engine.calibration import time_draft_step
from vericache.engine.device_memory import prefix_budget_left
from vericache.engine.forward_loop import Job, choose_first
from vericache.engine.sampling import checks_by_rejection
from vericache.errors import InvalidRequestError
from vericache.kv.cache import KVCache
from vericache.kv.exact import ExactKV
from vericache.kv.pool import BufferPool
from vericache.kv.prefixed import shared_clone
from vericache.kv.shared_prefix import HeldPrefix, SharedPrefixes
from vericache.serve.cluster_secret import required
from vericache.serve.config import DrafterConfig
from vericache.serve.workers.batching import BatchLoop
from vericache.serve.workers.draft_cache import take_exact, take_kept_set, update_compressed
from vericache.serve.workers.kv_transfer import KVFetcher, KVKind, fetch_kind
from vericache.serve.workers.turn_cache import TurnCache, TurnTokens
from vericache.serve.workers.warm_node import WarmNode
from vericache.serve.workers.worker import (
    SessionNotFoundError,
    load_worker_model,
    session_grammars,
)
from vericache.serve.workers.worker_api import (
    BatchingStats,
    DecodeCall,
    Decoded,
    DraftCall,
    Drafted,
    DrafterInfo,
    DrafterOpened,
    DraftRole,
    LocalOpened,
    LocalRound,
    LocalRoundCall,
    OpenDrafter,
    OpenLocal,
    Traffic,
)

log = logging.getLogger(__name__)


@dataclass
class _Session:
    session_id: str
    role: DraftRole
    cache: KVCache  # over `prefix`, read in place
    prefix: HeldPrefix[KVCache]  # pinned until the session's last call ends
    copies: SharedPrefixes[KVCache]  # where `prefix` is held: the device's, or the host tier's
    prefix_id: str
    capacity: int  # cache slots the request reserves
    is_in_use: bool = False  # a call is drafting or decoding on it
    is_closed: bool = False  # its request ended while a call used it: release when that ends
    # FULL: its tokens after the prefix, for a later turn to reuse its KV (turn_cache.py).
    history: TurnTokens | None = None
    # DRAFT: the kept set its cache holds (compress/kept_set.py; 0: its prefix's own), and, once
    # its node verifies it, the steering of that set there (compress/steering.py).
    kept_set_version: int = 0
    steering: KeptSetSteering | None = None


class Drafter:
    def __init__(self, config: DrafterConfig):
        self.config = config
        self._secret = required(config.secret)
        model = load_worker_model(config)
        self.runner, self.info = model.runner, model.info
        self._fetchers: dict[str, KVFetcher] = {}  # by verifier address
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()  # calls run on many threads
        budget = config.kv_cache_bytes or prefix_budget_left(
            self.runner.device, config.turn_cache_bytes
        )
        log.info("drafter prefix cache: %.2f GiB", budget / 2**30)
        # Its FULL sessions' finished turns, and its warm node's VERICACHE sessions'.
        self._turns = TurnCache(config.turn_cache_bytes, host_bytes=config.turn_host_bytes)
        self._buffers = BufferPool(budget)  # of closed sessions
        # One copy of each prefix fetched, whichever verifier it came from (a prefix id names
        # the same KV on every verifier of the server).
        self._prefixes: SharedPrefixes[KVCache] = SharedPrefixes(budget)
        self._loop = BatchLoop(self.runner, "drafter-batch")
        self._grammars = session_grammars(model)
        self._warm = None
        self._tier_fetchers: dict[str, KVFetcher] = {}  # by verifier address, into the tier
        if config.host_tier_bytes:
            log.info("drafter host tier: %.2f GiB", config.host_tier_bytes / 2**30)
            self._warm = WarmNode(
                self.runner, self._loop, config.host_tier_bytes, self._buffers,
                config.prefill_chunk, config.host_tier_timeout_s, self._turns,
            )  # fmt: skip
        self.startup = model.startup()

    def describe(self) -> DrafterInfo:
        warm, tier = frozenset(), None
        if self._warm is not None:
            warm, tier = self._warm.warm_prefixes(), self._warm.tier.stats()
        full = frozenset(pid for pid, kind in self._prefixes.keys() if kind == KVKind.FULL)
        return DrafterInfo(
            self.info, self.startup, self._prefixes.stats(), warm, tier,
            self.config.kept_turn_bytes, full,
        )  # fmt: skip

    def time_draft_step(self) -> float:
        """Seconds of one draft step: a first estimate for a scheduler, which refines it."""
        return time_draft_step(self.runner)

    def open(self, call: OpenDrafter) -> DrafterOpened:
        """Fetches the prefix's KV (an LRU hit costs nothing). Alone (lossy, full), prefills the
        rest of the prompt and returns the first token; drafting waits for the verifier's KV."""
        nbytes = call.num_prefix_tokens * self.info.full_kv_bytes_per_token  # its full KV's
        held, copies, traffic = self._prefix_copy(call, nbytes)
        try:
            if held.cache.num_tokens != call.num_prefix_tokens:
                raise InvalidRequestError(
                    f"prefix {call.prefix_id} holds {held.cache.num_tokens} tokens, "
                    f"the request says {call.num_prefix_tokens}"
                )
            # Read in place, as every session on this prefix reads it: the session holds its
            # own tokens alone (kv/prefixed.py).
            cache = shared_clone(held.cache, call.capacity, self._buffers)
            first, history, reused = None, None, 0
            after_prefix = call.prompt_ids[call.num_prefix_tokens :]
            if call.role is DraftRole.FULL:
                # A finished turn's KV of the prompt's first tokens, where one is kept.
                reused = self._turns.reuse_into(call.prefix_id, after_prefix, cache)
                history = TurnTokens(after_prefix)
            if call.role is not DraftRole.DRAFT:
                suffix = torch.tensor(after_prefix[reused:], dtype=torch.long)
                logits = self.runner.prefill(suffix, cache, chunk_size=self.config.prefill_chunk)
                grammar = self._grammars.constraint(call.session_id, call.grammar)
                first = choose_first(logits, call.sampler, grammar)
                update_compressed(cache)
        except BaseException:
            copies.release(held)
            raise
        if history is not None:
            history.commit([first.token_id])
        session = _Session(
            call.session_id, call.role, cache, held, copies, call.prefix_id, call.capacity,
            history=history,
        )  # fmt: skip
        with self._lock:
            self._sessions[call.session_id] = session
        if self._warm is not None and call.role is DraftRole.DRAFT and call.host_tier_grant:
            proofs = self._secret.fetch_metadata(call.session_id, call.host_tier_grant)
            fetcher = self._fetcher(call.transfer_address, into_tier=True)
            self._warm.stream(call.prefix_id, nbytes, fetcher, proofs)
        if first is None:
            return DrafterOpened(None, traffic)
        return DrafterOpened(first.token_id, traffic, reused, first.logprobs)

    def _prefix_copy(
        self, call: OpenDrafter, nbytes: int
    ) -> tuple[HeldPrefix[KVCache], SharedPrefixes[KVCache], Traffic]:
        """The session's prefix's copy, pinned, where it is held, and what fetching it cost
        (`nbytes`: the prefix's full KV).
        Full KV goes to the host tier where the node has one (read there with no fetch once it
        holds it, as a full-KV server with a host-memory tier keeps what it fetched), unless the
        prefix is larger than the whole tier; else to the device's copies, fetched over the link
        where they hold none."""
        kind = fetch_kind(call.role)
        proofs = self._secret.fetch_metadata(call.session_id, call.fetch_grant)
        if (
            kind == KVKind.FULL
            and self._warm is not None
            and nbytes <= self._warm.tier.budget_bytes
        ):
            tier = self._warm.tier
            held = tier.acquire_held((call.prefix_id, kind))
            if held is not None:
                return held, tier, Traffic()
            fetcher = self._fetcher(call.transfer_address, into_tier=True)
            fetched = fetcher.fetch(call.prefix_id, kind, proofs, nbytes=nbytes)
            traffic = Traffic(link_bytes=fetched.link_bytes, link_s=fetched.seconds)
            return fetched.held, tier, traffic
        fetched = self._fetcher(call.transfer_address).fetch(call.prefix_id, kind, proofs)
        traffic = Traffic(link_bytes=fetched.link_bytes, link_s=fetched.seconds)
        return fetched.held, self._prefixes, traffic

    def draft(self, call: DraftCall) -> Drafted:
        """A round's whole draft: up to `num_drafts` greedy tokens after `pending`, batched with
        the drafter's other sessions step by step. `exact`: the verifier's KV of the tokens
        committed since the last round, which replaces what this cache drafted for them."""
        time.sleep(call.arrives_in_s)  # an emulated link: the call is on its way until then
        with self._using(call.session_id) as session:
            if call.exact is not None:
                take_exact(session.cache, call.exact)
            if call.kept_set is not None:
                session.kept_set_version = take_kept_set(
                    session.session_id, session.cache, session.prefix.cache.num_tokens,
                    session.kept_set_version, call.kept_set,
                )  # fmt: skip
            drafted = self._draft(session, call)
        return drafted

    def _draft(self, session: _Session, call: DraftCall | LocalRoundCall) -> Drafted:
        """Up to `num_drafts` tokens after `pending`, batched with the other sessions' steps;
        says whether the node is warm for the session's prefix."""
        warm = self._warm is not None and self._warm.is_warm(session.prefix_id)
        version = session.kept_set_version
        if call.num_drafts == 0:
            return Drafted((), 0.0, is_warm=warm, kept_set_version=version)
        rejects = checks_by_rejection(call.sampler)
        grammar = self._grammars.constraint(call.session_id, call.grammar)
        job = Job(
            session.cache, list(call.pending), max_steps=call.num_drafts, end_ids=call.end_ids,
            sampler=call.sampler, keeps_processed=rejects, constraint=grammar,
            # A greedy draft's tokens stay on the device until its last step: one host wait a
            # draft, none a step.
            defers_choices=call.sampler is None and grammar is None,
        )  # fmt: skip
        started = time.perf_counter()
        tokens = self._loop.run(job)
        step_s = (time.perf_counter() - started) / job.steps
        distributions = torch.cat(job.processed).softmax(-1).cpu() if rejects else None
        return Drafted(tuple(tokens), step_s, distributions, warm, version)

    def open_local(self, call: OpenLocal) -> LocalOpened:
        """Puts the session's verification on this node, which must be warm for its prefix: its
        full KV over the host tier's copy (warm_node.py), and the draft cache brought up to
        `history` with exact KV (the central verifier's last round's, then the local prefill's
        for whatever it still lacks: the whole prompt after the prefix, for a request that
        starts here)."""
        if self._warm is None:
            raise InvalidRequestError("this drafter has no host tier to verify from")
        with self._using(call.session_id) as session:
            opened = self._warm.open(
                call.session_id, session.prefix_id, call.history, session.capacity,
                call.needs_first_token, call.sampler,
                self._grammars.constraint(call.session_id, call.grammar),
            )  # fmt: skip
            if opened is None:
                return LocalOpened(is_local=False)
            if call.exact is not None:
                take_exact(session.cache, call.exact)
            if session.cache.num_tokens < len(call.history):
                exact = ExactKV.of(opened.cache, session.cache.num_tokens, len(call.history))
                take_exact(session.cache, exact)
            if call.steer_every:
                num_prefix = session.prefix.cache.num_tokens
                session.steering = KeptSetSteering.of(
                    call.steer_every, session.cache, num_prefix, session.cache.compressor
                )
        first = opened.first
        if first is None:
            return LocalOpened(True, None, opened.reused_tokens)
        return LocalOpened(True, first.token_id, opened.reused_tokens, first.logprobs)

    def local_round(self, call: LocalRoundCall) -> LocalRound:
        """A whole round on this node: the drafts over the compressed KV, their verification over
        the host tier's full KV (the verifier's code, verification.py), and the committed
        tokens' exact KV into the draft cache, without crossing the link."""
        with self._using(call.session_id) as session:
            drafted = self._draft(session, call)
            grammar = self._grammars.constraint(call.session_id, call.grammar)
            steering = session.steering
            done = self._warm.verify(
                call.session_id, call.pending, drafted, call.sampler, grammar,
                steering.observe if steering is not None else None,
            )  # fmt: skip
            take_exact(session.cache, done.exact)
            if steering is not None and steering.round_done():  # the full KV is beside it
                steering.refresh(session.cache, self._warm.full_cache(call.session_id))
        return LocalRound(
            drafted.tokens, done.tokens, done.num_accepted, done.forward_s, done.logprobs
        )

    def decode(self, call: DecodeCall) -> Decoded:
        """LOSSY or FULL: up to `max_tokens` greedy tokens after `pending`, alone."""
        with self._using(call.session_id) as session:
            cache = session.cache
            is_full = session.role is DraftRole.FULL
            history = session.history
            if history is not None:
                history.feed(cache.num_tokens - session.prefix.cache.num_tokens, call.pending)
            job = Job(
                cache,
                list(call.pending),
                max_steps=call.max_tokens,
                end_ids=call.end_ids,
                is_full_kv=is_full,
                after_step=None if is_full else (lambda: update_compressed(cache)),
                sampler=call.sampler,
                reports_logprobs=True,
                constraint=self._grammars.constraint(call.session_id, call.grammar),
            )
            tokens = self._loop.run(job)
            if history is not None:
                history.commit(tokens)
        return Decoded(tuple(tokens), Traffic(), tuple(job.logprobs))

    def close_session(self, session_id: str) -> None:
        self._grammars.drop(session_id)
        with self._lock:
            session = self._sessions.pop(session_id, None)
            if session is not None:
                session.is_closed = True
                if not session.is_in_use:
                    self._release(session)

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    def batching(self) -> BatchingStats:
        loop = self._loop.forward_loop
        return BatchingStats(
            loop.num_steps, loop.max_batch, loop.num_rows, loop.cpu_s, loop.exact_cpu_s
        )

    def shutdown(self) -> None:
        self._loop.stop()
        self._sessions.clear()
        for fetcher in [*self._fetchers.values(), *self._tier_fetchers.values()]:
            fetcher.close()
        self._fetchers.clear()
        self._tier_fetchers.clear()

    @contextlib.contextmanager
    def _using(self, session_id: str) -> Iterator[_Session]:
        """The session, whose buffers are not released while a call works on it."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                raise SessionNotFoundError(f"the drafter holds no session {session_id!r}")
            session.is_in_use = True
        try:
            yield session
        except BaseException:
            if session.history is not None:
                session.history.forget()  # what its cache holds now is not known
            raise
        finally:
            with self._lock:
                session.is_in_use = False
                if session.is_closed:
                    self._release(session)

    def _release(self, session: _Session) -> None:
        """Once no call uses it: its KV after the prefix kept for a later turn (FULL), its
        caches, and its pins on the prefix's copies."""
        if session.history is not None:
            num_prefix = session.prefix.cache.num_tokens
            session.history.keep_cache(self._turns, session.prefix_id, session.cache, num_prefix)
        session.cache.release(self._buffers)
        session.copies.release(session.prefix)
        if self._warm is not None:
            self._warm.close(session.session_id)

    def _fetcher(self, address: str, into_tier: bool = False) -> KVFetcher:
        """The fetcher from a verifier's KVTransfer service into the device's copies, or into
        the host tier's."""
        fetchers, copies = self._fetchers, self._prefixes
        if into_tier:
            fetchers, copies = self._tier_fetchers, self._warm.tier
        if address not in fetchers:
            fetchers[address] = KVFetcher(address, self.info.fingerprint, copies, self.runner.rope)
        return fetchers[address]
