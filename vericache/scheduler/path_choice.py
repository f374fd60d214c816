"""How a request is served, chosen per request (`mode: auto`): pure Python, no torch, shared by the
simulator (vericache/sim/remote_prefix_auto.py) and a served coordinator.

The paths, over one prefix:
- VERICACHE: a drafter drafts over the prefix's compressed KV; the central verifier verifies over
  its full KV, or the drafter's node itself once it holds the full KV in host memory (warm);
- FULL_LOCAL: a verifier beside the store decodes over the full KV;
- FULL_REMOTE: a drafter decodes over the full KV, fetched over its link or recomputed;
- FULL_WARM: a drafter whose node holds the full KV in host memory decodes over it.

The caller estimates each path from its cost model and the workers' load now (`PathEstimate`):
the seconds its worker's memory keeps it waiting, the seconds until its first token after that
(its KV moved or recomputed, the queues ahead, its prompt's prefill) and the seconds per output
token after it (at the worker's batch with it added), and the requests already running that the
path slows (`Slowed`): its worker's batch-mates, whose steps grow by its rows, and the requests
of the workers beside it on one memory system, which run slower once it computes too.
`choose_path` takes the path of least cost: the request's own finish plus the delay it adds to
theirs. A choice by its own finish alone sends a request to an idle worker whenever that finishes
it sooner, though the busy workers beside it then slow by more than it gained (two CPU workers
share one DRAM bus). Where each path runs is placement.py's (warm nodes first), not this
module's.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class ServingPath(enum.Enum):
    VERICACHE = "vericache"
    FULL_LOCAL = "full_local"
    FULL_REMOTE = "full_remote"
    FULL_WARM = "full_warm"


@dataclass(frozen=True)
class Slowed:
    """Requests already running whose steps take `factor` times as long while the request runs."""

    num_requests: float
    factor: float

    def __post_init__(self):
        if not (self.num_requests >= 0 and self.factor > 0):
            raise ValueError(f"slowed requests need a count >= 0 and a factor > 0: {self}")

    def delay_s(self, overlap_s: float) -> float:
        """How much later they finish, all together, when slowed for `overlap_s`: each makes
        1 / factor of its progress meanwhile and makes up the rest after."""
        return self.num_requests * overlap_s * max(0.0, 1 - 1 / self.factor)


@dataclass(frozen=True)
class PathEstimate:
    path: ServingPath
    worker: str  # the worker that decodes (a drafter, for VERICACHE)
    setup_s: float  # until its first token once admitted: KV moved or recomputed, the prefill
    seconds_per_token: float  # after it, at the worker's load with this request added
    memory_wait_s: float = 0.0  # until the worker's memory has room for it
    slowed: tuple[Slowed, ...] = ()  # the requests running now that it slows

    def __post_init__(self):
        times = (self.setup_s, self.memory_wait_s)
        if not (min(times) >= 0 and self.seconds_per_token > 0):
            raise ValueError(f"an estimate needs times >= 0 and seconds per token > 0: {self}")

    def finish_s(self, num_tokens: int) -> float:
        return self.memory_wait_s + self.setup_s + num_tokens * self.seconds_per_token

    def delay_to_others_s(self, num_tokens: int) -> float:
        """The delay it adds to the finishes of the requests running now. Those are taken to be,
        on average, halfway through outputs like its own: they run beside its decoding for half
        of it."""
        overlap_s = num_tokens * self.seconds_per_token / 2
        return sum(slowed.delay_s(overlap_s) for slowed in self.slowed)

    def cost_s(self, num_tokens: int) -> float:
        """Seconds of finishes it costs everyone: its own and the delay it adds to others'."""
        return self.finish_s(num_tokens) + self.delay_to_others_s(num_tokens)


def choose_path(estimates: Sequence[PathEstimate], num_tokens: int) -> PathEstimate:
    """The estimate of least cost for `num_tokens` (ties: the first given)."""
    if not estimates:
        raise ValueError("no path to choose from")
    return min(estimates, key=lambda estimate: estimate.cost_s(num_tokens))


def round_seconds_per_token(
    draft_len: int, draft_step_s: float, verify_s: float, overhead_s: float, mean_accepted: float
) -> float:
    """A VeriCache round's seconds per committed token: `draft_len` draft steps, one
    verification and what the round adds besides (calls' latency, loads), over the accepted
    drafts and the verifier's token."""
    if draft_len < 1 or mean_accepted < 0:
        raise ValueError("a round drafts at least one token and accepts >= 0")
    return (draft_len * draft_step_s + verify_s + overhead_s) / (mean_accepted + 1)
