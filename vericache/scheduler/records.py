"""Typed records at the scheduler's boundary: its config, what it knows of a request, the plan it
hands the caller each iteration, and the metrics it keeps."""

from __future__ import annotations

from dataclasses import dataclass, field

from vericache.errors import InvalidRequestError, VeriCacheError


class SchedulerStateError(VeriCacheError):
    """The caller broke the iteration protocol: schedule, report every verification, end."""


@dataclass(frozen=True)
class SchedulerConfig:
    # W: iterations the reservation rings look ahead. A request admitted after iteration t drafts
    # d in [S, W - 1] tokens (iterations t+1..t+d) and verifies in iteration t+d+1.
    window: int = 64
    # Iterations a full-KV load may span beyond S, to use link time left over in partly booked
    # iterations. Every extra iteration holds the full KV on the device one iteration longer; 0
    # keeps each load in the S iterations right before its verification.
    load_slack: int = 1
    # A request waiting this many iterations stops later requests from overtaking it (aging),
    # which bounds every wait (see StaggeredScheduler).
    starvation_limit: int = 64
    # Bounded history of per-iteration and finished-request metrics (totals are kept apart).
    metrics_history: int = 100_000

    def __post_init__(self):
        if self.window < 2:
            raise InvalidRequestError(f"window must be >= 2 iterations, got {self.window}")
        if self.load_slack < 0:
            raise InvalidRequestError(f"load_slack must be >= 0, got {self.load_slack}")
        if self.starvation_limit < 0:
            raise InvalidRequestError(f"starvation_limit must be >= 0, got {self.starvation_limit}")
        if self.metrics_history < 1:
            raise InvalidRequestError(f"metrics_history must be >= 1, got {self.metrics_history}")


@dataclass(frozen=True)
class SchedulerRequest:
    """What the scheduler needs to know of a request: its id and its KV sizes.

    Sizes are upper bounds for the request's whole life (prompt plus max_new_tokens): the
    scheduler reserves them and never grows them."""

    request_id: str
    full_kv_bytes: int  # loaded onto the device for each verification, released after it
    compressed_kv_bytes: int  # resident on the device from admission until the request finishes
    draft_len: int = 30  # preferred draft length x; RequestState.draft_len may change it later

    def __post_init__(self):
        if not self.request_id:
            raise InvalidRequestError("request_id must not be empty")
        if self.full_kv_bytes <= 0:
            raise InvalidRequestError(
                f"request {self.request_id!r}: full_kv_bytes must be > 0, got {self.full_kv_bytes}"
            )
        if self.compressed_kv_bytes < 0:
            raise InvalidRequestError(
                f"request {self.request_id!r}: compressed_kv_bytes must be >= 0, "
                f"got {self.compressed_kv_bytes}"
            )
        if self.draft_len < 1:
            raise InvalidRequestError(
                f"request {self.request_id!r}: draft_len must be >= 1, got {self.draft_len}"
            )


@dataclass(frozen=True)
class LoadStart:
    request_id: str
    num_bytes: int  # full KV to move onto the device
    verify_iteration: int  # the load must be complete when the verification starts, here


@dataclass(frozen=True)
class Verify:
    request_id: str
    num_drafts: int  # drafted since the request's last verification (its draft length)


@dataclass(frozen=True)
class IterationPlan:
    """What the caller runs in one iteration, in this order."""

    iteration: int
    loads: tuple[LoadStart, ...]  # start these full-KV loads now (they run asynchronously)
    draft_ids: tuple[str, ...]  # one batched draft step over these requests' compressed KV
    verifies: tuple[Verify, ...]  # verifications that end now: report each with on_verified
    # Verifications that start now, as one batch (their loads are complete). Each ends, and is
    # reported, in the iteration its reservation says: this one when they take one iteration.
    verify_starts: tuple[Verify, ...] = ()

    @property
    def is_idle(self) -> bool:
        return not (self.loads or self.draft_ids or self.verifies or self.verify_starts)


@dataclass(frozen=True)
class IterationMetrics:
    iteration: int
    num_drafting: int  # draft batch size
    num_verifying: int  # verify batch size (verifications starting in this iteration)
    num_loads_started: int
    num_running: int  # admitted requests with a reservation (drafting, loading or verifying)
    num_waiting: int  # requests queued for admission after this iteration's admission pass
    link_utilisation: float  # link seconds booked in this iteration / iteration time
    memory_bytes: int  # weights + resident compressed KV + full KV reserved in this iteration


@dataclass
class RequestMetrics:
    request_id: str
    num_rounds: int = 0  # verifications
    num_drafts: int = 0
    num_accepted: int = 0  # accepted draft tokens; each round also emits one correction or bonus
    num_waited_iterations: int = 0  # iterations spent queued for admission, in all
    max_wait_iterations: int = 0  # the longest single wait
    draft_lens: list[int] = field(default_factory=list)  # draft length of each round
    accepted_per_round: list[int] = field(default_factory=list)

    @property
    def num_output_tokens(self) -> int:
        return self.num_accepted + self.num_rounds
