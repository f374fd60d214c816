"""The simulator's event core: time order, devices and links keep their accounts."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from vericache.errors import InvalidRequestError
from vericache.sim.events import Device, Link, Simulation, SimulationError


def test_events_run_in_time_order_and_ties_in_scheduling_order():
    sim, seen = Simulation(), []
    for time, label in ((2.0, "c"), (1.0, "a"), (2.0, "d"), (1.0, "b")):
        sim.at(time, lambda label=label: seen.append((sim.now, label)))
    sim.run()
    assert seen == [(1.0, "a"), (1.0, "b"), (2.0, "c"), (2.0, "d")]
    assert sim.is_idle and sim.num_events == 4
    with pytest.raises(SimulationError):
        sim.at(1.5, lambda: None)  # the past
    with pytest.raises(SimulationError):
        sim.after(-1.0, lambda: None)


def test_a_run_stops_at_its_horizon_and_goes_on_from_there():
    sim, seen = Simulation(), []
    for time in (1.0, 3.0):
        sim.at(time, lambda: seen.append(sim.now))
    sim.run(until=2.0)
    assert seen == [1.0] and sim.now == 2.0 and not sim.is_idle
    sim.run()
    assert seen == [1.0, 3.0]


def test_a_run_that_never_ends_is_stopped():
    sim = Simulation()

    def again():
        sim.after(1.0, again)

    sim.at(0.0, again)
    with pytest.raises(SimulationError, match="does not end"):
        sim.run(max_events=100)


def test_a_device_runs_work_one_item_at_a_time_in_order():
    sim = Simulation()
    device, finished = Device(sim, "gpu0"), []
    for seconds, label in ((2.0, "first"), (1.0, "second"), (0.5, "third")):
        device.submit(seconds, lambda label=label: finished.append((sim.now, label)))
    assert device.queue_length == 2 and device.is_busy
    sim.run()
    assert finished == [(2.0, "first"), (3.0, "second"), (3.5, "third")]
    assert device.busy_s == pytest.approx(3.5) and device.num_done == 3
    assert device.wait_s == pytest.approx(0 + 2.0 + 3.0)
    assert device.queue_length == 0 and not device.is_busy
    with pytest.raises(InvalidRequestError):
        device.submit(-1.0, lambda: None)


def test_a_link_delivers_each_transfer_after_its_bytes_and_its_latency():
    sim = Simulation()
    link, arrived = Link(sim, "network", bytes_per_s=100.0, latency_s=0.5), []
    link.send(200, lambda: arrived.append(("a", sim.now)))
    link.send(100, lambda: arrived.append(("b", sim.now)))
    sim.run(until=1.0)
    assert link.bytes_in_flight == 300 and arrived == []
    sim.run()
    # a: 2 s of bytes then 0.5 s; b: its bytes leave after a's, from 2 to 3 s.
    assert arrived == [("a", 2.5), ("b", 3.5)]
    assert link.seconds_for(100) == pytest.approx(1.5)
    with pytest.raises(InvalidRequestError):
        Link(sim, "broken", bytes_per_s=0.0)


def test_random_traffic_conserves_bytes_and_busy_time_and_no_queue_goes_negative():
    rng = random.Random(7)
    sim = Simulation()
    link, device = Link(sim, "store", 1e9, 1e-3), Device(sim, "verifier")
    sent, worked, lowest = 0, 0.0, []

    def check():
        lowest.append(min(device.queue_length, link.bytes_in_flight))
        assert link.bytes_delivered + link.bytes_in_flight == link.bytes_sent

    for _ in range(500):
        at, nbytes, seconds = rng.uniform(0, 10), rng.randrange(1, 10**8), rng.uniform(0, 0.02)
        sent, worked = sent + nbytes, worked + seconds

        def arrive(nbytes=nbytes, seconds=seconds):
            sim.at(sim.now, check)
            link.send(nbytes, lambda: device.submit(seconds, check))

        sim.at(at, arrive)
    sim.run()
    assert link.bytes_sent == link.bytes_delivered == sent
    assert link.busy_s == pytest.approx(sent / 1e9)
    assert device.busy_s == pytest.approx(worked) and device.num_done == 500
    assert min(lowest) >= 0 and sim.is_idle
    assert sim.now >= max(link.busy_s, device.busy_s)


def test_the_simulator_is_pure_python():
    code = (
        "import sys, vericache.sim.events, vericache.sim.cost, vericache.sim.profiles, "
        "vericache.sim.workload, vericache.sim.long_context, vericache.sim.scenario, "
        "vericache.sim.remote_prefix, vericache.sim.decoding, "
        "vericache.sim.remote_prefix_scheduled, vericache.sim.plan; "
        "print(sorted({'torch', 'numpy', 'ray', 'grpc'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_links_moved_bytes_count_the_transfer_in_progress():
    sim = Simulation()
    link, seen = Link(sim, "wire", 100.0, latency_s=1.0), []
    link.send(200, lambda: None)
    for at in (0.5, 1.0, 2.0, 3.5):
        sim.at(at, lambda: seen.append((link.bytes_moved, link.bytes_delivered)))
    sim.run()
    # 100 bytes/s: half way at 0.5 s... all 200 gone at 2 s, delivered a second later.
    assert seen == [(50, 0), (100, 0), (200, 0), (200, 200)]
