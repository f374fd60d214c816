"""The workers that run beside a worker on its memory system (`ModelInfo.memory_system`: the CPU
machine's, or one GPU's), busy now and over a request's life.

Such workers slow each other down: every forward streams its weights and KV from the same memory
(a CPU machine's DRAM bandwidth; vericache/calibration/co_runner.py measures how much). `mode: auto`
prices a path on a worker at the co-runners busy now (path_costs.py), and corrects its prices by
what a request took against the co-runners that were busy, on average, while it ran. A path that
sets an idle worker computing slows the busy ones beside it: auto weighs that too
(`started_beside`).
"""

from __future__ import annotations

from dataclasses import dataclass


def busy_co_runners(worker, workers: list) -> int:
    """The alive workers other than `worker` on its memory system with a request computing on
    them now (none where its memory system is not known)."""
    return sum(1 for other in _beside(worker, workers) if other.active)


@dataclass(frozen=True)
class StartedBeside:
    """On one memory system: its busy workers, the requests computing on them, and how many idle
    workers a path sets computing beside them."""

    num_requests: int
    num_busy: int
    num_starting: int


def started_beside(starting: list, workers: list) -> tuple[StartedBeside, ...]:
    """Per memory system of the workers `starting` (those a path computes on), where it sets an
    idle one computing beside busy ones."""
    groups = []
    for system in {worker.memory_system for worker in starting if worker.memory_system}:
        busy = [w for w in workers if w.is_alive and w.memory_system == system and w.active]
        idle = [w for w in starting if w.memory_system == system and not w.active]
        if busy and idle:
            groups.append(StartedBeside(sum(w.active for w in busy), len(busy), len(idle)))
    return tuple(groups)


class CoRunnerMeter:
    """The mean count of busy co-runners of a worker from its making on: the time integral of
    each one's busy indicator (`_Handle.busy`) over the time since."""

    def __init__(self, worker, workers: list):
        self._marks = [(other, other.busy.mark()) for other in _beside(worker, workers)]

    def mean(self) -> float:
        return sum(other.busy.mean_since(mark) for other, mark in self._marks)


def _beside(worker, workers: list) -> list:
    system = worker.memory_system
    if not system:
        return []
    return [w for w in workers if w is not worker and w.is_alive and w.memory_system == system]
