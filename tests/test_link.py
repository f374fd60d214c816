"""The emulated slow link: parsing, pacing arithmetic, and measured throughput on real time."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.timing import SLACK, async_slept_s, slept_s
from vericache.engine.link import LinkSpec, ThrottledLink, parse_bandwidth, parse_duration
from vericache.errors import InvalidRequestError


@pytest.mark.parametrize(
    "text, expected",
    [("1.2GB/s", 1.2e9), ("800MiB/s", 800 * 2**20), ("10 kb/s", 1e4), ("5Bps", 5.0)],
)
def test_parse_bandwidth(text, expected):
    assert parse_bandwidth(text) == pytest.approx(expected)


@pytest.mark.parametrize("text, expected", [("2ms", 0.002), ("500us", 5e-4), ("0.1s", 0.1)])
def test_parse_duration(text, expected):
    assert parse_duration(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["fast", "0GB/s", "-1MB/s", "1GB"])
def test_bad_bandwidth_is_refused(text):
    with pytest.raises(InvalidRequestError):
        parse_bandwidth(text)


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_transfer_takes_latency_plus_bytes_over_bandwidth_whatever_the_chunking():
    clock = FakeClock()
    link = ThrottledLink(LinkSpec(bandwidth=1000.0, latency=0.5), clock)
    delays = [link.schedule(100, first=index == 0) for index in range(10)]
    # Chunks are booked back to back on the wire; only the first pays the latency.
    assert delays == pytest.approx([0.6, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0])
    assert link.bytes_sent == 1000
    clock.now += 5.0  # an idle wire does not bank bandwidth for later
    assert link.schedule(500, first=False) == pytest.approx(0.5)


def test_unthrottled_link_never_waits():
    link = ThrottledLink(LinkSpec())
    assert not link.spec.is_throttled
    assert link.send_blocking(10**9) == 0.0 and link.bytes_sent == 10**9


def test_measured_rate_matches_the_configured_bandwidth():
    bandwidth = 20e6
    link = ThrottledLink(LinkSpec(bandwidth=bandwidth))
    chunk, count = 256 * 1024, 12  # 3 MiB: about 0.16 s
    start = time.perf_counter()
    for index in range(count):
        link.send_blocking(chunk, first=index == 0)
    elapsed = time.perf_counter() - start
    # Never faster than the link; slower only by how late a busy machine wakes the sender, as it
    # wakes a plain sleep of as long.
    assert chunk * count / elapsed <= 1.02 * bandwidth
    assert elapsed <= SLACK * slept_s(chunk * count / bandwidth)


def test_concurrent_streams_share_the_bandwidth():
    bandwidth = 20e6
    link = ThrottledLink(LinkSpec(bandwidth=bandwidth))

    async def stream(num_chunks: int):
        for index in range(num_chunks):
            await link.send(200_000, first=index == 0)

    async def both():
        start = time.perf_counter()
        await asyncio.gather(stream(8), stream(8))  # 3.2 MB in all
        return time.perf_counter() - start

    elapsed = asyncio.run(both())
    # Shared, never faster; slower only by how late a busy machine wakes the senders, as it wakes
    # an event loop's sleep of as long.
    assert 3.2e6 / elapsed <= 1.02 * bandwidth
    assert elapsed <= SLACK * asyncio.run(async_slept_s(3.2e6 / bandwidth))
