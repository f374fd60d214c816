"""A simulated VeriCache verifier's full KV, kept as serve/residency.py keeps it: within a budget,
held after a call until a load needs the room (least recent and idle first), loaded again by the
next call that needs it, a load waiting while what is in use fills the budget."""

from __future__ import annotations

from vericache.sim.events import Link, Simulation
from vericache.sim.residency import SimResidency

FULL, PREFIX = 100, 80  # a session's full KV, and what its load moves (its prefix)


def _residency(num_sessions: int, budget: int = 2 * FULL):
    sim = Simulation()
    link = Link(sim, "store", bytes_per_s=80.0)  # a load takes 1 s
    residency = SimResidency(budget, link)
    for key in range(num_sessions):
        residency.open(key, FULL, PREFIX)
    return sim, link, residency


def _call(sim: Simulation, residency: SimResidency, key: int, log: list, forward_s=0.5) -> None:
    """One call on the session: it holds the full KV for its forward, then lets go."""

    def forward() -> None:
        sim.after(forward_s, lambda: (residency.release(key), log.append((key, sim.now))))

    residency.use(key, forward)


def test_a_session_stays_resident_between_calls_while_nothing_needs_its_room():
    sim, link, residency = _residency(2)
    log = []
    for key in (0, 1, 0, 1):
        _call(sim, residency, key, log)
        sim.run()
    assert link.bytes_delivered == 2 * PREFIX  # each loaded once, then held
    assert log[-1] == (1, 4.0)  # two loads of 1 s and four forwards of 0.5 s, nothing more
    assert residency.held_bytes == residency.peak_bytes == 2 * FULL


def test_the_least_recently_used_idle_session_makes_room_and_loads_again_when_called():
    sim, link, residency = _residency(3)
    log = []
    for key in (0, 1, 2, 0):  # 2 drops 0 (least recent); 0 drops 1
        _call(sim, residency, key, log)
        sim.run()
    assert link.bytes_delivered == 4 * PREFIX
    assert residency.peak_bytes == 2 * FULL
    _call(sim, residency, 2, log)  # still held
    sim.run()
    assert link.bytes_delivered == 4 * PREFIX


def test_a_load_waits_while_the_sessions_in_use_fill_the_budget():
    sim, link, residency = _residency(3)
    log = []
    for key in range(3):  # all at once: the third waits for a call to end
        _call(sim, residency, key, log, forward_s=2.0)
    sim.run()
    # Two loads one after the other on the link (by 1 s and 2 s), their forwards end at 3 and 4;
    # the third load starts once the first lets go (3, not when the link is free at 2).
    assert log == [(0, 3.0), (1, 4.0), (2, 6.0)]
    assert residency.peak_bytes == 2 * FULL


def test_a_held_session_is_not_dropped_and_a_closed_one_frees_its_room():
    sim, link, residency = _residency(3)
    held = []
    residency.use(0, lambda: held.append(sim.now))  # pinned, as by a load ahead
    residency.use(1, lambda: held.append(sim.now))
    sim.run()
    waiting = []
    residency.use(2, lambda: waiting.append(sim.now))
    sim.run()
    assert held == [1.0, 2.0] and not waiting  # nothing idle to drop
    residency.release(0)
    residency.close(0)
    sim.run()
    assert waiting == [3.0] and link.bytes_delivered == 3 * PREFIX


def test_a_load_that_does_not_fit_holds_up_none_behind_it():
    """A (5 bytes) held; C (6) cannot load beside it, B (5) can: B loads at once, as each of the
    served verifier's waiters checks for its own room."""
    sim = Simulation()
    residency = SimResidency(10, Link(sim, "store", 1e9))
    for key, size in (("a", 5), ("c", 6), ("b", 5)):
        residency.open(key, size, size)
    ready = []
    residency.use("a", lambda: ready.append("a"))
    sim.run()
    residency.use("c", lambda: ready.append("c"))
    residency.use("b", lambda: ready.append("b"))
    sim.run()
    assert ready == ["a", "b"]
    residency.release("a")
    residency.release("b")
    sim.run()
    assert ready == ["a", "b", "c"]
