"""`--link-latency` costs a drafter call what a real WAN round trip does: every call waits the
one-way latency out and again back, and a draft call's way out is paid on the drafter's side, so
that its answer exists by reference from the moment it is sent. Bounds from below only: a loaded
machine is never faster than the link."""

from __future__ import annotations

import asyncio
import time

from vericache.serve.cluster_secret import ClusterSecret
from vericache.serve.workers.handles import DrafterHandle, InProcess
from vericache.serve.workers.worker_api import DraftCall, Drafted

LATENCY_S = 0.15


class _RecordingDrafter:
    """Answers at once and keeps what it was called with."""

    def __init__(self):
        self.calls: list[DraftCall] = []

    def describe(self) -> str:
        return "drafter"

    def draft(self, call: DraftCall) -> Drafted:
        self.calls.append(call)
        return Drafted(tokens=(7,) * call.num_drafts, step_s=0.0)


def _handle(worker, latency_s: float) -> DrafterHandle:
    return DrafterHandle(worker, InProcess("probe"), "probe", ClusterSecret.generate(), latency_s)


def _call(arrives_in_s: float = 0.0) -> DraftCall:
    return DraftCall("s", (1,), 3, frozenset(), None, arrives_in_s=arrives_in_s)


def test_every_call_waits_the_latency_out_and_back():
    handle = _handle(_RecordingDrafter(), LATENCY_S)
    started = time.monotonic()
    assert asyncio.run(handle.describe()) == "drafter"
    assert time.monotonic() - started >= 2 * LATENCY_S


def test_a_draft_call_pays_its_way_out_on_the_drafter_and_its_answer_comes_back():
    worker = _RecordingDrafter()
    handle = _handle(worker, LATENCY_S)

    async def draft() -> tuple[Drafted, float]:
        in_flight = handle.draft_ahead(_call(arrives_in_s=0.5))
        started = time.monotonic()
        drafted = await in_flight.drafted
        assert in_flight.answer.latency_s == LATENCY_S  # the verifier's copy crosses once too
        return drafted, time.monotonic() - started

    drafted, elapsed = asyncio.run(draft())
    assert drafted.tokens == (7, 7, 7)
    (received,) = worker.calls
    assert received.arrives_in_s == 0.5 + LATENCY_S  # the bytes' time plus the way out
    assert elapsed >= LATENCY_S  # the way back


def test_no_latency_adds_no_wait_and_leaves_the_call_as_sent():
    worker = _RecordingDrafter()
    handle = _handle(worker, 0.0)
    asyncio.run(handle.draft(_call(arrives_in_s=0.25)))
    assert worker.calls[0].arrives_in_s == 0.25
