"""Admission (vericache/serve/front/admission.py): requests on a resident prefix go first, none
waits past its bound, a full queue refuses, and a cancelled waiter gives up its place."""

from __future__ import annotations

import asyncio

import pytest

from vericache.errors import QueueFullError
from vericache.serve.front.admission import Admission


async def _queue(admission: Admission, prefixes: list[str | None]) -> list[asyncio.Task]:
    """Waiters on `prefixes`, arriving in that order."""
    tasks = []
    for prefix in prefixes:
        tasks.append(asyncio.create_task(admission.admit(prefix)))
        await asyncio.sleep(0.01)
    return tasks


def _admitted(tasks: list[asyncio.Task]) -> list[int]:
    return [i for i, task in enumerate(tasks) if task.done()]


def test_a_request_on_a_resident_prefix_goes_first():
    async def main():
        admission = Admission(max_running=1, max_waiting=8, max_skip_s=60)
        await admission.admit("a")
        tasks = await _queue(admission, ["b", None, "a", "c"])
        admission.release("a")  # "a" is resident still: its request goes before "b" and None
        await asyncio.sleep(0)
        assert _admitted(tasks) == [2]
        admission.release("a")  # none resident now but "a" (ended just now), none waits on it
        await asyncio.sleep(0)
        assert _admitted(tasks) == [0, 2]  # then in order of arrival
        assert admission.num_resident_first == 1

    asyncio.run(main())


def test_no_request_waits_past_its_bound_for_later_ones():
    async def main():
        admission = Admission(max_running=1, max_waiting=8, max_skip_s=0.05)
        await admission.admit("a")
        tasks = await _queue(admission, ["b", "a"])
        await asyncio.sleep(0.06)  # "b" has waited its bound
        admission.release("a")
        await asyncio.sleep(0)
        assert _admitted(tasks) == [0]
        admission.release("b")
        await asyncio.sleep(0)
        assert _admitted(tasks) == [0, 1]

    asyncio.run(main())


def test_a_full_queue_refuses_and_a_cancelled_waiter_leaves_it():
    async def main():
        admission = Admission(max_running=1, max_waiting=2, max_skip_s=60)
        await admission.admit(None)
        tasks = await _queue(admission, ["a", "b"])
        with pytest.raises(QueueFullError, match="1 requests are running and 2 waiting"):
            await admission.admit("c")
        tasks[0].cancel()
        await asyncio.sleep(0)
        assert admission.num_waiting == 1
        admission.release(None)
        await asyncio.sleep(0)
        assert tasks[1].done() and admission.num_running == 1 and admission.num_waiting == 0

    asyncio.run(main())
