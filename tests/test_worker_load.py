"""A worker's load over time (serve/workers/worker_load.py): what `mode: auto` charges a request
with is its worker's mean count of requests while it ran, not the count when it started."""

from __future__ import annotations

import pytest

from tests.test_link import FakeClock
from vericache.serve.workers.worker_load import WorkerLoad


def test_a_request_that_starts_alone_is_charged_with_those_that_join_it():
    clock = FakeClock()
    load = WorkerLoad(clock)
    load.count += 1  # the request starts alone
    mark = load.mark()
    clock.now += 1.0
    load.count += 2  # two more join for the rest of its life
    clock.now += 3.0
    assert load.mean_since(mark) == pytest.approx((1 * 1.0 + 3 * 3.0) / 4.0)
    assert load.count == 3


def test_no_time_gives_the_count_now_and_a_negative_count_is_refused():
    clock = FakeClock()
    load = WorkerLoad(clock)
    load.count = 2
    assert load.mean_since(load.mark()) == 2.0
    with pytest.raises(ValueError):
        load.count = -1
