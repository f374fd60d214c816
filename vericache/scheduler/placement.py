"""Where a request runs: on the worker that holds its prefix (pure Python, shared by the served
coordinator and the simulator).

Each prefix ranks the workers by rendezvous (highest random weight) hashing: a digest of the
prefix's key and a worker's name per worker, highest first. The ranking depends on the prefix and
the workers' names alone, so every request of a prefix goes to the same worker (which then holds
its KV once: the drafter's fetch over the slow link, the verifier's load from the store), the
simulator places as the server does, and a worker that dies moves only its own prefixes, each to
the next worker of its ranking.

A hot prefix must not queue behind one worker for ever, but each spill costs a worker a copy of
the prefix (a drafter's fetch over the slow link, a verifier's load from the store). So the first
worker of the ranking takes the request unless, once placed, it would be out of balance with the
least loaded worker by both margins of `Balance`; then the least loaded worker takes it, ties
going to the higher ranked. These are the rules and defaults of the cache-aware routers that
full-KV deployments run (SGLang's gateway, vLLM's router: imbalanced past 64 requests over the
idlest and 1.5x its load), so the baselines and VeriCache place alike. A request without a prefix
goes to the least loaded worker, ties to the first.

A worker that holds the prefix's full KV already (a warm drafter node's host tier, warm_node.py:
it verifies its own sessions) ranks before every one that does not, in rendezvous order among
them: a request sent elsewhere would make another node fetch the prefix and keep the central
verifier busy until that node is warm too.

Full-KV serving over two pools (the verifiers decoding alone, and the drafters decoding alone)
routes each request to the pool that would finish it first, counting the fetch of its prefix
where that pool does not hold it (`choose_pool`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Balance:
    """How far a prefix's holder may run ahead of the least loaded worker before its requests
    spill: it spills only past both margins, so a small cluster is not split by a few requests
    and a large one not by a few percent."""

    max_excess: int = 64  # sessions over the least loaded worker's
    max_ratio: float = 1.5  # times the least loaded worker's sessions

    def holds(self, holder_load: int, least_load: int) -> bool:
        """Whether a holder at `holder_load` sessions (the request placed) is still in balance."""
        return holder_load - least_load <= self.max_excess or holder_load <= (
            self.max_ratio * least_load
        )


DEFAULT_BALANCE = Balance()


@dataclass(frozen=True)
class Candidate:
    """A worker that may take the request."""

    name: str  # stable across restarts: the ranking is by name
    load: int  # sessions placed on it now
    is_warm: bool = False  # it holds the request's prefix's full KV (a warm drafter node)


def ranking(prefix_key: str, names: Sequence[str]) -> list[int]:
    """The indices of `names`, highest rendezvous weight for `prefix_key` first."""
    weights = [_weight(prefix_key, name) for name in names]
    return sorted(range(len(names)), key=lambda i: (-weights[i], names[i]))


def place(
    prefix_key: str | None, candidates: Sequence[Candidate], balance: Balance = DEFAULT_BALANCE
) -> int:
    """The index of the candidate that takes a request over `prefix_key` (None: no prefix)."""
    if not candidates:
        raise ValueError("no candidate to place a request on")
    if prefix_key is None:
        return min(range(len(candidates)), key=lambda i: candidates[i].load)
    by_weight = ranking(prefix_key, [c.name for c in candidates])
    order = sorted(by_weight, key=lambda i: not candidates[i].is_warm)  # stable: warm first
    least = min(order, key=lambda i: candidates[i].load)  # stable: the higher ranked on ties
    if balance.holds(candidates[order[0]].load + 1, candidates[least].load):
        return order[0]
    return least


@dataclass(frozen=True)
class PoolOption:
    """A pool of full-KV workers (verifiers, or drafters decoding alone), as a router weighs it
    for one request."""

    in_flight: int  # requests running on it now
    tokens_per_s: float  # its throughput with requests in flight (measured, or simulated)
    prefix_ready_s: float = 0.0  # until the request's prefix's full KV is there (0: held)


def choose_pool(options: Sequence[PoolOption], num_tokens: int) -> int:
    """The index of the pool that would finish a request of `num_tokens` output tokens first:
    once its prefix's full KV is there (held, or fetched or recomputed), behind the requests in
    flight, at the pool's throughput (join the shortest queue, as cache-aware routers weigh it:
    a pool without the prefix takes the request only where its queue saves more than the fetch
    costs). Ties go to the first."""
    if not options:
        raise ValueError("no pool to route a request to")

    def finish_s(option: PoolOption) -> float:
        queue_s = (option.in_flight + 1) * num_tokens / option.tokens_per_s
        return option.prefix_ready_s + queue_s

    return min(range(len(options)), key=lambda i: (finish_s(options[i]), i))


def _weight(prefix_key: str, name: str) -> int:
    digest = hashlib.blake2b(f"{prefix_key}\0{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
