"""Which sessions' full KV a verifier keeps on its device, within a budget of bytes.

The verifier holds at most `budget_bytes` of sessions' own full KV (a session larger than that
alone): what each holds after the blocks of its prefix that it reads in place from the worker's
shared copy (kv/prefixed.py), which kv/shared_prefix.py budgets. Past it, the least recently used
sessions not in use drop their cache and keep only the exact KV of the tokens after the prefix;
their next call rebuilds it over the shared copy (`load_prefix`), waiting for room while the full
KV of calls in progress, or loaded ahead of a verification (`Session.is_pinned`), fills the budget.
The buffers of a closed or evicted session go back to the worker's `BufferPool` for the next
session, once no call uses them.

A scheduled load (`load_ahead`) makes a session resident in the background and pins it there;
the session's next call waits for that load and reports what it cost, so the load needs no call
of its own.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from vericache.errors import WorkerUnavailableError
from vericache.kv.cache import KVCache
from vericache.kv.exact import ExactKV
from vericache.kv.pool import BufferPool
from vericache.kv.shared_prefix import HeldPrefix
from vericache.serve.workers.turn_cache import TurnTokens
from vericache.serve.workers.worker import SessionNotFoundError
from vericache.serve.workers.worker_api import Residency, Traffic

log = logging.getLogger(__name__)


@dataclass
class Session:
    prefix_tokens: tuple[int, ...]
    capacity: int  # cache slots
    cache: KVCache | None = None  # None: evicted; `tail` holds the tokens after the prefix
    tail: ExactKV | None = None
    is_in_use: bool = False  # a call is working on it: not to be evicted
    is_pinned: bool = False  # loaded ahead of its verification: not to be evicted either
    is_closed: bool = False  # its request ended while a call used it: release when that ends
    namespace: str = ""  # where the store keeps its prefix's KV: the prefix owner's
    # The worker's shared copy of its prefix's KV (kv/shared_prefix.py), pinned while the session
    # lives: its cache is built from it, and rebuilt from it after an eviction.
    shared: HeldPrefix | None = None
    # Its tokens after the prefix, for a later turn to reuse its KV (turn_cache.py).
    history: TurnTokens = field(default_factory=lambda: TurnTokens(()))

    def kv_after_prefix(self) -> ExactKV:
        """Its full KV after the prefix (a copy, or its evicted tail as it is)."""
        if self.cache is None:
            return self.tail
        return ExactKV.of(self.cache, len(self.prefix_tokens), self.cache.num_tokens)

    @property
    def own_slots(self) -> int:
        """Slots of its cache that are its own: its capacity less its prefix's shared copy."""
        return self.capacity - (len(self.prefix_tokens) if self.shared else 0)


# A session's prefix KV made resident: the cache (with room for its capacity) and what it cost.
PrefixLoader = Callable[[Session], tuple[KVCache, Traffic]]


class ResidentSessions:
    def __init__(
        self,
        budget_bytes: int,
        slot_bytes: int,
        load_prefix: PrefixLoader,
        pool: BufferPool,
        release_prefix: Callable[[HeldPrefix], None],
        on_closed: Callable[[Session], None] = lambda session: None,
    ):
        self.budget_bytes = budget_bytes
        self.slot_bytes = slot_bytes  # one token of full KV in a cache slot
        self._load_prefix = load_prefix
        # Unpins a closed session's shared prefix, once no call reads it through the session.
        self._release_prefix = release_prefix
        # Sees a closed session once no call uses it, before its cache goes (turn_cache.py).
        self._on_closed = on_closed
        self.pool = pool
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._lock = threading.Lock()  # calls run on many threads
        self._room = threading.Condition(self._lock)  # signalled when full KV may have freed
        self._loading_bytes = 0  # full KV of the loads in progress, not resident yet
        self._peak_bytes = 0
        self._is_closed = False  # the worker shut down: calls waiting for room give up
        self._ahead: dict[str, Future[Traffic]] = {}  # loads ahead of a session's next call
        # A thread per load in progress, as the calls that load run: a load waiting for room
        # must not hold up the loads of the sessions whose verifications would make it.
        self._ahead_threads = ThreadPoolExecutor(8, thread_name_prefix="load-ahead")

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def add(self, session_id: str, session: Session) -> None:
        with self._lock:
            self._sessions[session_id] = session

    def remove(self, session_id: str) -> None:
        """Forgets the session (its cache and its pin on its prefix go once no call uses it)."""
        with self._lock:
            session = self._sessions.pop(session_id, None)
            pending = self._ahead.pop(session_id, None)
            if pending is not None:
                pending.cancel()  # if it has not begun; else it finds the session closed
            if session is not None:
                session.is_closed = True
                if not session.is_in_use:
                    self._release(session)
            self._room.notify_all()

    def clear(self) -> None:
        """Forgets every session, for good: calls waiting for room are woken and refused."""
        with self._lock:
            self._sessions.clear()
            self._ahead.clear()
            self._is_closed = True
            self._room.notify_all()
        self._ahead_threads.shutdown(wait=False, cancel_futures=True)

    def _release(self, session: Session) -> None:
        if session.is_closed and (session.cache is not None or session.tail is not None):
            self._on_closed(session)
        if session.cache is not None:
            session.cache.release(self.pool)
            session.cache = None
        if session.is_closed and session.shared is not None:
            self._release_prefix(session.shared)
            session.shared = None

    def residency(self) -> Residency:
        with self._lock:
            return Residency(self._resident_bytes(), self._peak_bytes)

    def load_ahead(self, session_id: str) -> None:
        """Starts making the session resident in the background and pins it there until its
        next call (`using`), which waits for the load."""
        with self._lock:
            if self._is_closed or session_id in self._ahead or session_id not in self._sessions:
                return  # shut down, loading already, or closed meanwhile (its request ended)
            self._ahead[session_id] = self._ahead_threads.submit(self._pin, session_id)

    def _pin(self, session_id: str) -> Traffic:
        with self._resident(session_id) as (session, loaded):
            session.is_pinned = True
        return loaded

    def _take_ahead(self, session_id: str) -> Traffic:
        """Waits for the session's load ahead, if one was started: what it cost. A load that
        failed is left to the call itself, which loads again and reports its own error."""
        with self._lock:
            pending = self._ahead.pop(session_id, None)
        if pending is None:
            return Traffic()
        try:
            return pending.result()
        except Exception as error:  # noqa: BLE001 - the caller's own load tells what is wrong
            log.debug("load ahead of session %s failed: %s", session_id, error)
            return Traffic()

    @contextlib.contextmanager
    def using(self, session_id: str) -> Iterator[tuple[Session, Traffic]]:
        """The session with its full KV resident, safe from eviction while in use, and what
        making it resident cost (its load ahead's, if one ran). One call per session at a time
        (a request's rounds are sequential); sessions run concurrently."""
        ahead = self._take_ahead(session_id)
        with self._resident(session_id) as (session, loaded):
            try:
                yield session, ahead + loaded
            finally:
                session.is_pinned = False

    @contextlib.contextmanager
    def _resident(self, session_id: str) -> Iterator[tuple[Session, Traffic]]:
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                raise SessionNotFoundError(f"the verifier holds no session {session_id!r}")
            self._sessions.move_to_end(session_id)
            session.is_in_use = True
            incoming = 0 if session.cache is not None else session.own_slots * self.slot_bytes
            self._wait_for_room(incoming)
            self._loading_bytes += incoming
        try:
            try:
                loaded = self._make_resident(session)  # outside the lock: others go on
            finally:
                with self._lock:
                    self._loading_bytes -= incoming
                    self._peak_bytes = max(self._peak_bytes, self._resident_bytes())
            try:
                yield session, loaded
            except BaseException:
                session.history.forget()  # what its cache holds now is not known
                raise
        finally:
            with self._lock:
                session.is_in_use = False
                if session.is_closed:
                    self._release(session)
                self._evict_beyond_budget()
                self._room.notify_all()

    def _make_resident(self, session: Session) -> Traffic:
        if session.cache is not None:
            return Traffic()
        cache, traffic = self._load_prefix(session)
        if session.tail is not None:
            cache.append_exact(session.tail)
        session.cache, session.tail = cache, None
        return traffic

    def _wait_for_room(self, incoming: int) -> None:
        """Evicts idle sessions until a load of `incoming` bytes fits the budget, waiting while
        the full KV in use, pinned or loading does not leave room; a session larger than the
        budget loads once no other full KV is held. Called with the lock held."""
        while incoming:
            if self._is_closed:
                raise WorkerUnavailableError("the worker is shutting down")
            self._evict_beyond_budget(incoming)
            held = self._resident_bytes() + self._loading_bytes
            if held + incoming <= self.budget_bytes or held == 0:
                return
            self._room.wait()

    def _evict_beyond_budget(self, incoming: int = 0) -> None:
        """Least recently used sessions not in use drop their prefix's KV (keeping the tokens
        after it) until residency, with `incoming` bytes about to load, fits the budget. Called
        with the lock held."""
        for victim in list(self._sessions.values()):
            if self._resident_bytes() + self._loading_bytes + incoming <= self.budget_bytes:
                return
            if victim.cache is None or victim.is_in_use or victim.is_pinned:
                continue
            num_prefix = len(victim.prefix_tokens)
            victim.tail = ExactKV.of(victim.cache, num_prefix, victim.cache.num_tokens)
            self._release(victim)

    def _resident_bytes(self) -> int:
        return sum(s.cache.nbytes for s in self._sessions.values() if s.cache is not None)
