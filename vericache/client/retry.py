"""When a failed call is tried again, shared by the sync and asyncio clients.

Only UNAVAILABLE is retried (the server was down or had no worker: the request did no work), and
only where a second attempt cannot duplicate output: unary calls that are idempotent, and streams
that have not delivered a message yet. Waits double from `backoff_s`, with jitter so that clients
failed by one outage do not come back in step, and never run past the call's deadline.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import grpc

from vericache.errors import InvalidRequestError


class Deadline:
    """The end of one client call, across its attempts; None: no deadline."""

    def __init__(self, timeout: float | None):
        self._end = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> float | None:
        return None if self._end is None else max(self._end - time.monotonic(), 0.0)


@dataclass(frozen=True)
class RetryPolicy:
    retries: int = 3  # attempts after the first
    backoff_s: float = 0.2  # wait before the first retry; doubles each retry

    def __post_init__(self):
        if not isinstance(self.retries, int) or self.retries < 0:
            raise InvalidRequestError(f"retries must be an integer >= 0, got {self.retries!r}")
        if self.backoff_s < 0:
            raise InvalidRequestError(f"backoff_s must be >= 0, got {self.backoff_s!r}")

    def delay_before_retry(
        self, exc: grpc.RpcError, num_failed: int, deadline: Deadline
    ) -> float | None:
        """Seconds to wait before trying again after `num_failed` failures; None: give up."""
        if exc.code() is not grpc.StatusCode.UNAVAILABLE or num_failed > self.retries:
            return None
        delay = self.backoff_s * 2 ** (num_failed - 1) * random.uniform(0.5, 1.0)
        remaining = deadline.remaining()
        if remaining is not None and delay >= remaining:
            return None
        return delay


def check_timeout(timeout: float | None) -> float | None:
    if timeout is not None and not timeout > 0:
        raise InvalidRequestError(f"timeout must be > 0 seconds or None, got {timeout!r}")
    return timeout
