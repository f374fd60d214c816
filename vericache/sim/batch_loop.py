"""A simulated worker's batch loop: the jobs it holds share each forward, step by step, as a
worker's BatchLoop runs them (serve/workers/batching.py): jobs join and leave between forwards.

A job is a run of forwards for one request: a prefill, a draft of d tokens (d one-token steps), a
verification (one step of x+1 tokens), or a decode of n tokens. Each forward costs what the cost
model gives for the rows of every job it holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from vericache.sim.cost import Row
from vericache.sim.events import Device


@dataclass(eq=False)  # compared by identity: two equal jobs are two pieces of work
class SimJob:
    row: Callable[[], Row]  # this job's row in the next forward
    num_steps: int
    done: Callable[[], None]
    on_step: Callable[[], None] | None = None  # after each of its forwards (a token committed)
    steps_taken: int = 0
    is_prefill: bool = False  # passes in a few forwards: not part of the worker's steady batch


@dataclass(frozen=True)
class ForwardCount:
    """A batch loop's forwards, the jobs they held and the seconds they took, as a served
    worker's BatchingStats counts them (steps, rows, forward CPU seconds): rows over forwards is
    the mean batch, seconds over forwards what one cost."""

    forwards: int = 0
    rows: int = 0
    seconds: float = 0.0

    def __add__(self, other: ForwardCount) -> ForwardCount:
        return ForwardCount(
            self.forwards + other.forwards, self.rows + other.rows, self.seconds + other.seconds
        )

    def __sub__(self, other: ForwardCount) -> ForwardCount:
        return ForwardCount(
            self.forwards - other.forwards, self.rows - other.rows, self.seconds - other.seconds
        )

    @property
    def mean_batch(self) -> float:
        return self.rows / self.forwards if self.forwards else 0.0

    @property
    def mean_seconds(self) -> float:
        return self.seconds / self.forwards if self.forwards else 0.0


def chunked_job(rows: list[Row], done: Callable[[], None]) -> SimJob:
    """A prefill in chunks (`rows`, in order): one chunk a forward, each batched with the device's
    other rows, as chunked prefill runs it."""
    job = SimJob(
        lambda: rows[min(job.steps_taken, len(rows) - 1)], len(rows), done, is_prefill=True
    )
    return job


class SimBatchLoop:
    def __init__(self, device: Device, forward_s: Callable[[list[Row]], float]):
        self.device = device
        self.forward_s = forward_s
        self._active: list[SimJob] = []
        self._arrived: list[SimJob] = []
        self._running = False
        self.num_forwards = 0
        self.num_rows = 0  # jobs summed over its forwards
        self.forwards_s = 0.0  # its forwards' seconds

    def submit(self, job: SimJob) -> None:
        if job.num_steps < 1:
            job.done()
            return
        self._arrived.append(job)
        if not self._running:  # after whatever else is due now: jobs arriving together batch
            self._running = True
            self.device.sim.after(0.0, self._step)

    @property
    def count(self) -> ForwardCount:
        return ForwardCount(self.num_forwards, self.num_rows, self.forwards_s)

    @property
    def num_jobs(self) -> int:
        return len(self._active) + len(self._arrived)

    def current_rows(self) -> list[Row]:
        """The rows its next forward would hold, were no job to join or leave: its load now."""
        return [job.row() for job in self._active + self._arrived]

    def steady_rows(self) -> list[Row]:
        """`current_rows` but the prefills': the decodes, drafts and verifications that set
        the worker's pace from one forward to the next."""
        return [job.row() for job in self._active + self._arrived if not job.is_prefill]

    def _step(self) -> None:
        self._active += self._arrived
        self._arrived = []
        if not self._active:
            self._running = False
            return
        self._running = True
        jobs = list(self._active)
        seconds = self.forward_s([job.row() for job in jobs])
        self.num_forwards += 1
        self.num_rows += len(jobs)
        self.forwards_s += seconds
        self.device.submit(seconds, lambda: self._stepped(jobs))

    def _stepped(self, jobs: list[SimJob]) -> None:
        finished = []
        for job in jobs:
            job.steps_taken += 1
            if job.on_step is not None:
                job.on_step()
            if job.steps_taken >= job.num_steps:
                finished.append(job)
        self._active = [job for job in self._active if job not in finished]
        for job in finished:
            job.done()
        self._step()
