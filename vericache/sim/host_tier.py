"""A node's host memory for prefixes' KV, and where a worker's device gets a prefix it lacks.

A well-run full-KV deployment keeps what its GPUs evict in host memory (SGLang's hierarchical
cache, LMCache's CPU backend, vLLM's CPU offloading) and brings it back over PCIe instead of the
slow network or the store, and recomputes a prefix where a prefill is sooner than a fetch. A
VeriCache drafter node streams a prefix's full KV into the same host memory, in the background,
to verify its own sessions (remote_prefix.py's warm nodes). Both are modelled here:
- `HostTier`: prefixes' KV within a budget of bytes, the least recently used evicted first.
- `TieredFetch`: a device's misses, served from the host tier over the node's host link where it
  holds the prefix, else by a prefill on the device where the cost model makes that sooner than
  the fetch (and the worker may recompute), else over the inbound link. What arrives over the
  link lands in host memory first (a NIC writes there), so the host tier keeps it too; what the
  device evicts goes there. Its one choice also says when a fetch sent now would land, which
  `mode: auto`'s estimates read (remote_prefix_auto.py).
Assumptions, stated: copying a prefix from the device to host memory costs no link time (it rides
PCIe's other direction, idle while loads come in); a prefill is charged its forwards' time, in
chunks batched with the device's other rows. A deployment's rule compares that time alone with
the fetch's (the link's queue ahead included). `mode: auto`'s coordinator counts it once more for
each job on the device (`holds_up`): they share the prefill's forwards, each a chunk's long, so
each of them waits about as long as the session whose prefix it is, where a fetch holds up none
of them.
"""

from __future__ import annotations

import enum
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable
from typing import Protocol

from vericache.sim.events import Link


class HostTier:
    """Prefixes' KV in a node's host memory: at most `capacity_bytes`, least recently used out
    first."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.num_evictions = 0
        self._held: OrderedDict[Hashable, int] = OrderedDict()
        self._used_bytes = 0

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    def holds(self, prefix: Hashable) -> bool:
        return prefix in self._held

    def touch(self, prefix: Hashable) -> None:
        self._held.move_to_end(prefix)

    def put(self, prefix: Hashable, nbytes: int) -> bool:
        """Keeps the prefix (the most recently used), evicting others for room; whether it fits
        at all."""
        if prefix in self._held:
            self.touch(prefix)
            return True
        if nbytes > self.capacity_bytes:
            return False
        while self._used_bytes + nbytes > self.capacity_bytes:
            _, evicted = self._held.popitem(last=False)
            self._used_bytes -= evicted
            self.num_evictions += 1
        self._held[prefix] = nbytes
        self._used_bytes += nbytes
        return True


class Recompute(Protocol):
    """A worker's prefill of a prefix on its device, where it may recompute that prefix."""

    def seconds(self, prefix: Hashable) -> float | None:
        """The prefill's forwards alone, by the cost model; None: it may not recompute it."""
        ...

    def run(self, prefix: Hashable, done: Callable[[], None]) -> None: ...


class Source(enum.Enum):
    """Where a device's miss comes from (the report's names)."""

    HOST_TIER = "host_tier"
    RECOMPUTED = "recomputed"
    LINK = "link"


class TieredFetch:
    """A worker's device misses: from its host tier, by a prefill, or over its inbound link."""

    def __init__(
        self,
        inbound: Link,
        host_link: Link,
        host_tier: HostTier | None,
        recompute: Recompute | None,
        send: Callable[[int, Callable[[], None]], None] | None = None,
        holds_up: Callable[[], int] | None = None,
    ):
        self.inbound = inbound
        self.host_link = host_link
        self.host_tier = host_tier
        self.recompute = recompute
        # How an inbound fetch is sent (the inbound link's own send, unless arrivals are taken in
        # by the host as well).
        self._send = send or inbound.send
        # Where the choice weighs the others' wait too: the jobs a prefill would hold up now.
        self._holds_up = holds_up
        self.counts: Counter[Source] = Counter()  # the misses brought from each source

    def fetch(self, prefix: Hashable, nbytes: int, delivered: Callable[[], None]) -> None:
        """A miss, brought the soonest way (`choose`) and counted by where it came from."""
        source, _ = self.choose(prefix, nbytes)
        self.counts[source] += 1
        self._bring(source, prefix, nbytes, delivered)

    def read(self, prefix: Hashable, nbytes: int, delivered: Callable[[], None]) -> None:
        """One forward's read of a prefix the device lacks, as a warm node's verification reads
        its host tier's copy: from the tier it is not counted (a read per forward, which would
        swamp the misses), else it is fetched as a miss."""
        source, _ = self.choose(prefix, nbytes)
        if source is not Source.HOST_TIER:
            self.counts[source] += 1
        self._bring(source, prefix, nbytes, delivered)

    def ready_s(self, prefix: Hashable, nbytes: int) -> float:
        """Until a prefix fetched now is on the device, by the way `fetch` would bring it."""
        _, seconds = self.choose(prefix, nbytes)
        return seconds

    def choose(self, prefix: Hashable, nbytes: int) -> tuple[Source, float]:
        """Where a prefix fetched now comes from, and the seconds until it is on the device: the
        host tier where it holds it; else a prefill where the worker may recompute it and that is
        sooner than the fetch (counted once for each job it holds up, where the choice weighs
        those); else the inbound link. Each counts the transfers queued ahead."""
        tier = self.host_tier
        if tier is not None and tier.holds(prefix):
            return Source.HOST_TIER, _transfer_s(self.host_link, nbytes)
        fetch_s = _transfer_s(self.inbound, nbytes)
        prefill_s = self.recompute.seconds(prefix) if self.recompute is not None else None
        num_held_up = 1 + (self._holds_up() if self._holds_up is not None else 0)
        if prefill_s is not None and prefill_s * num_held_up < fetch_s:
            return Source.RECOMPUTED, prefill_s
        return Source.LINK, fetch_s

    def evicted(self, prefix: Hashable, nbytes: int) -> None:
        if self.host_tier is not None:
            self.host_tier.put(prefix, nbytes)

    def _bring(
        self, source: Source, prefix: Hashable, nbytes: int, delivered: Callable[[], None]
    ) -> None:
        if source is Source.HOST_TIER:
            self.host_tier.touch(prefix)
            self.host_link.send(nbytes, delivered)
        elif source is Source.RECOMPUTED:
            self.recompute.run(prefix, lambda: self._landed(prefix, nbytes, delivered))
        else:
            self._send(nbytes, lambda: self._landed(prefix, nbytes, delivered))

    def _landed(self, prefix: Hashable, nbytes: int, delivered: Callable[[], None]) -> None:
        if self.host_tier is not None:
            self.host_tier.put(prefix, nbytes)
        delivered()


def _transfer_s(link: Link, nbytes: int) -> float:
    """A foreground transfer sent now: the transfers ahead, its own bytes and the latency."""
    return link.foreground_wait_s() + link.seconds_for(nbytes)
