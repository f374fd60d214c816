"""Restarts (serve/restarts.py): each is timed from its worker found gone to its answer again,
and a migrating request waits long enough for the slowest start or restart seen."""

from __future__ import annotations

from vericache.serve import restarts
from vericache.serve.metrics import ServeMetrics
from vericache.serve.restarts import RESTART_MARGIN, Restarts
from vericache.serve.worker_api import WorkerStartup


class Clock:
    def __init__(self):
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


def test_a_restart_is_timed_recorded_and_lengthens_the_wait(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(restarts, "time", clock)
    metrics = ServeMetrics("m")
    timer = Restarts(configured_wait_s=10.0, metrics=metrics)
    timer.started(WorkerStartup(model_s=1.0, kernels_s=0.5, rest_s=0.5))
    assert timer.wait_s() == 10.0  # 3 x 2 s is within the configured wait
    timer.gone("drafter-0")
    clock.now += 2.0
    timer.gone("drafter-0")  # found gone again while it restarts: timed from the first
    clock.now += 3.0
    timer.back("drafter-0", "drafter", WorkerStartup(2.0, 0.1, 0.1))
    labels = {"model_name": "m", "kind": "drafter"}
    assert metrics.registry.get_sample_value("vericache:worker_restart_seconds_sum", labels) == 5
    assert timer.wait_s() == RESTART_MARGIN * 5.0  # past the configured 10 s
    timer.back("drafter-0", "drafter", WorkerStartup(2.0, 0.1, 0.1))  # no death: nothing timed
    assert metrics.registry.get_sample_value("vericache:worker_restart_seconds_count", labels) == 1


def test_a_slow_first_start_lengthens_the_wait_before_any_restart():
    timer = Restarts(configured_wait_s=60.0)
    timer.started(WorkerStartup(model_s=95.0, kernels_s=0.1, rest_s=4.9))  # a large model
    assert timer.wait_s() == RESTART_MARGIN * 100.0
