"""A `LongContextEngine` on a thread of its own, fed by a server's event loop.

The engine is single-threaded and advances one iteration at a time, while a server receives
requests whenever clients send them. `EngineLoop` owns the engine on its thread: requests and
cancellations arrive through an inbox between iterations, and after each iteration every request
hears of the tokens it committed through its `on_event` callback (called on the engine's thread).

One mode at a time: the engine runs VERICACHE requests or FULL requests, never both at once.
Requests reach it in arrival order; one whose mode differs from the running requests' waits, and
those behind it wait too, until the running ones finish; then the mode switches. No request is
refused because another client chose the other mode, and neither mode can starve the other.

Cancellation aborts the request in the engine between iterations, freeing what it held.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from vericache.engine.long_context import LongContextEngine
from vericache.engine.request import Request, RequestOutput, TokenLogprob
from vericache.errors import WorkerUnavailableError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokensCommitted:
    token_ids: list[int]  # output tokens committed since the request's previous event
    logprobs: list[TokenLogprob]  # [len(token_ids)] where the request asks, else []


@dataclass(frozen=True)
class RequestFinished:
    output: RequestOutput  # the whole output, its earlier tokens included


@dataclass(frozen=True)
class RequestFailed:
    error: Exception  # the engine refused the request, or an iteration failed


EngineEvent = TokensCommitted | RequestFinished | RequestFailed
EngineFactory = Callable[[], LongContextEngine]


@dataclass(eq=False)  # compared by identity: two equal requests are two submissions
class Submission:
    request: Request
    on_event: Callable[[EngineEvent], None]
    key: str | None = None  # the engine's key, once the engine has it
    num_reported: int = 0  # output tokens reported so far
    is_cancelled: bool = False


class EngineLoop:
    def __init__(self, make_engine: EngineFactory):
        self._make_engine = make_engine
        self.engine = make_engine()
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._waiting: deque[Submission] = deque()  # not handed to the engine yet
        self._live: dict[str, Submission] = {}  # engine key -> submission
        self._is_stopping = False
        self._broken: Exception | None = None  # a failed iteration left no engine to go on with
        # Called on the engine's thread after every iteration, with the engine (e.g. to meter it).
        self.on_iteration: Callable[[LongContextEngine], None] | None = None
        self._thread = threading.Thread(target=self._run, name="vericache-engine", daemon=True)
        self._thread.start()

    def submit(self, request: Request, on_event: Callable[[EngineEvent], None]) -> Submission:
        """Queues a request; its events go to `on_event`, the last a finish or a failure."""
        if not self.is_running:
            # Why it broke is in the server's log, not in an answer to a client.
            raise WorkerUnavailableError("the long-context engine is not running")
        submission = Submission(request, on_event)
        self._inbox.put(lambda: self._waiting.append(submission))
        return submission

    def cancel(self, submission: Submission) -> None:
        """Stops reporting to a submission and frees what it holds; a no-op once it finished."""
        self._inbox.put(lambda: self._cancel(submission))

    @property
    def is_running(self) -> bool:
        """Whether the engine takes requests: not stopping, and not broken by a failed
        restart."""
        return self._broken is None and not self._is_stopping and self._thread.is_alive()

    @property
    def num_requests(self) -> int:
        """Requests queued or in the engine, cancelled ones still running included."""
        return len(self._waiting) + len(self._live)

    def close(self, timeout_s: float = 60.0) -> None:
        self._inbox.put(self._stop)
        self._thread.join(timeout_s)
        self.engine.close()

    # -- the engine's thread -------------------------------------------------------------------

    def _run(self) -> None:
        while not self._is_stopping:
            # Requests of the other mode wait while the engine drains: not a reason to sleep.
            self._take_commands(block=not (self.engine.has_unfinished or self._waiting))
            if self._is_stopping:
                break
            self._hand_over()
            if self.engine.has_unfinished:
                self._iterate()

    def _take_commands(self, block: bool) -> None:
        if block:
            self._inbox.get()()
        while not self._is_stopping:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            command()

    def _hand_over(self) -> None:
        """Hands waiting requests to the engine in arrival order while their mode is the
        running requests' mode (or nothing runs)."""
        while self._waiting:
            submission = self._waiting[0]
            modes = {live.request.mode for live in self._live.values()}
            if modes and submission.request.mode not in modes:
                return  # the running mode drains first
            self._waiting.popleft()
            try:
                submission.key = self.engine.add_request(submission.request)
            except Exception as exc:  # noqa: BLE001 - a refused request fails alone
                submission.on_event(RequestFailed(exc))
                continue
            self._live[submission.key] = submission

    def _iterate(self) -> None:
        try:
            finished = self.engine.run_iteration()
        except Exception as exc:  # noqa: BLE001 - the loop must outlive a failed iteration
            log.exception("a long-context iteration failed; its requests fail with it")
            self._restart(exc)
            return
        if self.on_iteration is not None:
            self.on_iteration(self.engine)
        for key, submission in list(self._live.items()):
            output = finished.get(key)
            if output is not None:
                del self._live[key]
            if submission.is_cancelled:
                continue
            if output is not None:
                submission.on_event(RequestFinished(output))
            else:
                self._report_progress(submission)

    def _report_progress(self, submission: Submission) -> None:
        committed = self.engine.output_ids(submission.key)
        if len(committed) > submission.num_reported:
            new = committed[submission.num_reported :]
            logprobs = self.engine.output_logprobs(submission.key)[submission.num_reported :]
            submission.num_reported = len(committed)
            submission.on_event(TokensCommitted(new, logprobs))

    def _cancel(self, submission: Submission) -> None:
        submission.is_cancelled = True
        if submission in self._waiting:
            self._waiting.remove(submission)
        # Identity, not key: a restarted engine numbers its keys afresh.
        elif self._live.get(submission.key) is submission:
            self.engine.abort(submission.key)
            del self._live[submission.key]

    def _restart(self, error: Exception) -> None:
        """Fails the engine's requests and goes on with a fresh engine: a failed iteration may
        leave the old one's state half updated."""
        for submission in self._live.values():
            if not submission.is_cancelled:
                submission.on_event(RequestFailed(error))
        self._live.clear()
        self.engine.close()
        try:
            self.engine = self._make_engine()
        except Exception as exc:  # noqa: BLE001 - reported to every request from now on
            log.exception("the long-context engine could not restart")
            self._broken = exc
            self._stop()

    def _stop(self) -> None:
        self._is_stopping = True
        if self._broken is not None:
            stopped = WorkerUnavailableError("the long-context engine is not running")
        else:
            stopped = WorkerUnavailableError("the server is stopping")
        for submission in [*self._waiting, *self._live.values()]:
            if not submission.is_cancelled:
                submission.on_event(RequestFailed(stopped))
        self._waiting.clear()
        self._live.clear()
