"""A verifier's resident sessions: within the budget, evicted least recently used first (keeping the
tokens after the prefix), and their buffers reused only once no call uses them."""

from __future__ import annotations

import threading

import pytest
import torch

from vericache.errors import WorkerUnavailableError
from vericache.kv.cache import KVCache
from vericache.kv.exact import ExactKV
from vericache.kv.pool import BufferPool
from vericache.serve.residency import ResidentSessions, Session
from vericache.serve.worker import SessionNotFoundError
from vericache.serve.worker_api import Traffic

LAYERS, HEADS, DIM, CAPACITY = 2, 2, 8, 256
PREFIX = tuple(range(10))


def _sessions(budget_bytes: int) -> ResidentSessions:
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
    return ResidentSessions(budget_bytes, slot_bytes, load_prefix, pool)


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
