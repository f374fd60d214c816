"""Time checks as ratios against what the same test measured on the same machine: a shared 2-core
machine can wake any thread late by tenths of a second, so no test bounds wall time by a constant.
"""

from __future__ import annotations

import asyncio
import time

# How much longer than its reference a paced piece of work may take: the sleeps of its pacing wake
# late as the reference's do, and its own work adds to them.
SLACK = 5.0


def slept_s(seconds: float) -> float:
    """What a sleep of `seconds` takes on this machine now: the reference for work paced by
    sleeps of as long in all."""
    started = time.perf_counter()
    time.sleep(seconds)
    return time.perf_counter() - started


async def async_slept_s(seconds: float) -> float:
    """`slept_s` for an event loop's sleeps."""
    started = time.perf_counter()
    await asyncio.sleep(seconds)
    return time.perf_counter() - started
