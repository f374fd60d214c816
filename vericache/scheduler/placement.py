"""Where a request runs: on the worker that holds its prefix (pure Python, shared by the served
coordinator and the simulator).

Each prefix ranks the workers by rendezvous (highest random weight) hashing: a digest of the
prefix's key and a worker's name per worker, highest first. The ranking depends on the prefix and
the workers' names alone, so every request of a prefix goes to the same worker (which then holds
its KV once: the drafter's fetch over the slow link, the verifier's load from the store), the
simulator places as the server does, and a worker that dies moves only its own prefixes, each to
the next worker of its ranking.

A hot prefix must not queue behind one worker: the first worker of the ranking takes the request
unless that would put it past the load bound, LOAD_BOUND times the mean load after placing,
rounded up (consistent hashing with bounded loads, Mirrokni et al. 2018); then the least loaded
worker takes it, ties going to the higher ranked. A request without a prefix goes to the least
loaded worker, ties to the first.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

# A worker may carry a quarter more than the mean before its prefixes' requests spill: the bound of
# the bounded-load papers, which keeps the most loaded worker within 1.25x of the mean while a
# prefix's requests stay together as long as the load allows.
LOAD_BOUND = 1.25


@dataclass(frozen=True)
class Candidate:
    """A worker that may take the request."""

    name: str  # stable across restarts: the ranking is by name
    load: int  # sessions placed on it now


def ranking(prefix_key: str, names: Sequence[str]) -> list[int]:
    """The indices of `names`, highest rendezvous weight for `prefix_key` first."""
    weights = [_weight(prefix_key, name) for name in names]
    return sorted(range(len(names)), key=lambda i: (-weights[i], names[i]))


def place(prefix_key: str | None, candidates: Sequence[Candidate]) -> int:
    """The index of the candidate that takes a request over `prefix_key` (None: no prefix)."""
    if not candidates:
        raise ValueError("no candidate to place a request on")
    if prefix_key is None:
        return min(range(len(candidates)), key=lambda i: candidates[i].load)
    order = ranking(prefix_key, [c.name for c in candidates])
    holder = candidates[order[0]]
    if holder.load + 1 <= load_bound(candidates):
        return order[0]
    return min(order, key=lambda i: candidates[i].load)  # stable: the higher ranked on ties


def load_bound(candidates: Sequence[Candidate]) -> int:
    """The most sessions a worker may hold once the request is placed."""
    total = sum(c.load for c in candidates) + 1
    return max(1, math.ceil(LOAD_BOUND * total / len(candidates)))


def _weight(prefix_key: str, name: str) -> int:
    digest = hashlib.blake2b(f"{prefix_key}\0{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
