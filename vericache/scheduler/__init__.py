"""Iteration-level scheduling of draft steps, verifications and full-KV loads (pure Python).

The scheduler decides, iteration by iteration, which requests draft, which verify, and when each
full-KV load starts, so that loads complete before their verification and neither the link nor
device memory is ever over-booked. The caller owns execution (the engine, the distributed
coordinator or the simulator); see `base` for the protocol and the timeline of a round,
`staggered` for ADMIT, `lockstep` for the baseline, `costs` for calibration.

Words, as in vericache.engine.request: a round is one draft phase and one verification; its draft
length d is the number of draft tokens; S is the number of iterations a full-KV load spans; W is
the lookahead window of the reservation rings, in iterations.
"""

from vericache.scheduler.base import BaseScheduler, DraftLenPolicy, RequestState, Reservation
from vericache.scheduler.costs import CostModel
from vericache.scheduler.lockstep import LockstepScheduler
from vericache.scheduler.records import (
    IterationMetrics,
    IterationPlan,
    LoadStart,
    RequestMetrics,
    SchedulerConfig,
    SchedulerRequest,
    SchedulerStateError,
    Verify,
)
from vericache.scheduler.staggered import StaggeredScheduler, draft_len_order

__all__ = [
    "BaseScheduler",
    "CostModel",
    "DraftLenPolicy",
    "IterationMetrics",
    "IterationPlan",
    "LoadStart",
    "LockstepScheduler",
    "RequestMetrics",
    "RequestState",
    "Reservation",
    "SchedulerConfig",
    "SchedulerRequest",
    "SchedulerStateError",
    "StaggeredScheduler",
    "Verify",
    "draft_len_order",
]
