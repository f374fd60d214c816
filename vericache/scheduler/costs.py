"""Measured costs the scheduler plans with: iteration time, link bandwidth and device memory.

Start-up calibration (`CostModel.calibrate`) takes a few timed iterations and timed full-KV loads;
`observe_iteration` and `observe_load` then refine the estimates online with an exponential moving
average, so S (the iterations a full-KV load spans) follows the hardware as it is, not as a
constant said it would be. Memory is the device budget the scheduler may fill and the bytes the
weights (and activations) already take; the caller measures both at start-up.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from vericache.errors import InvalidRequestError


@dataclass
class CostModel:
    iteration_s: float  # one iteration: a batched draft step and/or a batched verification
    link_bytes_per_s: float  # full-KV load bandwidth (host memory or remote store to device)
    memory_budget_bytes: int  # device memory the scheduler plans within
    weights_bytes: int = 0  # M: weights and other fixed residents, counted against the budget
    alpha: float = 0.2  # weight of each new observation in the moving averages
    # One verification's seconds, once measured (`observe_verification`); None: it fits in an
    # iteration, as when the draft step and the verification share a device and a batch.
    verify_s: float | None = None

    def __post_init__(self):
        _check_positive("iteration_s", self.iteration_s)
        _check_positive("link_bytes_per_s", self.link_bytes_per_s)
        _check_positive("memory_budget_bytes", self.memory_budget_bytes)
        if not 0 <= self.weights_bytes < self.memory_budget_bytes:
            raise InvalidRequestError(
                f"weights_bytes must lie in [0, memory_budget_bytes), got {self.weights_bytes} "
                f"of {self.memory_budget_bytes}"
            )
        if not 0 < self.alpha <= 1:
            raise InvalidRequestError(f"alpha must lie in (0, 1], got {self.alpha}")
        if self.verify_s is not None:
            _check_positive("verify_s", self.verify_s)

    @classmethod
    def calibrate(
        cls,
        iteration_samples: Sequence[float],
        load_samples: Sequence[tuple[int, float]],
        memory_budget_bytes: int,
        weights_bytes: int = 0,
        alpha: float = 0.2,
    ) -> CostModel:
        """Costs from start-up measurements: seconds of a few iterations, and (bytes, seconds) of
        a few full-KV loads. The median iteration resists a slow first (warm-up) sample."""
        if not iteration_samples or not load_samples:
            raise InvalidRequestError("calibration needs at least one iteration and one load")
        for seconds in iteration_samples:
            _check_positive("an iteration sample", seconds)
        for num_bytes, seconds in load_samples:
            _check_positive("a load sample's bytes", num_bytes)
            _check_positive("a load sample's seconds", seconds)
        total_bytes = sum(num_bytes for num_bytes, _ in load_samples)
        total_s = sum(seconds for _, seconds in load_samples)
        return cls(
            iteration_s=statistics.median(iteration_samples),
            link_bytes_per_s=total_bytes / total_s,
            memory_budget_bytes=memory_budget_bytes,
            weights_bytes=weights_bytes,
            alpha=alpha,
        )

    def observe_iteration(self, seconds: float) -> None:
        _check_positive("an iteration's seconds", seconds)
        self.iteration_s += self.alpha * (seconds - self.iteration_s)

    def observe_verification(self, seconds: float) -> None:
        """A verification timed apart from the draft steps (on another device)."""
        _check_positive("a verification's seconds", seconds)
        if self.verify_s is None:
            self.verify_s = seconds
        else:
            self.verify_s += self.alpha * (seconds - self.verify_s)

    def num_verify_iterations(self) -> int:
        """V = max(1, ceil(verification time / iteration time)): the iterations a verification
        spans, while other requests draft."""
        if self.verify_s is None:
            return 1
        return max(1, math.ceil(self.verify_s / self.iteration_s - 1e-9))

    def observe_load(self, num_bytes: int, seconds: float) -> None:
        """A finished full-KV load, timed from its start to its end alone on the link."""
        _check_positive("a load's bytes", num_bytes)
        _check_positive("a load's seconds", seconds)
        self.link_bytes_per_s += self.alpha * (num_bytes / seconds - self.link_bytes_per_s)

    def load_s(self, num_bytes: int) -> float:
        return num_bytes / self.link_bytes_per_s

    def num_load_iterations(self, num_bytes: int) -> int:
        """S = max(1, ceil(bytes / (bandwidth * iteration time)))."""
        iterations = num_bytes / (self.link_bytes_per_s * self.iteration_s)
        # Rounding noise must not turn an exact fit (e.g. 2.0000000001) into one more iteration.
        return max(1, math.ceil(iterations - 1e-9))


def _check_positive(name: str, value: float) -> None:
    if not value > 0 or math.isinf(value):
        raise InvalidRequestError(f"{name} must be a finite number > 0, got {value}")
