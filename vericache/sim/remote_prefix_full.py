"""Full-KV serving on Pipeline 2's workers, the baselines VeriCache is held to.

- FULL_LOCAL: the verifiers decode alone over the full KV from the store.
- FULL_REMOTE: the drafters fetch full KV over the network and decode.
- FULL_BOTH: every device serves full KV at once; a router sends each request to the pool that
  would finish it first, given the throughput each measured alone and, where the worker it would
  take lacks the request's prefix, the time to bring it (scheduler/placement.py `choose_pool`, as
  a KV-aware router counts the prefill a cache miss costs). Counting the fetch per request can
  keep a pool from a prefix that later requests would have shared, so the baseline also runs with
  the pools' queues alone and the better stands (`simulate_pools`).
Each request's worker is the one placement gives (scheduler/placement.py), as VeriCache's are.
What the scenario grants a deployment applies to these as to VeriCache: prefix caching, a host
tier, recomputing a prefix where that beats its fetch (host_tier.py), shared-prefix attention and
sequential turns, each turn a request of its own. The paper's baseline is FULL_REMOTE with none of
them: every request (every turn) moves its prefix's full KV over the slow network and prefills
all of its prompt after the prefix (remote_prefix_compare.py).

Assumption, stated: a full-KV deployment with prefix caching (vLLM's automatic prefix caching,
SGLang's radix cache) keeps a finished turn's KV too, and the session's next turn, whose prompt
extends that turn's, reuses it (turn_kv.py, `KeptTurns.TIERED`): it stays on the worker that
served the turn, evicted least recently used as an unused prefix is, into the host tier where the
node has one; the next turn goes to that worker (a cache-aware router's longest match, within
placement's balance) and prefills only its new tokens, reading the rest in place on the device
or loading it over PCIe from the host tier; a turn placed elsewhere, or whose KV is gone,
prefills everything after the prefix. `mode: auto`'s FULL_* paths keep what the served workers
keep (turn_kv.served_keeps): a verifier's or drafter's turn cache, on its device and spilled into
its host tier as these are (remote_prefix_auto.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from vericache.errors import InvalidRequestError
from vericache.scheduler.placement import PoolOption, choose_pool
from vericache.sim.batch_loop import SimJob, chunked_job
from vericache.sim.cost import Row
from vericache.sim.decoding import SimSequence
from vericache.sim.kv_memory import Session
from vericache.sim.long_context import SimReport
from vericache.sim.remote_prefix_scenario import RemotePrefixScenario
from vericache.sim.remote_prefix_workers import PrefixKey, Run, SessionTurns, Start, Worker
from vericache.sim.turn_kv import KeptTurns, ReusedTurn, holder, keep, let_go, load, reuse


class FullPool(enum.Enum):
    LOCAL = "full_local"  # the verifiers
    REMOTE = "full_remote"  # the drafters
    BOTH = "full_both"  # every device, routed


class Routing(enum.Enum):
    """How FULL_BOTH's router weighs the pools."""

    PREFIX_AWARE = "prefix_aware"  # the fetch of a prefix a pool lacks counted (choose_pool)
    LEAST_BUSY = "least_busy"  # the pools' queues alone


def simulate_full(
    scenario: RemotePrefixScenario,
    pool: FullPool,
    rates: dict[FullPool, float] | None = None,
    routing: Routing = Routing.PREFIX_AWARE,
) -> SimReport:
    """Full-KV serving on a pool; BOTH routes by `rates`, the tokens/s each pool served alone."""
    return Run(scenario).serve(full_start(pool, rates, routing))


def simulate_pools(scenario: RemotePrefixScenario) -> dict[FullPool, SimReport]:
    """Each pool's run: FULL_LOCAL, FULL_REMOTE, and FULL_BOTH routed by their rates, the better
    of its two routings (a deployment runs the router that suits its workload)."""
    local = simulate_full(scenario, FullPool.LOCAL)
    remote = simulate_full(scenario, FullPool.REMOTE)
    rates = {FullPool.LOCAL: local.tokens_per_s, FullPool.REMOTE: remote.tokens_per_s}
    both = [simulate_full(scenario, FullPool.BOTH, rates, routing) for routing in Routing]
    best = max(both, key=lambda report: report.tokens_per_s)
    return {FullPool.LOCAL: local, FullPool.REMOTE: remote, FullPool.BOTH: best}


def full_start(
    pool: FullPool,
    rates: dict[FullPool, float] | None = None,
    routing: Routing = Routing.PREFIX_AWARE,
) -> Start:
    """How full-KV serving on `pool` starts each turn (`Run.serve`'s `start`)."""
    if pool is FullPool.BOTH and not rates:
        raise InvalidRequestError("routing over both pools needs each pool's rate")

    def start(run: Run, prefix: int, turns: SessionTurns, arrival_s: float) -> None:
        keeps = KeptTurns.TIERED if run.scenario.prefix_caching else KeptTurns.NONE
        kept_on = holder(run.workers, turns, keeps)
        if pool is not FullPool.BOTH:
            local = pool is FullPool.LOCAL
        elif kept_on is not None:  # the router sends it where its session's KV is
            local = kept_on in run.verifiers
        else:
            local = _route_local(run, rates, prefix, turns, routing)
        worker = run.place(run.verifiers if local else run.drafters, prefix, prefer=kept_on)
        FullRequest.open_on(run, prefix, turns, arrival_s, worker, keeps)

    return start


@dataclass(eq=False)
class FullRequest:
    run: Run
    seq: SimSequence
    turns: SessionTurns
    arrival_s: float
    worker: Worker
    prefix: int
    keeps: KeptTurns  # what its worker keeps of a finished turn for the session's next
    own_bytes: int = 0  # its own tokens' KV, as reserved from its open to its end
    reused: ReusedTurn = field(default_factory=ReusedTurn)  # what its session's turn before left

    @classmethod
    def open_on(
        cls,
        run: Run,
        prefix: int,
        turns: SessionTurns,
        arrival_s: float,
        worker: Worker,
        keeps: KeptTurns = KeptTurns.NONE,
    ) -> None:
        """Opens the turn on `worker` (placed and counted by the caller), over what `worker`
        keeps of its session's turn before."""
        seq = run.sequence(turns)
        reused = reuse(worker, turns, keeps)
        own_bytes = run.own_bytes(turns, seq) - reused.held_bytes
        request = cls(run, seq, turns, arrival_s, worker, prefix, keeps, own_bytes, reused)
        # The prefix's full KV, unless held: from the host tier, the store (a verifier) or over
        # the network, or recomputed.
        worker.memory.admit(request.session, request._admitted)

    def _admitted(self) -> None:
        load(self.worker, self.reused, self._prefill)

    @property
    def key(self) -> PrefixKey:
        return self.run.prefix_key(self.prefix, self, compressed=False)

    @property
    def session(self) -> Session:
        return Session(self.key, self.run.scenario.prefix_bytes(compressed=False), self.own_bytes)

    def _prefill(self) -> None:
        """The prompt after the prefix, but for the tokens whose KV it reuses."""
        scenario = self.run.scenario
        num_reused = self.reused.num_tokens
        num_new = scenario.tokens_after_prefix(self.turns.history_tokens) - num_reused
        rows = scenario.prefill_rows(num_new, num_reused, self.key)
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
        let_go(self.worker, self.reused)
        self.worker.memory.release(self.session)
        keep(self.worker, self.turns, self._after_prefix(), self.keeps)
        self.run.finish(self, self.worker)


def _route_local(
    run: Run, rates: dict[FullPool, float], prefix: int, turns: SessionTurns, routing: Routing
) -> bool:
    """Whether the verifiers' pool would finish the request first (`choose_pool`): behind its
    requests in flight at its throughput (prefix-aware: after the prefix's full KV reaches the
    worker placement would give it there), against the drafters'."""
    key = run.prefix_key(prefix, turns, compressed=False)
    nbytes = run.scenario.prefix_bytes(compressed=False)
    options = []
    for workers, pool in ((run.verifiers, FullPool.LOCAL), (run.drafters, FullPool.REMOTE)):
        worker = run.choose(workers, prefix)
        ready_s = 0.0
        if routing is Routing.PREFIX_AWARE and not worker.memory.holds(key):
            ready_s = worker.fetches.ready_s(key, nbytes)
        in_flight = sum(w.num_requests for w in workers)
        options.append(PoolOption(in_flight, rates[pool], ready_s))
    return choose_pool(options, turns.num_tokens) == 0
