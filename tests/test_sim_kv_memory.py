"""A simulated worker's KV memory: paged prefix sharing, and VeriCache's own way (a private copy
per session from a bounded LRU of fetched prefixes), whose misses fetch again."""

from __future__ import annotations

from vericache.sim.events import Link, Simulation
from vericache.sim.kv_memory import Session, WorkerMemory

PREFIX_BYTES = 1000


def _serve(memory: WorkerMemory, sim: Simulation, prefixes: list[int]) -> list[float]:
    """Sessions over `prefixes`, one after another; when each got its prefix."""
    ready: list[float] = []

    def start(index: int) -> None:
        if index == len(prefixes):
            return
        session = Session(prefixes[index], PREFIX_BYTES, 10)

        def opened() -> None:
            ready.append(sim.now)
            memory.release(session)
            start(index + 1)

        memory.admit(session, opened)

    start(0)
    sim.run()
    return ready


def test_paged_sharing_fetches_each_prefix_once():
    sim = Simulation()
    link = Link(sim, "in", bytes_per_s=1000.0)
    memory = WorkerMemory(10 * PREFIX_BYTES, link)
    _serve(memory, sim, [0, 1, 0, 1])
    assert link.bytes_delivered == 2 * PREFIX_BYTES


def test_an_lru_too_small_for_two_prefixes_fetches_on_every_alternation():
    """VeriCache's drafter with room for 1.5 prefixes, over two prefixes in turn: every session
    misses, as in bench remote-prefix's FULL_REMOTE."""
    sim = Simulation()
    link = Link(sim, "in", bytes_per_s=1000.0)
    memory = WorkerMemory(10 * PREFIX_BYTES, link, lru_bytes=int(1.5 * PREFIX_BYTES))
    ready = _serve(memory, sim, [0, 1, 0, 1, 1])
    assert link.bytes_delivered == 4 * PREFIX_BYTES  # the last session hits
    assert ready[-1] == ready[-2]  # a hit waits for nothing
    assert memory.used_bytes == PREFIX_BYTES  # the LRU's one prefix; every session released


def test_no_lru_fetches_for_every_session_and_sessions_hold_their_own_copy():
    sim = Simulation()
    link = Link(sim, "in", bytes_per_s=1000.0)
    memory = WorkerMemory(10 * PREFIX_BYTES, link, lru_bytes=0)
    admitted = []
    for _ in range(3):
        memory.admit(Session(0, PREFIX_BYTES, 10), lambda: admitted.append(sim.now))
    assert memory.used_bytes == 3 * (PREFIX_BYTES + 10)  # each its own copy
    sim.run()
    # Each loaded its own copy, one after another over the link.
    assert len(admitted) == 3 and link.bytes_delivered == 3 * PREFIX_BYTES
    assert admitted == [1.0, 2.0, 3.0]
    assert memory.peak_bytes == 3 * (PREFIX_BYTES + 10)
