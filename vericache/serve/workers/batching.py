"""A worker's batch thread: the calls it holds share the engine's forward loop, step by step.

Worker methods run on many threads at once (a threaded Ray actor, or the in-process pool). Each
call prepares its request's cache on its own thread (a store load, the verifier's exact KV), then
hands a `Job` (the engine's, forward_loop.py) to the worker's `BatchLoop` and waits. The loop runs
on one thread: every step it takes in the jobs that arrived, steps every job it holds through the
engine's `ForwardLoop` (one forward, fast rows and batch-invariant rows together) and returns the
jobs that are done. Requests join and leave between steps, as in vLLM's continuous batching.
Batch-invariant kernels give every full-KV row the same bits whatever else shares its batch, so
batched verification and full decoding stay exactly equal to decoding alone.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future

from vericache.engine.forward_loop import ForwardLoop, Job
from vericache.errors import WorkerUnavailableError
from vericache.model.runner import ModelRunner


class BatchLoop:
    def __init__(self, runner: ModelRunner, name: str):
        self.forward_loop = ForwardLoop(runner)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # Set once stop() has queued the loop's end: a job queued after it would wait forever,
        # and with it the thread (and the worker's shutdown, which waits for its threads).
        self._stopped = False
        self._accepting = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def run(self, job: Job) -> list[int]:
        """Runs `job` to completion among the others; returns its greedy choices."""
        if job.is_done:
            return job.choices
        finished: Future = Future()
        with self._accepting:
            if self._stopped:
                raise WorkerUnavailableError("the worker is shutting down")
            self._inbox.put((job, finished))
        finished.result()  # raises the step's error, if any
        return job.choices

    def stop(self) -> None:
        with self._accepting:
            self._stopped = True
            self._inbox.put(None)  # after every job already queued: each gets its error
        self._thread.join(30)

    def _run(self) -> None:
        active: list[tuple[Job, Future]] = []
        while True:
            arrivals = [self._inbox.get()] if not active else []
            while True:  # take in everything that is waiting
                try:
                    arrivals.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            if None in arrivals:
                for _, finished in active + [a for a in arrivals if a is not None]:
                    finished.set_exception(WorkerUnavailableError("the worker is shutting down"))
                return
            active += arrivals
            active = self._step(active)

    def _step(self, active: list[tuple[Job, Future]]) -> list[tuple[Job, Future]]:
        """One step of the forward loop over the active jobs; returns those still running."""
        try:
            self.forward_loop.step([job for job, _ in active])
        except Exception as exc:  # noqa: BLE001 - the callers get the error, the loop goes on
            for _, finished in active:
                finished.set_exception(exc)
            return []
        running = []
        for job, finished in active:
            if job.is_done:
                finished.set_result(job.choices)
            else:
                running.append((job, finished))
        return running
