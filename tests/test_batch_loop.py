"""A worker's batch thread after it stopped: a job handed to it is refused at once, never left
waiting (the worker's shutdown waits for the thread of every call in flight). A whole greedy
draft run as one job whose tokens stay on the device: the same tokens, read in one wait."""

from __future__ import annotations

import threading

import pytest

from vericache.bench.decode_speed_tiny import counted_syncs
from vericache.engine.forward_loop import ForwardLoop, Job
from vericache.engine.request import SamplingParams
from vericache.engine.sampling import SequenceSampler
from vericache.errors import WorkerUnavailableError
from vericache.serve.workers.batching import BatchLoop


def _run_in_thread(loop: BatchLoop, job: Job) -> list:
    """What `loop.run(job)` returned or raised, if it ended within a few seconds; [] if not."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(loop.run(job))
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)  # daemon: a hang fails, not blocks, the run
    thread.start()
    thread.join(10)
    return outcome


def test_a_job_after_stop_is_refused_not_left_waiting():
    loop = BatchLoop(runner=None, name="test-batch-loop")  # no forward runs: no model needed
    loop.stop()
    outcome = _run_in_thread(loop, Job(cache=None, feed=[1]))
    assert outcome, "the job waited for a loop that had stopped"
    assert isinstance(outcome[0], WorkerUnavailableError)


def test_jobs_already_done_need_no_thread():
    loop = BatchLoop(runner=None, name="test-batch-loop")
    loop.stop()
    assert _run_in_thread(loop, Job(cache=None, feed=[1], max_steps=0)) == [[]]


def test_a_deferring_draft_chooses_the_same_tokens_with_one_wait(tiny_engine):
    engine = tiny_engine()
    prompt = tuple(range(3, 40))
    full = engine.prefix_kv(prompt)
    loop = ForwardLoop(engine.runner)

    def draft(defers: bool, end_ids=frozenset()) -> tuple[list[int], int]:
        job = Job(full.clone(64), [7], 12, end_ids=end_ids, defers_choices=defers)
        with counted_syncs() as syncs:
            while not job.is_done:
                loop.step([job])
        return job.choices, sum(syncs.values())

    stepped, waits = draft(False)
    deferred, deferred_waits = draft(True)
    assert deferred == stepped and len(stepped) == 12
    assert (waits, deferred_waits) == (12, 1)
    # Drafts that end in one step are read together: one wait for them all.
    jobs = [Job(full.clone(64), [7], 12, defers_choices=True) for _ in range(3)]
    with counted_syncs() as syncs:
        while not all(job.is_done for job in jobs):
            loop.step(jobs)
    assert sum(syncs.values()) == 1 and all(job.choices == stepped for job in jobs)
    # An end token stops a stepped draft; a deferring one's tokens are cut after it.
    end = frozenset({stepped[4]})
    assert draft(True, end)[0] == draft(False, end)[0] == stepped[: stepped.index(stepped[4]) + 1]


def test_only_a_greedy_unconstrained_job_defers_its_choices():
    with pytest.raises(ValueError, match="greedy, unconstrained"):
        sampler = SequenceSampler(SamplingParams(temperature=0.8, seed=1), 1, (3, 4), ())
        Job(None, [1], 4, sampler=sampler, defers_choices=True)
