"""Full-KV serving on Pipeline 2's workers, the baselines VeriCache is held to.

- FULL_LOCAL: the verifiers decode alone over the full KV from the store.
- FULL_REMOTE: the drafters fetch full KV over the network and decode.
- FULL_BOTH: every device serves full KV at once; a router sends each request to the pool that
  would finish it first, given the throughput each measured alone.
Each request's worker is the one placement gives (scheduler/placement.py), as VeriCache's are.
What the scenario grants a deployment applies to these as to VeriCache: prefix caching, a host
tier, recomputing a prefix where that beats its fetch (host_tier.py), shared-prefix attention and
sequential turns, each turn a request of its own. The paper's baseline is FULL_REMOTE with none of
them: every request (every turn) moves its prefix's full KV over the slow network and prefills
all of its prompt after the prefix (remote_prefix_compare.py).

Assumption, stated: a full-KV deployment with prefix caching (vLLM's automatic prefix caching,
SGLang's radix cache) keeps a finished turn's KV too, and the session's next turn, whose prompt
extends that turn's, reuses it. Here that KV stays on the worker that served the turn as a cached
entry (`TurnKey`), evicted least recently used as an unused prefix is, into the host tier where
the node has one; the next turn goes to that worker (a cache-aware router's longest match, within
placement's balance) and prefills only its new tokens, reading the rest in place on the device
or loading it over PCIe from the host tier; a turn placed elsewhere, or whose KV is gone,
prefills everything after the prefix. `mode: auto`'s FULL_* paths keep none: a served request
keeps no KV of its own after it ends (remote_prefix_auto.py).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from vericache.errors import InvalidRequestError
from vericache.sim.batch_loop import SimJob, chunked_job
from vericache.sim.cost import Row
from vericache.sim.decoding import SimSequence
from vericache.sim.kv_memory import Session
from vericache.sim.long_context import SimReport
from vericache.sim.remote_prefix_scenario import RemotePrefixScenario
from vericache.sim.remote_prefix_workers import PrefixKey, Run, SessionTurns, Start, Worker


class FullPool(enum.Enum):
    LOCAL = "full_local"  # the verifiers
    REMOTE = "full_remote"  # the drafters
    BOTH = "full_both"  # every device, routed


def simulate_full(
    scenario: RemotePrefixScenario, pool: FullPool, rates: dict[FullPool, float] | None = None
) -> SimReport:
    """Full-KV serving on a pool; BOTH routes by `rates`, the tokens/s each pool served alone."""
    return Run(scenario).serve(full_start(pool, rates))


def full_start(pool: FullPool, rates: dict[FullPool, float] | None = None) -> Start:
    """How full-KV serving on `pool` starts each turn (`Run.serve`'s `start`)."""
    if pool is FullPool.BOTH and not rates:
        raise InvalidRequestError("routing over both pools needs each pool's rate")

    def start(run: Run, prefix: int, turns: SessionTurns, arrival_s: float) -> None:
        caches_turns = run.scenario.prefix_caching
        holder = _turns_holder(run, turns) if caches_turns else None
        if pool is not FullPool.BOTH:
            local = pool is FullPool.LOCAL
        elif holder is not None:  # the router sends it where its session's KV is
            local = holder in run.verifiers
        else:
            local = _route_local(run, rates)
        worker = run.place(run.verifiers if local else run.drafters, prefix, prefer=holder)
        FullRequest.open_on(run, prefix, turns, arrival_s, worker, caches_turns)

    return start


@dataclass(frozen=True)
class TurnKey:
    """What a full-KV worker with prefix caching keeps a finished turn's KV under: its session's
    tokens after the prefix, the turn's own included."""

    session: int  # the session's SessionTurns, by id
    num_tokens: int


def _turns_holder(run: Run, turns: SessionTurns) -> Worker | None:
    """The worker that keeps the session's KV from its turn before, on its device or in its
    host tier; None where none does (its first turn, or evicted)."""
    key = TurnKey(id(turns), turns.history_tokens)
    for worker in run.workers:
        tier = worker.host_tier
        if worker.memory.holds(key) or (tier is not None and tier.holds(key)):
            return worker
    return None


@dataclass(eq=False)
class FullRequest:
    run: Run
    seq: SimSequence
    turns: SessionTurns
    arrival_s: float
    worker: Worker
    prefix: int
    caches_turns: bool  # its deployment keeps a finished turn's KV for the session's next turn
    own_bytes: int = 0  # its own tokens' KV, as reserved from its open to its end
    num_reused: int = 0  # tokens after the prefix whose KV its session's turn before left here
    pinned: TurnKey | None = None  # that KV, read in place on the device until it ends

    @classmethod
    def open_on(
        cls,
        run: Run,
        prefix: int,
        turns: SessionTurns,
        arrival_s: float,
        worker: Worker,
        caches_turns: bool = False,
    ) -> None:
        """Opens the turn on `worker` (placed and counted by the caller)."""
        seq = run.sequence(turns)
        own_bytes = run.own_bytes(turns, seq)
        request = cls(run, seq, turns, arrival_s, worker, prefix, caches_turns, own_bytes)
        admitted = request._reuse_turns() if caches_turns else request._prefill
        # The prefix's full KV, unless held: from the host tier, the store (a verifier) or over
        # the network, or recomputed.
        worker.memory.admit(request.session, admitted)

    def _reuse_turns(self) -> Callable[[], None]:
        """Finds its session's KV from the turn before on its worker: on the device, pinned and
        read in place (its bytes held there already, not its own); in the host tier, loaded over
        PCIe once admitted; else none, prefilled again. Returns what runs once admitted."""
        num_tokens = self.turns.history_tokens
        key = TurnKey(id(self.turns), num_tokens)
        nbytes = num_tokens * self.run.scenario.kv_bytes_per_token
        memory, tier = self.worker.memory, self.worker.host_tier
        if memory.holds(key):
            memory.pin(key)
            self.pinned, self.num_reused = key, num_tokens
            self.own_bytes -= nbytes
            return self._prefill
        if tier is not None and tier.holds(key):
            tier.touch(key)
            self.num_reused = num_tokens
            return lambda: self.worker.host_link.send(nbytes, self._prefill)
        return self._prefill

    @property
    def key(self) -> PrefixKey:
        return self.run.prefix_key(self.prefix, self, compressed=False)

    @property
    def session(self) -> Session:
        return Session(self.key, self.run.scenario.prefix_bytes(compressed=False), self.own_bytes)

    def _prefill(self) -> None:
        """The prompt after the prefix, but for the tokens whose KV it reuses."""
        scenario = self.run.scenario
        num_new = scenario.tokens_after_prefix(self.turns.history_tokens) - self.num_reused
        rows = scenario.prefill_rows(num_new, self.num_reused, self.key)
        self.worker.loop.submit(chunked_job(rows, self._decode))

    def _decode(self) -> None:
        self.run.emit(self.seq.first_token())
        num_steps = (
            0 if self.seq.is_finished else self.seq.decode_target(self.seq.seq.num_remaining)
        )
        job = SimJob(self._row, num_steps, self._turn_ended, on_step=self._decoded)
        self.worker.loop.submit(job)

    def _row(self) -> Row:
        return self.run.scenario.row(1, self._after_prefix(), compressed=False, prefix_key=self.key)

    def _after_prefix(self) -> int:
        """Its session's tokens after the prefix: earlier turns, the suffix and its output."""
        return self.run.scenario.tokens_after_prefix(
            self.turns.history_tokens, self.seq.num_output_tokens
        )

    def _decoded(self) -> None:
        self.run.emit(self.seq.decode_step())

    def _turn_ended(self) -> None:
        memory = self.worker.memory
        if self.pinned is not None:  # this turn's KV holds its tokens, kept below
            memory.unpin(self.pinned, drop=True)
        memory.release(self.session)
        if self.caches_turns and not self.turns.is_last:
            self._keep_turns()
        self.run.finish(self, self.worker)

    def _keep_turns(self) -> None:
        """Keeps its session's KV after the prefix for the next turn: on the device where room is
        free (evicted later into the host tier, as a prefix is), else in the host tier at once."""
        num_tokens = self._after_prefix()
        key = TurnKey(id(self.turns), num_tokens)
        nbytes = num_tokens * self.run.scenario.kv_bytes_per_token
        self.worker.memory.offer(key, nbytes)
        if not self.worker.memory.holds(key):
            self.worker.fetches.evicted(key, nbytes)


def _route_local(run: Run, rates: dict[FullPool, float]) -> bool:
    """Whether the verifiers' pool would finish one more request first: its requests in flight
    (with this one) over its throughput, against the drafters'."""
    local = sum(w.num_requests for w in run.verifiers) + 1
    remote = sum(w.num_requests for w in run.drafters) + 1
    return local / rates[FullPool.LOCAL] <= remote / rates[FullPool.REMOTE]
