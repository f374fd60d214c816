"""How much busy co-runners slow a worker's forwards on this server, as its requests measured it
(`mode: auto`, auto_path.py).

The device profile's `co_runner_slowdown` is measured by two bare forward loops side by side
(vericache/calibration/co_runner.py). A served worker waits for more than its memory bus once
another computes beside it: on a 2-core machine whose two workers compute, the serving work
(calls, job handling, the coordinator) finds no spare core and stretches every step. In the
remote-prefix benchmark on a 2-core Intel Xeon, decoding on both workers gave 31.2 tokens/s
against 35.9 on the verifier alone, though the profile's 1.23 priced the two as equal; `auto`
then split waves that one worker serves faster.

So the server fits the slowdown to its own requests. Each measured request gives
y = log(measured / predicted alone) at c, the mean count of busy co-runners over its life, and
y = a_path + log(1 + (s - 1) c): a correction of its path (the device's error, common to its
requests whatever ran beside them) and one slowdown s for all. Requests of one path that ran
beside different numbers of co-runners tell s apart from a_path; without that spread s stays at
the profile's. A penalty on log(s / profile's) keeps a few noisy requests from swinging it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from vericache.scheduler.path_choice import ServingPath

# Requests of each path the fit keeps: the last sixteen. Fewer lose the spread of co-runners
# once `auto` stops starting a second worker; more follow a changed load slowly.
WINDOW = 16
# The penalty's weight on log(s / the profile's)^2: light, since the profile's slowdown is of bare
# forward loops; a pair of requests, one alone and one beside a co-runner, weighs twice as much.
PRIOR_WEIGHT = 0.25
# The slowdowns the fit chooses among: from none to four times as slow.
MIN_SLOWDOWN, MAX_SLOWDOWN = 1.0, 4.0
_SEARCH_STEPS = 48  # golden-section steps over log(s): far finer than the measurements


@dataclass(frozen=True)
class _Sample:
    co_runners: float  # busy co-runners beside its worker, on average over its life
    log_ratio: float  # log(measured / predicted with none beside it)


class CoRunnerFit:
    """One co-runner slowdown and a correction per path, fitted to the measured requests."""

    def __init__(self, prior_slowdown: float):
        self.prior_slowdown = min(MAX_SLOWDOWN, max(MIN_SLOWDOWN, prior_slowdown))
        self.slowdown = self.prior_slowdown
        self._samples = {path: deque(maxlen=WINDOW) for path in ServingPath}

    def count(self, path: ServingPath) -> int:
        """The path's requests the fit holds."""
        return len(self._samples[path])

    def observe(self, path: ServingPath, co_runners: float, log_ratio: float) -> None:
        """A request of `path` measured at exp(log_ratio) times the model's prediction with no
        co-runner, `co_runners` busy beside its worker on average."""
        self._samples[path].append(_Sample(max(0.0, co_runners), log_ratio))
        self.slowdown = self._fitted_slowdown()

    def log_correction(self, path: ServingPath) -> float | None:
        """The path's log correction at the fitted slowdown (None: none of it measured)."""
        samples = self._samples[path]
        if not samples:
            return None
        return _intercept(samples, math.log(self.slowdown))

    def _fitted_slowdown(self) -> float:
        """The s of least squared error over the paths' samples plus the prior's penalty."""
        low, high = math.log(MIN_SLOWDOWN), math.log(MAX_SLOWDOWN)
        ratio = (math.sqrt(5) - 1) / 2
        for _ in range(_SEARCH_STEPS):  # the loss is smooth and, near its least, convex
            left, right = high - ratio * (high - low), low + ratio * (high - low)
            if self._loss(left) <= self._loss(right):
                high = right
            else:
                low = left
        return math.exp((low + high) / 2)

    def _loss(self, log_slowdown: float) -> float:
        penalty = PRIOR_WEIGHT * (log_slowdown - math.log(self.prior_slowdown)) ** 2
        errors = 0.0
        for samples in self._samples.values():
            if samples:
                intercept = _intercept(samples, log_slowdown)
                errors += sum(
                    (s.log_ratio - intercept - _log_beside(log_slowdown, s.co_runners)) ** 2
                    for s in samples
                )
        return errors + penalty


def _log_beside(log_slowdown: float, co_runners: float) -> float:
    """log of the profile's slowdown beside `co_runners` (DeviceProfile.slowdown_beside)."""
    return math.log(1 + (math.exp(log_slowdown) - 1) * co_runners)


def _intercept(samples, log_slowdown: float) -> float:
    """The path's least-squares correction given the slowdown: its samples' mean residual."""
    residuals = [s.log_ratio - _log_beside(log_slowdown, s.co_runners) for s in samples]
    return sum(residuals) / len(residuals)
