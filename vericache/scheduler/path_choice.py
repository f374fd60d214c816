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
token after it (at the worker's batch with it added). `choose_path` takes the path that finishes
the request first. The choice is greedy: it weighs what the request adds to its worker's batch
for itself, not for the requests already there. Where each path runs is
placement.py's (warm nodes first), not this module's.
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
class PathEstimate:
    path: ServingPath
    worker: str  # the worker that decodes (a drafter, for VERICACHE)
    setup_s: float  # until its first token once admitted: KV moved or recomputed, the prefill
    seconds_per_token: float  # after it, at the worker's load with this request added
    memory_wait_s: float = 0.0  # until the worker's memory has room for it

    def __post_init__(self):
        times = (self.setup_s, self.memory_wait_s)
        if not (min(times) >= 0 and self.seconds_per_token > 0):
            raise ValueError(f"an estimate needs times >= 0 and seconds per token > 0: {self}")

    def finish_s(self, num_tokens: int) -> float:
        return self.memory_wait_s + self.setup_s + num_tokens * self.seconds_per_token


def choose_path(estimates: Sequence[PathEstimate], num_tokens: int) -> PathEstimate:
    """The estimate that finishes `num_tokens` first (ties: the first given)."""
    if not estimates:
        raise ValueError("no path to choose from")
    return min(estimates, key=lambda estimate: estimate.finish_s(num_tokens))


def round_seconds_per_token(
    draft_len: int, draft_step_s: float, verify_s: float, overhead_s: float, mean_accepted: float
) -> float:
    """A VeriCache round's seconds per committed token: `draft_len` draft steps, one
    verification and what the round adds besides (calls' latency, loads), over the accepted
    drafts and the verifier's token."""
    if draft_len < 1 or mean_accepted < 0:
        raise ValueError("a round drafts at least one token and accepts >= 0")
    return (draft_len * draft_step_s + verify_s + overhead_s) / (mean_accepted + 1)
