"""Full-KV serving on Pipeline 2's workers, the baselines VeriCache is held to.

- FULL_LOCAL: the verifiers decode alone over the full KV from the store.
- FULL_REMOTE: the drafters fetch full KV over the network and decode.
- FULL_BOTH: every device serves full KV at once; a router sends each request to the pool that
  would finish it first, given the throughput each measured alone.
Each request's worker is the one placement gives (scheduler/placement.py), as VeriCache's are.
What the scenario grants a deployment applies to these as to VeriCache: prefix caching, a host
tier, recomputing a prefix where that beats its fetch (host_tier.py), shared-prefix attention and
sequential turns. The paper's baseline is FULL_REMOTE with none of them: every request moves its
prefix's full KV over the slow network (remote_prefix_compare.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from vericache.errors import InvalidRequestError
from vericache.sim.batch_loop import SimJob
from vericache.sim.cost import Row
from vericache.sim.decoding import SimSequence
from vericache.sim.kv_memory import Session
from vericache.sim.long_context import SimReport
from vericache.sim.remote_prefix_scenario import RemotePrefixScenario
from vericache.sim.remote_prefix_workers import PrefixKey, Run, SessionTurns, Worker


class FullPool(enum.Enum):
    LOCAL = "full_local"  # the verifiers
    REMOTE = "full_remote"  # the drafters
    BOTH = "full_both"  # every device, routed


def simulate_full(
    scenario: RemotePrefixScenario, pool: FullPool, rates: dict[FullPool, float] | None = None
) -> SimReport:
    """Full-KV serving on a pool; BOTH routes by `rates`, the tokens/s each pool served alone."""
    if pool is FullPool.BOTH and not rates:
        raise InvalidRequestError("routing over both pools needs each pool's rate")

    def start(run: Run, prefix: int, turns: SessionTurns, arrival_s: float) -> None:
        local = pool is FullPool.LOCAL or (pool is FullPool.BOTH and _route_local(run, rates))
        worker = run.place(run.verifiers if local else run.drafters, prefix)
        FullRequest.open_on(run, prefix, turns, arrival_s, worker)

    return Run(scenario).serve(start)


@dataclass(eq=False)
class FullRequest:
    run: Run
    seq: SimSequence
    turns: SessionTurns
    arrival_s: float
    worker: Worker
    prefix: int
    own_bytes: int = 0  # its own tokens' KV, as reserved from its open to its end

    @classmethod
    def open_on(
        cls, run: Run, prefix: int, turns: SessionTurns, arrival_s: float, worker: Worker
    ) -> None:
        """Opens the session on `worker` (placed and counted by the caller)."""
        seq = run.sequence(turns)
        request = cls(run, seq, turns, arrival_s, worker, prefix, run.own_bytes(turns, seq))
        # The prefix's full KV, unless held: from the host tier, the store (a verifier) or over
        # the network, or recomputed.
        worker.memory.admit(request.session, request._prefill)

    @property
    def key(self) -> PrefixKey:
        return self.run.prefix_key(self.prefix, self, compressed=False)

    @property
    def session(self) -> Session:
        return Session(self.key, self.run.scenario.prefix_bytes(compressed=False), self.own_bytes)

    def _prefill(self) -> None:
        scenario = self.run.scenario
        row = scenario.row(
            scenario.suffix_tokens, self.turns.history_tokens, False, prefix_key=self.key
        )
        self.worker.loop.submit(SimJob(lambda: row, 1, self._decode))

    def _decode(self) -> None:
        self.run.emit(self.seq.first_token())
        num_steps = (
            0 if self.seq.is_finished else self.seq.decode_target(self.seq.seq.num_remaining)
        )
        job = SimJob(self._row, num_steps, self._turn_ended, on_step=self._decoded)
        self.worker.loop.submit(job)

    def _row(self) -> Row:
        scenario = self.run.scenario
        after_prefix = (
            self.turns.history_tokens + scenario.suffix_tokens + self.seq.num_output_tokens
        )
        return scenario.row(1, after_prefix, compressed=False, prefix_key=self.key)

    def _decoded(self) -> None:
        self.run.emit(self.seq.decode_step())

    def _turn_ended(self) -> None:
        if self.turns.is_last:
            self.worker.memory.release(self.session)
            self.run.finish(self.arrival_s, self.worker)
            return
        self.turns.advance(self.run.scenario.suffix_tokens, self.seq.num_output_tokens)
        self.seq = self.run.sequence(self.turns)
        self._prefill()


def _route_local(run: Run, rates: dict[FullPool, float]) -> bool:
    """Whether the verifiers' pool would finish one more request first: its requests in flight
    (with this one) over its throughput, against the drafters'."""
    local = sum(w.num_requests for w in run.verifiers) + 1
    remote = sum(w.num_requests for w in run.drafters) + 1
    return local / rates[FullPool.LOCAL] <= remote / rates[FullPool.REMOTE]
