"""A simulated VeriCache verifier's sessions' own full KV, kept as serve/workers/residency.py keeps
it: within a budget, held after a call until another needs the room (least recent and idle first),
rebuilt over the shared prefix by the next call that needs it (nothing read from the store), a
call waiting while what is in use fills the budget."""

from __future__ import annotations

from vericache.sim.events import Simulation
from vericache.sim.residency import SimResidency

FULL = 100  # a session's own full KV


def _residency(num_sessions: int, budget: int = 2 * FULL):
    sim = Simulation()
    residency = SimResidency(budget)
    for key in range(num_sessions):
        residency.open(key, FULL)
    return sim, residency


def _call(sim: Simulation, residency: SimResidency, key: int, log: list, forward_s=0.5) -> None:
    """One call on the session: it holds the full KV for its forward, then lets go."""

    def forward() -> None:
        sim.after(forward_s, lambda: (residency.release(key), log.append((key, sim.now))))

    residency.use(key, forward)


def test_a_session_stays_resident_between_calls_while_nothing_needs_its_room():
    sim, residency = _residency(2)
    log = []
    for key in (0, 1, 0, 1):
        _call(sim, residency, key, log)
        sim.run()
    assert log[-1] == (1, 2.0)  # four forwards of 0.5 s: making a session resident costs none
    assert residency.held_bytes == residency.peak_bytes == 2 * FULL


def test_the_least_recently_used_idle_session_makes_room_and_is_rebuilt_when_called():
    sim, residency = _residency(3)
    log = []
    for key in (0, 1, 2):  # 2 drops 0, the least recent
        _call(sim, residency, key, log)
        sim.run()
    assert residency.held_bytes == residency.peak_bytes == 2 * FULL
    _call(sim, residency, 0, log)  # rebuilt, dropping 1
    sim.run()
    assert log[-1] == (0, 2.0) and residency.peak_bytes == 2 * FULL


def test_a_call_waits_while_the_sessions_in_use_fill_the_budget():
    sim, residency = _residency(3)
    log = []
    for key in range(3):  # all at once: the third waits for a call to end
        _call(sim, residency, key, log, forward_s=2.0)
    sim.run()
    assert log == [(0, 2.0), (1, 2.0), (2, 4.0)]
    assert residency.peak_bytes == 2 * FULL


def test_a_held_session_is_not_dropped_and_a_closed_one_frees_its_room():
    sim, residency = _residency(3)
    held = []
    residency.use(0, lambda: held.append(sim.now))  # pinned, as by a load ahead
    residency.use(1, lambda: held.append(sim.now))
    waiting = []
    residency.use(2, lambda: waiting.append(sim.now))
    assert held == [0.0, 0.0] and not waiting  # nothing idle to drop
    residency.release(0)
    residency.close(0)
    assert waiting == [0.0]


def test_a_session_that_does_not_fit_holds_up_none_behind_it():
    """A (5 bytes) held; C (6) cannot be made resident beside it, B (5) can: B goes at once, as
    each of the served verifier's waiters checks for its own room."""
    residency = SimResidency(10)
    for key, size in (("a", 5), ("c", 6), ("b", 5)):
        residency.open(key, size)
    ready = []
    residency.use("a", lambda: ready.append("a"))
    residency.use("c", lambda: ready.append("c"))
    residency.use("b", lambda: ready.append("b"))
    assert ready == ["a", "b"]
    residency.release("a")
    residency.release("b")
    assert ready == ["a", "b", "c"]
