"""A simulated worker's KV memory: one copy of each prefix, shared by its sessions, held within a
prefix budget where one is set (as VeriCache's drafter holds the prefixes it fetched within
DrafterConfig.kv_cache_bytes): pinned while used, the least recently used unpinned one evicted
for a new one."""

from __future__ import annotations

import pytest

from vericache.errors import InvalidRequestError
from vericache.sim.events import Link, Simulation
from vericache.sim.kv_memory import Session, WorkerMemory

PREFIX_BYTES = 1000
OWN_BYTES = 10


def _memory(prefix_budget_bytes: int | None = None) -> tuple[Simulation, Link, WorkerMemory]:
    sim = Simulation()
    link = Link(sim, "in", bytes_per_s=1000.0)  # a prefix arrives in 1 s
    return sim, link, WorkerMemory(100 * PREFIX_BYTES, link, True, prefix_budget_bytes)


def _session(prefix: int) -> Session:
    return Session(prefix, PREFIX_BYTES, OWN_BYTES)


def _serve(memory: WorkerMemory, sim: Simulation, prefixes: list[int]) -> list[float]:
    """Sessions over `prefixes`, one after another; when each got its prefix."""
    ready: list[float] = []

    def start(index: int) -> None:
        if index == len(prefixes):
            return
        session = _session(prefixes[index])

        def opened() -> None:
            ready.append(sim.now)
            memory.release(session)
            start(index + 1)

        memory.admit(session, opened)

    start(0)
    sim.run()
    return ready


def test_paged_sharing_fetches_each_prefix_once():
    sim, link, memory = _memory()
    _serve(memory, sim, [0, 1, 0, 1])
    assert link.bytes_delivered == 2 * PREFIX_BYTES


@pytest.mark.parametrize("budget", [None, PREFIX_BYTES], ids=["no-budget", "budget"])
def test_sessions_on_one_prefix_fetch_it_once_and_hold_one_copy(budget):
    sim, link, memory = _memory(budget)
    ready = []
    for _ in range(5):  # at once: the four after the first wait for its fetch
        memory.admit(_session(0), lambda: ready.append(sim.now))
    sim.run()
    assert ready == [1.0] * 5 and link.bytes_delivered == PREFIX_BYTES
    assert memory.peak_bytes == PREFIX_BYTES + 5 * OWN_BYTES
    memory.admit(_session(0), lambda: ready.append(sim.now))  # held: fetches nothing
    assert ready[-1] == 1.0 and link.bytes_sent == PREFIX_BYTES
    for _ in range(6):
        memory.release(_session(0))
    assert memory.used_bytes == PREFIX_BYTES  # kept after its last session, unpinned


def test_a_new_prefix_evicts_the_least_recent_unpinned_one_within_the_budget_never_a_pinned_one():
    sim, link, memory = _memory(prefix_budget_bytes=2 * PREFIX_BYTES)
    memory.admit(_session(0), lambda: None)  # pinned from here on, and the least recently used
    _serve(memory, sim, [1])  # held, unpinned
    _serve(memory, sim, [2])  # room for it: 1 goes, not 0
    assert (memory.holds(0), memory.holds(1), memory.holds(2)) == (True, False, True)
    memory.release(_session(0))
    _serve(memory, sim, [0])  # a hit: 0 is now more recent than 2
    _serve(memory, sim, [3])  # 2 goes, the least recently used of the unpinned
    assert (memory.holds(0), memory.holds(2), memory.holds(3)) == (True, False, True)
    assert link.bytes_delivered == 4 * PREFIX_BYTES  # 0, 1, 2, 3: once each
    assert memory.held_prefix_bytes <= 2 * PREFIX_BYTES


def test_where_pinned_prefixes_fill_the_budget_a_session_fetches_a_copy_of_its_own():
    """As the served SharedPrefixes does: the session is served at once, its copy dropped when it
    ends; the pinned prefix stays."""
    sim, link, memory = _memory(prefix_budget_bytes=int(1.5 * PREFIX_BYTES))
    memory.admit(_session(0), lambda: None)
    ready = _serve(memory, sim, [1, 1])  # each fetches its own copy
    assert ready == [2.0, 3.0] and link.bytes_delivered == 3 * PREFIX_BYTES
    assert memory.peak_bytes == 2 * (PREFIX_BYTES + OWN_BYTES)
    assert memory.holds(0) and not memory.holds(1)
    assert memory.used_bytes == PREFIX_BYTES + OWN_BYTES  # the copies went with their sessions
    memory.release(_session(0))
    _serve(memory, sim, [1])  # 0 unpinned: evicted for 1, which is now held
    assert memory.holds(1) and not memory.holds(0)
    with pytest.raises(InvalidRequestError, match="prefix budget"):
        memory.admit(Session(4, 2 * PREFIX_BYTES, OWN_BYTES), lambda: None)


def test_a_pinned_entry_stays_until_unpinned_and_dropping_it_admits_who_waits():
    """A full-KV turn pins its session's KV from the turn before while it reads it in place."""
    sim = Simulation()
    link = Link(sim, "in", bytes_per_s=1000.0)
    memory = WorkerMemory(2 * (PREFIX_BYTES + OWN_BYTES), link)
    memory.offer("turn", PREFIX_BYTES)
    memory.pin("turn")
    memory.admit(_session(0), lambda: None)  # fits beside it
    admitted = []
    memory.admit(_session(1), lambda: admitted.append(sim.now))  # waits: "turn" is pinned
    sim.run()
    assert memory.holds("turn") and memory.num_waiting == 1 and not admitted
    memory.unpin("turn", drop=True)
    sim.run()
    assert not memory.holds("turn") and admitted == [2.0]
    with pytest.raises(InvalidRequestError, match="not held"):
        memory.pin("turn")


def test_an_entry_kept_on_the_device_alone_is_dropped_not_spilled_when_evicted():
    """A served verifier's turn cache lives on its device: evicted, it goes nowhere."""

    class Spilled:
        def __init__(self):
            self.keys: list[str] = []

        def fetch(self, prefix, nbytes, delivered) -> None:
            delivered()

        def evicted(self, prefix, nbytes) -> None:
            self.keys.append(prefix)

    source = Spilled()
    memory = WorkerMemory(2 * PREFIX_BYTES + OWN_BYTES, None, source=source)
    memory.offer("tiered", PREFIX_BYTES)
    memory.offer("device", PREFIX_BYTES, spills=False)
    memory.admit(Session(None, 0, 2 * PREFIX_BYTES), lambda: None)  # evicts both
    assert not memory.holds("tiered") and not memory.holds("device")
    assert source.keys == ["tiered"]
