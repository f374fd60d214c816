"""A verifier's resident sessions: within the budget, evicted least recently used first (keeping the
tokens after the prefix), and their buffers reused only once no call uses them."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.serve_fixtures import wait_for
from vericache.errors import WorkerUnavailableError
from vericache.kv.cache import KVCache
from vericache.kv.exact import ExactKV
from vericache.kv.pool import BufferPool
from vericache.serve.workers.residency import ResidentSessions, Session
from vericache.serve.workers.turn_cache import TurnTokens
from vericache.serve.workers.worker import SessionNotFoundError
from vericache.serve.workers.worker_api import Traffic

LAYERS, HEADS, DIM, CAPACITY = 2, 2, 8, 256
PREFIX = tuple(range(10))


def _sessions(budget_bytes: int, release_prefix=lambda held: None) -> ResidentSessions:
    pool = BufferPool(1 << 30)

    def load_prefix(session: Session) -> tuple[KVCache, Traffic]:
        cache = KVCache.empty(LAYERS, HEADS, DIM, torch.float32, "cpu", session.capacity, pool)
        fresh = KVCache.empty(LAYERS, HEADS, DIM, torch.float32, "cpu", len(PREFIX))
        for layer in fresh.layers:
            keys = torch.randn(len(PREFIX), HEADS, DIM)
            layer.append(keys, keys + 1, torch.arange(len(PREFIX), dtype=torch.int32))
        fresh.num_tokens = len(PREFIX)
        cache.append_exact(ExactKV.of(fresh, 0, len(PREFIX)))
        return cache, Traffic(store_bytes=cache.nbytes)

    slot_bytes = LAYERS * 2 * HEADS * DIM * 4
    return ResidentSessions(budget_bytes, slot_bytes, load_prefix, pool, release_prefix)


def test_a_session_closed_during_a_call_keeps_its_buffers_until_the_call_ends():
    sessions = _sessions(budget_bytes=1 << 30)
    sessions.add("a", Session(PREFIX, CAPACITY))
    with sessions.using("a") as (session, loaded):
        assert loaded.store_bytes > 0
        sessions.remove("a")  # the request was cancelled while its verification ran
        assert sessions.pool.nbytes == 0 and session.cache.num_tokens == len(PREFIX)
    assert session.cache is None and sessions.pool.nbytes > 0
    with pytest.raises(SessionNotFoundError):
        with sessions.using("a"):
            pass


def test_eviction_keeps_the_tail_and_frees_the_prefix_for_the_next_session():
    slot_bytes = LAYERS * 2 * HEADS * DIM * 4
    budget = (CAPACITY + 5) * slot_bytes  # one session loading, and a few tokens of another
    sessions = _sessions(budget)
    sessions.add("a", Session(PREFIX, CAPACITY))
    with sessions.using("a") as (session, _):
        new = torch.randn(1, HEADS, DIM)
        for layer in session.cache.layers:
            layer.append(new, new, torch.tensor([len(PREFIX)], dtype=torch.int32))
        session.cache.num_tokens += 1
    sessions.add("b", Session(PREFIX, CAPACITY))
    with sessions.using("b"):
        assert session.cache is None  # a was evicted: its prefix freed, its own token kept
        assert session.tail.start == len(PREFIX) and session.tail.num_tokens == 1
        assert sessions.pool.num_reused > 0  # b took a's buffers
    with sessions.using("a") as (session, loaded):  # b is evicted in turn; a reloads
        assert session.cache.num_tokens == len(PREFIX) + 1 and loaded.store_bytes > 0
    assert sessions.residency().peak_bytes <= budget


def test_a_call_waiting_for_room_is_refused_when_the_worker_shuts_down():
    """A load that waits for room while another call holds the budget must not wait forever
    once the worker clears its sessions (its shutdown waits for every call's thread)."""
    slot_bytes = LAYERS * 2 * HEADS * DIM * 4
    sessions = _sessions(budget_bytes=CAPACITY * slot_bytes)  # one session's full KV
    sessions.add("a", Session(PREFIX, CAPACITY))
    sessions.add("b", Session(PREFIX, CAPACITY))
    outcome: list[BaseException] = []

    def load_b() -> None:
        try:
            with sessions.using("b"):
                pass
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            outcome.append(exc)

    with sessions.using("a"):
        waiter = threading.Thread(target=load_b)
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive()  # "a" is in use: "b" waits for room
        sessions.clear()
        waiter.join(10)
    assert not waiter.is_alive()
    assert isinstance(outcome[0], WorkerUnavailableError)


def test_a_load_ahead_pins_the_session_and_its_next_call_reports_it():
    """A scheduled load makes the session resident in the background and keeps it from eviction
    until its next call, which reports what the load cost (the load made no call of its own)."""
    slot_bytes = LAYERS * 2 * HEADS * DIM * 4
    sessions = _sessions(budget_bytes=CAPACITY * slot_bytes)  # one session's full KV
    sessions.add("a", Session(PREFIX, CAPACITY))
    sessions.add("b", Session(PREFIX, CAPACITY))
    sessions.load_ahead("a")
    sessions.load_ahead("a")  # asked twice, loaded once
    assert wait_for(lambda: sessions.residency().bytes > 0)
    with sessions.using("a") as (session, loaded):
        assert session.is_pinned and loaded.store_bytes == session.cache.nbytes
    assert not session.is_pinned
    with sessions.using("a") as (_, loaded):
        assert loaded.store_bytes == 0  # resident already, and the load was reported once


def test_a_pinned_session_is_not_evicted_for_another():
    slot_bytes = LAYERS * 2 * HEADS * DIM * 4
    sessions = _sessions(budget_bytes=CAPACITY * slot_bytes)
    sessions.add("a", Session(PREFIX, CAPACITY))
    sessions.add("b", Session(PREFIX, CAPACITY))
    sessions.load_ahead("a")
    assert wait_for(lambda: sessions.residency().bytes > 0)
    outcome: list[Traffic] = []

    def load_b() -> None:
        with sessions.using("b") as (_, loaded):
            outcome.append(loaded)

    waiter = threading.Thread(target=load_b)
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive()  # "a" is pinned until its own call: "b" waits for room
    with sessions.using("a"):
        pass  # a's call unpins it, and it may then be evicted
    waiter.join(10)
    assert not waiter.is_alive() and outcome[0].store_bytes > 0


def test_a_load_ahead_of_a_removed_session_leaves_nothing_resident():
    sessions = _sessions(budget_bytes=1 << 30)
    sessions.add("a", Session(PREFIX, CAPACITY))
    sessions.load_ahead("a")
    sessions.remove("a")
    assert wait_for(lambda: sessions.residency().bytes == 0)
    with pytest.raises(SessionNotFoundError):
        with sessions.using("a"):
            pass


def test_a_load_ahead_of_a_session_already_closed_starts_nothing():
    sessions = _sessions(budget_bytes=1 << 30)
    sessions.load_ahead("gone")  # its request ended before the call that carried the load
    assert sessions._ahead == {}


def test_a_closed_session_unpins_its_prefix_once_its_last_call_ends():
    # Its cache reads the shared prefix in place: the pin must outlast a call in flight.
    released = []
    sessions = _sessions(budget_bytes=1 << 30, release_prefix=released.append)
    held = object()
    sessions.add("a", Session(PREFIX, CAPACITY, shared=held))
    with sessions.using("a"):
        sessions.remove("a")
        assert released == []
    assert released == [held]
    sessions.add("b", Session(PREFIX, CAPACITY, shared=held))
    sessions.remove("b")
    assert released == [held, held]


def test_a_closed_session_is_seen_once_with_its_kv_unless_a_call_failed_in_it():
    closed = []
    sessions = _sessions(budget_bytes=1 << 30)
    sessions._on_closed = lambda session: closed.append(session.kv_after_prefix().num_tokens)
    sessions.add("a", Session(PREFIX, CAPACITY, history=TurnTokens([7])))
    with sessions.using("a") as (session, _):
        new = torch.randn(1, HEADS, DIM)
        for layer in session.cache.layers:
            layer.append(new, new, torch.tensor([len(PREFIX)], dtype=torch.int32))
        session.cache.num_tokens += 1
    sessions.remove("a")
    assert closed == [1]
    sessions.add("b", Session(PREFIX, CAPACITY, history=TurnTokens([7])))
    with pytest.raises(RuntimeError):
        with sessions.using("b") as (failed, _):
            raise RuntimeError("a forward failed midway")
    assert failed.history.ids is None  # what its cache holds is no longer known
