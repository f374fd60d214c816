"""Continuous batching inside a worker: one forward per step for every request it is serving.

Worker methods run on many threads at once (a threaded Ray actor, or the in-process pool). Each
call prepares its request's cache on its own thread (a store load, the verifier's exact KV), then
hands a `DecodeJob` to the worker's `BatchLoop` and waits. The loop runs on one thread: every step
it takes in the jobs that arrived, runs one batched forward over all of them (one per kernel kind:
fast for drafts and lossy steps, batch-invariant for full-KV work), and returns the jobs that are
done. Requests join and leave between steps, as in vLLM's continuous batching.

A job is one call's worth of work on one cache: up to `max_steps` greedy tokens (a draft, a chunk
of full or lossy decoding), or a single step choosing `num_logits` tokens (a verification).
Batch-invariant kernels give every sequence the same bits whatever else shares its batch, so
batched verification and full decoding stay exactly equal to decoding alone.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from vericache.engine.engine import greedy
from vericache.kv.cache import KVCache
from vericache.model.runner import ModelRunner, SequenceInput


@dataclass
class DecodeJob:
    cache: KVCache
    feed: list[int]  # tokens the cache does not hold yet, fed at the next step
    max_steps: int = 1
    num_logits: int = 1  # choices wanted from the first step (a verification wants 1 + drafts)
    end_ids: frozenset[int] = frozenset()  # stop after choosing one of these
    invariant: bool = False  # batch-invariant kernels (every full-KV forward)
    after_step: Callable[[], None] | None = None  # e.g. an online compressor's update
    choices: list[int] = field(default_factory=list)
    steps: int = 0

    @property
    def done(self) -> bool:
        ended = bool(self.choices) and self.choices[-1] in self.end_ids
        return self.steps >= self.max_steps or ended

    def sequence_input(self) -> SequenceInput:
        observe = self.cache.observe if getattr(self.cache, "records_queries", False) else None
        ids = torch.tensor(self.feed, dtype=torch.long)
        num_logits = self.num_logits if self.steps == 0 else 1
        return SequenceInput(ids, self.cache, num_logits, observe)

    def advance(self, chosen: list[int]) -> None:
        """Records one step's greedy choices; the last one is fed next."""
        self.choices.extend(chosen)
        self.feed = chosen[-1:]
        self.steps += 1
        if self.after_step is not None:
            self.after_step()


class BatchLoop:
    def __init__(self, runner: ModelRunner, name: str):
        self.runner = runner
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self.num_steps = 0
        self.max_batch = 0  # the largest batch a step has run

    def run(self, job: DecodeJob) -> list[int]:
        """Runs `job` to completion among the others; returns its greedy choices."""
        return self.run_many([job])[0]

    def run_many(self, jobs: list[DecodeJob]) -> list[list[int]]:
        """Runs `jobs` to completion among the others, all joining at the same step (a scheduled
        iteration's batch must not be split between two forwards); returns their choices."""
        arrivals = [(job, Future()) for job in jobs if not job.done]
        if arrivals:
            self._inbox.put(arrivals)
        for _, finished in arrivals:
            finished.result()  # raises the step's error, if any
        return [job.choices for job in jobs]

    def stop(self) -> None:
        self._inbox.put(None)
        self._thread.join(30)

    def _run(self) -> None:
        active: list[tuple[DecodeJob, Future]] = []
        while True:
            groups = [self._inbox.get()] if not active else []
            while True:  # take in everything that is waiting
                try:
                    groups.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            arrivals = [arrival for group in groups if group is not None for arrival in group]
            if None in groups:
                for _, finished in active + arrivals:
                    finished.set_exception(RuntimeError("the worker is shutting down"))
                return
            active += arrivals
            active = self._step(active)

    def _step(self, active: list[tuple[DecodeJob, Future]]) -> list[tuple[DecodeJob, Future]]:
        """One forward per kernel kind over the active jobs; returns those still running."""
        try:
            for invariant in (False, True):
                jobs = [job for job, _ in active if job.invariant is invariant]
                if jobs:
                    logits = self.runner.forward([j.sequence_input() for j in jobs], invariant)
                    for job, chosen in zip(jobs, greedy(logits)):
                        job.advance(chosen)
        except Exception as exc:  # noqa: BLE001 - the callers get the error, the loop goes on
            for _, finished in active:
                finished.set_exception(exc)
            return []
        self.num_steps += 1
        self.max_batch = max(self.max_batch, len(active))
        running = []
        for job, finished in active:
            if job.done:
                finished.set_result(job.choices)
            else:
                running.append((job, finished))
        return running
