"""A session's KV after its prefix, kept on the worker that served a turn for the session's next.

A session's next turn arrives with a prompt that extends the turn before's (its suffix, its
output, a new suffix), so a worker that kept the turn before's KV prefills only the new tokens.
Kept under `TurnKey` in the worker's KV memory (kv_memory.WorkerMemory), held where room is free
beside the sessions and prefixes (within the prefix budget, where set) and evicted least
recently used as an unused prefix is: `KeptTurns.TIERED` into the worker's host tier where the
node has one (or put there at once where the device has no room), and loaded back over PCIe (its
host link) into the turn that reuses it; `KeptTurns.DEVICE` dropped. Two deployments keep turns:
- a full-KV deployment with prefix caching (vLLM's automatic prefix caching, SGLang's radix
  cache, with a host tier as SGLang's hierarchical cache or LMCache's CPU backend;
  remote_prefix_full.py), on every worker;
- VeriCache as served (`served_keeps`): a worker's turn cache (serve/workers/turn_cache.py), on its
  device within `--turn-cache-bytes` and spilled to pinned host memory within
  `--turn-host-bytes`, which the scenario's host tier stands for (TIERED where the scenario gives
  workers one, else DEVICE): a verifier's, of every session it serves (FULL_LOCAL decoding, and
  its prefill of a VeriCache session's prompt); a drafter's, one cache for its full-KV sessions
  (FULL_REMOTE, and FULL_WARM over its host tier's copy of the prefix) and the VeriCache sessions
  its warm node verifies, each of which reuses what a kept turn there holds of its prompt when it
  opens its verification on the node (serve/workers/warm_node.py). A drafter keeps none of the
  VeriCache sessions a central verifier verifies, whose drafter still receives the exact KV of every
  token after the prefix.
Assumptions, stated: a served worker copies the kept run's KV into its new session; here the new
turn reads it in place (pinned, its bytes not the turn's own) and lets it go when it ends,
replaced by its own longer run, as the baseline's does: the same bytes (the old entry, which the
new one subsumes, goes), the device-to-device copy (milliseconds) uncharged. A served worker's
budgets are its `turn_cache_bytes` (1 GiB by default) and `turn_host_bytes`; here its kept turns
get what the baseline's get, the room free in its memory and its host tier (shared with the
prefixes there), in every scenario. A turn finds only its session's turn before: a served worker
also reuses the leading run of an older turn it kept (the session's turn before served
elsewhere). Both keep the last output token's KV too, which neither computed: one token a turn,
alike.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from vericache.sim.remote_prefix_workers import SessionTurns, Worker


class KeptTurns(enum.Enum):
    """What a worker keeps of a session's finished turn."""

    NONE = "none"  # nothing: the next turn prefills every token after the prefix
    DEVICE = "device"  # on its device while room allows, dropped when evicted
    TIERED = "tiered"  # on its device, evicted into its host tier


@dataclass(frozen=True)
class TurnKey:
    """What a worker keeps a session's finished turn's KV under: the session's tokens after the
    prefix, the turn's own included."""

    session: int  # the session's SessionTurns, by id
    num_tokens: int

    @classmethod
    def of(cls, turns: SessionTurns) -> TurnKey:
        """What the session's current turn finds: the KV of its tokens from the turns before."""
        return cls(id(turns), turns.history_tokens)


@dataclass(frozen=True)
class ReusedTurn:
    """What a turn reuses of the KV its session's turn before left on its worker."""

    num_tokens: int = 0  # tokens after the prefix it does not prefill
    nbytes: int = 0  # their KV
    # Read in place on the device until the turn ends; None (with tokens): loaded from the host
    # tier over PCIe once the turn is admitted.
    pinned: TurnKey | None = None

    @property
    def held_bytes(self) -> int:
        """Of its KV, what the device holds already (not the turn's own to reserve)."""
        return self.nbytes if self.pinned is not None else 0

    @property
    def load_bytes(self) -> int:
        return self.nbytes - self.held_bytes


def served_keeps(worker: Worker) -> KeptTurns:
    """What a served worker keeps of a finished turn it decoded or verified over the full KV (a
    drafter, of the VeriCache sessions its warm node verifies, not of those it drafts for a
    central verifier), where prefixes are cached: on its
    device, spilled into its host tier where the node has one (the served workers'
    `--turn-host-bytes`); none on a verifier keeping VeriCache's residency, whose sessions' own
    full KV residency.py holds apart."""
    if worker.residency is not None or not worker.run.scenario.prefix_caching:
        return KeptTurns.NONE
    return KeptTurns.TIERED if worker.host_tier is not None else KeptTurns.DEVICE


def holds(worker: Worker, turns: SessionTurns, keeps: KeptTurns) -> bool:
    """Whether the worker keeps the session's KV from its turn before: on its device, or (where
    it keeps turns tiered) in its host tier."""
    key = TurnKey.of(turns)
    if keeps is KeptTurns.NONE or key.num_tokens == 0:
        return False
    tier = worker.host_tier if keeps is KeptTurns.TIERED else None
    return worker.memory.holds(key) or (tier is not None and tier.holds(key))


def holder(workers: list[Worker], turns: SessionTurns, keeps: KeptTurns) -> Worker | None:
    """The worker that keeps the session's KV from its turn before; None where none does (its
    first turn, or evicted)."""
    return next((worker for worker in workers if holds(worker, turns, keeps)), None)


def reusable(worker: Worker, turns: SessionTurns, keeps: KeptTurns) -> ReusedTurn:
    """What a turn opened on the worker now would reuse of its session's turn before (`reuse`,
    without taking it): on the device, read in place; in the host tier, loaded over PCIe."""
    if not holds(worker, turns, keeps):
        return ReusedTurn()
    key = TurnKey.of(turns)
    nbytes = key.num_tokens * worker.run.scenario.kv_bytes_per_token
    return ReusedTurn(key.num_tokens, nbytes, key if worker.memory.holds(key) else None)


def reuse(worker: Worker, turns: SessionTurns, keeps: KeptTurns) -> ReusedTurn:
    """Takes the session's KV from its turn before on the worker: on the device, pinned and
    read in place; in the host tier, to load over PCIe (`load`); else none, prefilled again."""
    reused = reusable(worker, turns, keeps)
    if reused.pinned is not None:
        worker.memory.pin(reused.pinned)
    elif reused.num_tokens:
        worker.host_tier.touch(TurnKey.of(turns))
    return reused


def load(worker: Worker, reused: ReusedTurn, then: Callable[[], None]) -> None:
    """The turn admitted: what it reuses from the host tier, if any, over PCIe; then `then`."""
    if reused.load_bytes:
        worker.host_link.send(reused.load_bytes, then)
    else:
        then()


def reuse_load_s(worker: Worker, reused: ReusedTurn) -> float:
    """Until `load` sent now would land: the host link's transfers ahead and its own bytes."""
    if not reused.load_bytes:
        return 0.0
    link = worker.host_link
    return link.foreground_wait_s() + link.seconds_for(reused.load_bytes)


def let_go(worker: Worker, reused: ReusedTurn) -> None:
    """The turn ended: the KV it read in place goes (its own, kept next, holds those tokens)."""
    if reused.pinned is not None:
        worker.memory.unpin(reused.pinned, drop=True)


def keep(worker: Worker, turns: SessionTurns, num_tokens: int, keeps: KeptTurns) -> None:
    """Keeps the session's `num_tokens` after the prefix for its next turn, unless this turn
    was its last: on the device where room is free, else (tiered) in the host tier at once."""
    if keeps is KeptTurns.NONE or turns.is_last:
        return
    key = TurnKey(id(turns), num_tokens)
    nbytes = num_tokens * worker.run.scenario.kv_bytes_per_token
    spills = keeps is KeptTurns.TIERED
    worker.memory.offer(key, nbytes, spills)
    if spills and not worker.memory.holds(key):
        worker.fetches.evicted(key, nbytes)
