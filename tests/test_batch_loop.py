"""A worker's batch thread after it stopped: a job handed to it is refused at once, never left
waiting (the worker's shutdown waits for the thread of every call in flight)."""

from __future__ import annotations

import threading

from vericache.engine.forward_loop import Job
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
