"""The long-context server's engine loop over a scripted engine (no model): one mode at a time in
arrival order, progress reported per iteration, cancellation aborting in the engine, and a
fresh engine after a failed iteration."""

from __future__ import annotations

import threading
import time

import pytest

from tests.serve_fixtures import wait_for
from vericache.compress import build_compressor
from vericache.engine.request import (
    DecodeMode,
    Request,
    RequestOutput,
    RequestStats,
    SamplingParams,
)
from vericache.errors import InvalidRequestError
from vericache.serve.backends.engine_loop import (
    EngineLoop,
    RequestFailed,
    RequestFinished,
    TokensCommitted,
)


class ScriptedEngine:
    """Commits one token (7) per iteration to every request; refuses mixed modes as the real
    engine does, and requests of more than `max_tokens`; raises from iteration `fail_at`."""

    def __init__(self, fail_at: int | None = None, max_tokens: int = 10_000):
        self.fail_at = fail_at
        self.max_tokens = max_tokens
        self.requests: dict[str, Request] = {}
        self.outputs: dict[str, list[int]] = {}
        self.modes_per_iteration: list[set[DecodeMode]] = []
        self.is_closed = False
        self._num_added = 0

    def add_request(self, request: Request) -> str:
        if {r.mode for r in self.requests.values()} - {request.mode}:
            raise InvalidRequestError("long-context decoding runs one mode at a time")
        if request.params.max_new_tokens > self.max_tokens:
            raise InvalidRequestError("the request does not fit the budget")
        key = f"lc{self._num_added}"
        self._num_added += 1
        self.requests[key], self.outputs[key] = request, []
        return key

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def run_iteration(self) -> dict[str, RequestOutput]:
        if len(self.modes_per_iteration) == self.fail_at:
            raise RuntimeError("iteration failed")
        self.modes_per_iteration.append({r.mode for r in self.requests.values()})
        time.sleep(0.002)  # a cancellation can arrive while the request runs
        finished = {}
        for key, request in list(self.requests.items()):
            self.outputs[key].append(7)
            if len(self.outputs[key]) == request.params.max_new_tokens:
                del self.requests[key]
                tokens = self.outputs.pop(key)
                finished[key] = RequestOutput(key, [], tokens, None, "length", RequestStats())
        return finished

    def output_ids(self, key: str) -> list[int]:
        return list(self.outputs.get(key, []))

    def output_logprobs(self, key: str) -> list:
        return []  # its requests ask for none

    def abort(self, key: str) -> None:
        del self.requests[key], self.outputs[key]

    def close(self) -> None:
        self.is_closed = True


class Events:
    def __init__(self):
        self.events = []
        self.ended = threading.Event()

    def __call__(self, event) -> None:
        self.events.append(event)
        if not isinstance(event, TokensCommitted):
            self.ended.set()

    def tokens(self) -> list[int]:
        return [t for e in self.events if isinstance(e, TokensCommitted) for t in e.token_ids]


def request(mode: DecodeMode, num_tokens: int = 3) -> Request:
    compressor = build_compressor("streamingllm", ratio=4) if mode is DecodeMode.VERICACHE else None
    params = SamplingParams(max_new_tokens=num_tokens)
    return Request((5, 6), 0, params, mode, compressor)


@pytest.fixture
def loops():
    started = []

    def start(make_engine) -> EngineLoop:
        started.append(EngineLoop(make_engine))
        return started[-1]

    yield start
    for loop in started:
        loop.close()


def test_modes_take_turns_in_arrival_order(loops):
    loop = loops(ScriptedEngine)
    order = [DecodeMode.VERICACHE, DecodeMode.FULL, DecodeMode.VERICACHE, DecodeMode.FULL]
    sinks = [Events() for _ in order]
    for mode, sink in zip(order, sinks):
        loop.submit(request(mode), sink)
    assert all(sink.ended.wait(10) for sink in sinks)
    for sink in sinks:
        assert isinstance(sink.events[-1], RequestFinished)
        assert sink.tokens() == [7, 7]  # reported as committed; the last comes with the finish
    assert all(len(modes) <= 1 for modes in loop.engine.modes_per_iteration)


def test_a_refused_request_fails_alone(loops):
    loop = loops(lambda: ScriptedEngine(max_tokens=100))
    refused, served = Events(), Events()
    loop.submit(request(DecodeMode.FULL, num_tokens=101), refused)
    loop.submit(request(DecodeMode.FULL), served)
    assert refused.ended.wait(10) and served.ended.wait(10)
    assert isinstance(refused.events[-1], RequestFailed)
    assert "budget" in str(refused.events[-1].error)
    assert isinstance(served.events[-1], RequestFinished)


def test_a_failed_iteration_fails_its_requests_and_a_fresh_engine_serves_on(loops):
    engines = []

    def make() -> ScriptedEngine:
        engines.append(ScriptedEngine(fail_at=1 if not engines else None))
        return engines[-1]

    loop = loops(make)
    first = Events()
    loop.submit(request(DecodeMode.FULL, num_tokens=5), first)
    assert first.ended.wait(10)
    assert isinstance(first.events[-1], RequestFailed)
    assert len(engines) == 2 and engines[0].is_closed
    after = Events()
    loop.submit(request(DecodeMode.FULL), after)
    assert after.ended.wait(10) and isinstance(after.events[-1], RequestFinished)


def test_a_cancelled_request_reports_nothing_more(loops):
    loop = loops(ScriptedEngine)
    sink = Events()
    submission = loop.submit(request(DecodeMode.VERICACHE, num_tokens=10_000), sink)
    assert wait_for(lambda: sink.events)
    loop.cancel(submission)
    # Aborted between iterations: long before its 10,000 tokens (20 s at 2 ms an iteration).
    assert wait_for(lambda: loop.num_requests == 0, timeout_s=5)
    assert not sink.ended.is_set()
    assert not loop.engine.has_unfinished
