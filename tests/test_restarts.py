"""Restarts (serve/backends/restarts.py): each is timed from its worker found gone to its answer
from a new process, and a migrating request waits long enough for the slowest start a worker
reported."""

from __future__ import annotations

from vericache.serve.backends import restarts
from vericache.serve.backends.metrics import ServeMetrics
from vericache.serve.backends.restarts import RESTART_MARGIN, Restarts
from vericache.serve.workers.worker_api import WorkerStartup

LABELS = {"model_name": "m", "kind": "drafter"}


class Clock:
    def __init__(self):
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


def startup(total_s: float, process: str) -> WorkerStartup:
    return WorkerStartup(model_s=total_s / 2, kernels_s=0.0, rest_s=total_s / 2, process=process)


def test_a_restart_is_timed_and_recorded_once_a_new_process_answers(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(restarts, "time", clock)
    metrics = ServeMetrics("m")
    sample = metrics.registry.get_sample_value
    timer = Restarts(configured_wait_s=10.0, metrics=metrics)
    timer.started("drafter-0", startup(2.0, "host:1"))
    assert timer.wait_s() == 10.0  # 3 x 2 s is within the configured wait
    timer.gone("drafter-0")
    clock.now += 2.0
    timer.gone("drafter-0")  # found gone again while it restarts: timed from the first
    clock.now += 3.0
    timer.back("drafter-0", "drafter", startup(4.0, "host:2"))
    assert sample("vericache:worker_restart_seconds_sum", LABELS) == 5.0
    assert timer.wait_s() == RESTART_MARGIN * 4.0  # the new process's own start: past 10 s
    timer.back("drafter-0", "drafter", startup(4.0, "host:2"))  # not found gone: nothing timed
    assert sample("vericache:worker_restart_seconds_count", LABELS) == 1


def test_a_worker_that_answers_again_from_the_same_process_did_not_restart(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(restarts, "time", clock)
    metrics = ServeMetrics("m")
    timer = Restarts(configured_wait_s=60.0, metrics=metrics)
    timer.started("drafter-0", startup(2.0, "host:1"))
    timer.gone("drafter-0")  # silent to a probe for a while
    clock.now += 1200.0
    timer.back("drafter-0", "drafter", startup(2.0, "host:1"))
    assert metrics.registry.get_sample_value("vericache:worker_restart_seconds_count", LABELS) == 0
    assert timer.wait_s() == 60.0  # however long it was away


def test_a_slow_first_start_lengthens_the_wait_before_any_restart():
    timer = Restarts(configured_wait_s=60.0)
    timer.started("verifier-0", startup(100.0, "host:1"))  # a large model
    assert timer.wait_s() == RESTART_MARGIN * 100.0
