"""Workers on one memory system (serve/backends/co_runners.py): those busy beside a worker now, and
their mean over a request's life, which `mode: auto` prices and corrects its paths by."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.test_link import FakeClock
from vericache.serve.backends.co_runners import CoRunnerMeter, busy_co_runners
from vericache.serve.workers.worker_load import WorkerLoad


def worker(clock: FakeClock, memory_system: str, active: int = 0, alive: bool = True):
    busy = WorkerLoad(clock)
    busy.count = 1 if active else 0
    return SimpleNamespace(memory_system=memory_system, active=active, is_alive=alive, busy=busy)


def test_only_busy_alive_workers_of_the_same_memory_system_count():
    clock = FakeClock()
    verifier = worker(clock, "cpu:a", active=2)
    drafter = worker(clock, "cpu:a")
    elsewhere = worker(clock, "cpu:b", active=1)
    dead = worker(clock, "cpu:a", active=1, alive=False)
    unknown = worker(clock, "", active=1)
    workers = [verifier, drafter, elsewhere, dead, unknown]
    assert busy_co_runners(drafter, workers) == 1  # the verifier
    assert busy_co_runners(verifier, workers) == 0  # the drafter is idle
    assert busy_co_runners(elsewhere, workers) == 0
    assert busy_co_runners(unknown, workers) == 0  # a memory system not known is shared by none


def test_a_request_is_charged_with_the_share_of_its_life_its_co_runners_were_busy():
    clock = FakeClock()
    verifier, drafter = worker(clock, "cpu:a"), worker(clock, "cpu:a")
    meter = CoRunnerMeter(drafter, [verifier, drafter])
    clock.now += 1.0
    verifier.busy.count = 1  # a request starts on the verifier for the last three quarters
    clock.now += 3.0
    assert meter.mean() == pytest.approx(0.75)
