"""`mode: auto`: the coordinator chooses each request's path (scheduler/path_choice.py) from what
the paths cost on this server, as measured, and the workers' load now.

Every path gives the same tokens (full-KV decoding's), so the choice is about time alone. For each
path the server keeps moving averages over the requests it served that way: seconds to the first
token (the prefix's KV moved or read, the prompt's prefill), and seconds per output token after it
per request sharing the decoding worker, the time-sharing a saturated worker gives (the worker's
mean count of requests over the request's life, worker_load.py). A path's estimate for a new
request is then setup + tokens x seconds per token at the load of the worker placement would give
it now (its drafter for VERICACHE and FULL_REMOTE, on a node warm for the prefix where one is:
FULL_WARM; its verifier for FULL_LOCAL), and `choose_path`
takes the one that finishes first. A path the server has not measured yet is tried first, so
that every path is measured, by one request at a time: while it is being tried, requests take the
paths measured or not yet tried (those started together spread over the unmeasured paths, rather
than all piling onto the first). A path none of whose workers is alive is never offered.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

from vericache.scheduler.path_choice import PathEstimate, ServingPath, choose_path
from vericache.serve.api_types import GenerateSummary, ServeMode

# Weight of each new request in the moving averages: the last ten or so requests of a path count.
ALPHA = 0.2
# What an unmeasured path is estimated at: below every measured one, so it is tried next.
UNMEASURED_S = 0.0

_SERVED_AS = {
    ServingPath.VERICACHE: ServeMode.VERICACHE,
    ServingPath.FULL_LOCAL: ServeMode.FULL_LOCAL,
    ServingPath.FULL_REMOTE: ServeMode.FULL_REMOTE,
    ServingPath.FULL_WARM: ServeMode.FULL_REMOTE,  # on the warm node, which placement prefers
}


@dataclass
class _Measured:
    setup_s: float
    seconds_per_token_per_load: float  # a request's decode seconds per token / its worker's load

    def observe(self, setup_s: float, seconds_per_token_per_load: float) -> None:
        self.setup_s += ALPHA * (setup_s - self.setup_s)
        gap = seconds_per_token_per_load - self.seconds_per_token_per_load
        self.seconds_per_token_per_load += ALPHA * gap


@dataclass(frozen=True)
class PathOption:
    """A path the request may take now, on the worker placement would give it."""

    path: ServingPath
    worker: str
    load: int  # requests on that worker now


class AutoPaths:
    def __init__(self):
        self._measured: dict[ServingPath, _Measured] = {}
        self._trying: Counter[ServingPath] = Counter()  # unmeasured paths' requests in flight
        self._lock = threading.Lock()

    def choose(self, options: list[PathOption], num_tokens: int) -> ServingPath:
        """The option that finishes `num_tokens` first, by the measurements so far, counted as
        started (`ended` when it ends). Paths being tried are left out while another is
        measured or untried; where every option is being tried, the one fewest are trying."""
        with self._lock:
            open_options = [o for o in options if not self._is_trying(o.path)]
            if open_options:
                estimates = [self._estimate(option) for option in open_options]
                path = choose_path(estimates, num_tokens).path
            else:
                path = min(options, key=lambda option: self._trying[option.path]).path
            if path not in self._measured:
                self._trying[path] += 1
        return path

    def ended(self, path: ServingPath) -> None:
        """A request `choose` sent down `path` ended, served or not."""
        with self._lock:
            if self._trying[path] > 0:
                self._trying[path] -= 1

    def _is_trying(self, path: ServingPath) -> bool:
        return path not in self._measured and self._trying[path] > 0

    def observe(self, path: ServingPath, summary: GenerateSummary, load: float) -> None:
        """A request served on `path` ended, its decoding worker holding `load` requests (it
        among them) on average while it ran (worker_load.py). Requests cut short before their
        second token say nothing of the seconds per token."""
        if summary.num_tokens < 2 or summary.tokens_per_s <= 0:
            return
        per_load = 1.0 / summary.tokens_per_s / max(load, 1)
        with self._lock:
            measured = self._measured.get(path)
            if measured is None:
                self._measured[path] = _Measured(summary.ttft_s, per_load)
            else:
                measured.observe(summary.ttft_s, per_load)

    def _estimate(self, option: PathOption) -> PathEstimate:
        measured = self._measured.get(option.path)
        if measured is None:
            return PathEstimate(option.path, option.worker, UNMEASURED_S, 1e-9)
        per_token = measured.seconds_per_token_per_load * (option.load + 1)
        return PathEstimate(option.path, option.worker, measured.setup_s, max(per_token, 1e-9))


def served_as(path: ServingPath) -> ServeMode:
    """The mode a chosen path is served in."""
    return _SERVED_AS[path]
