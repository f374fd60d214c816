"""A slow link, emulated on the real bytes a sender puts on it.

Drafters sit on remote machines: compressed KV reaches them over a network link far slower than
the verifier's local store; full KV reaches a device over PCIe from host memory (long-context
mode) or a store. `ThrottledLink` paces every chunk a stream sends to a configured bandwidth
and delays the stream's first chunk by the link's one-way latency, so a transfer of B bytes takes
latency + B / bandwidth, whatever the chunking. Streams share the link: concurrent transfers split
its bandwidth, as on a real wire. Off (`LinkSpec()`) in production, where the network is real.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from dataclasses import dataclass

from vericache.errors import InvalidRequestError

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "ki": 2**10, "mi": 2**20, "gi": 2**30}
_BANDWIDTH = re.compile(r"^\s*([0-9.]+)\s*([kmg]i?)?b(?:/s|ps)\s*$", re.IGNORECASE)
_DURATION = re.compile(r"^\s*([0-9.]+)\s*(us|ms|s)\s*$", re.IGNORECASE)


def parse_bandwidth(text: str) -> float:
    """'1.2GB/s' -> 1.2e9 bytes/s ('MiB/s' for powers of two)."""
    match = _BANDWIDTH.match(text)
    if match is None or float(match[1]) <= 0:
        raise InvalidRequestError(f"bandwidth {text!r} is not like '1.2GB/s' or '800MiB/s'")
    return float(match[1]) * _UNITS[(match[2] or "").lower()]


_SIZE = re.compile(r"^\s*([0-9.]+)\s*([kmg]i?)?b?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'4GiB' -> 4 * 2**30 bytes, '500MB' -> 5e8, '1024' -> 1024."""
    match = _SIZE.match(text)
    if match is None:
        raise InvalidRequestError(f"size {text!r} is not like '4GiB', '500MB' or '1024'")
    return int(float(match[1]) * _UNITS[(match[2] or "").lower()])


def parse_duration(text: str) -> float:
    """'2ms' -> 0.002 seconds."""
    match = _DURATION.match(text)
    if match is None:
        raise InvalidRequestError(f"duration {text!r} is not like '2ms', '500us' or '0.1s'")
    return float(match[1]) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[match[2].lower()]


@dataclass(frozen=True)
class LinkSpec:
    bandwidth: float | None = None  # bytes per second; None: unthrottled
    latency: float = 0.0  # seconds, one way

    def __post_init__(self):
        if self.bandwidth is not None and not self.bandwidth > 0:
            raise InvalidRequestError(f"link bandwidth must be > 0, got {self.bandwidth}")
        if not self.latency >= 0:
            raise InvalidRequestError(f"link latency must be >= 0, got {self.latency}")

    @classmethod
    def parse(cls, bandwidth: str | None, latency: str | None) -> LinkSpec:
        return cls(
            parse_bandwidth(bandwidth) if bandwidth else None,
            parse_duration(latency) if latency else 0.0,
        )

    def transfer_s(self, num_bytes: float) -> float:
        """Seconds `num_bytes` take on the wire at its bandwidth (latency apart)."""
        return num_bytes / self.bandwidth if self.bandwidth else 0.0

    @property
    def is_throttled(self) -> bool:
        return self.bandwidth is not None or self.latency > 0


class ThrottledLink:
    """Paces the chunks of transfers to `spec`; counts bytes and time spent waiting."""

    def __init__(self, spec: LinkSpec = LinkSpec(), clock=time.monotonic):
        self.spec = spec
        self._clock = clock
        self._free_at = 0.0  # when the wire finishes the bytes already scheduled on it
        self.bytes_sent = 0
        self._lock = threading.Lock()  # senders on several threads share the wire

    def schedule(self, num_bytes: int, first: bool) -> float:
        """Books `num_bytes` on the wire; returns the seconds until they have arrived."""
        with self._lock:
            now = self._clock()
            start = max(now, self._free_at)
            duration = self.spec.transfer_s(num_bytes)
            self._free_at = start + duration
            self.bytes_sent += num_bytes
            return self._free_at - now + (self.spec.latency if first else 0.0)

    async def send(self, num_bytes: int, first: bool = False) -> float:
        """Waits until a chunk of `num_bytes` has crossed the link; returns the seconds waited.
        `first` marks a transfer's first chunk, which also pays the latency."""
        delay = self.schedule(num_bytes, first)
        if delay > 0:
            await asyncio.sleep(delay)
        return max(delay, 0.0)

    def send_blocking(self, num_bytes: int, first: bool = False, background: bool = False) -> float:
        """`send` for threads that are not running an event loop. A `background` chunk waits
        for the wire to fall idle first, so transfers that need their bytes now (a drafter's
        compressed prefix, a round's exact KV) pass it: it delays them by one chunk at most."""
        waited = 0.0
        while background and (idle_in := self._idle_in()) > 0:
            time.sleep(idle_in)
            waited += idle_in
        delay = self.schedule(num_bytes, first)
        if delay > 0:
            time.sleep(delay)
        return waited + max(delay, 0.0)

    def _idle_in(self) -> float:
        """Seconds until the bytes booked so far have left the wire."""
        with self._lock:
            return self._free_at - self._clock()
