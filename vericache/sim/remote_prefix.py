"""Pipeline 2 simulated: remote prefix caching over G_local verifiers beside the full-KV store and
G_remote drafters across a slow network, against full-KV serving on the same devices.

Every worker is a device with a batch loop (batch_loop.py): the jobs it holds share each forward.
- VERICACHE, per-request rounds (the coordinator's default): a request's drafter fetches its
  prefix's compressed KV over the network unless it holds it; its verifier loads the prefix's full
  KV from the store unless it holds it, and prefills the rest of the prompt, and the prompt's
  exact KV crosses to the drafter. Then rounds back to back, each begun and committed by the
  engine's own round (decoding.py): the drafter drafts what the token budget and the context allow
  (up to x), one step each, batched with its other requests; the draft call crosses back
  (latency); the verifier verifies them and one more token in one forward, batched with whatever
  else is due; the committed tokens' exact KV crosses with the next draft call. A round with no
  drafts to make (one token left) calls the verifier alone, as the coordinator does.
- FULL_LOCAL: the verifiers decode alone over the full KV from the store.
- FULL_REMOTE: the drafters fetch full KV over the network and decode.
- FULL_BOTH: every device serves full KV at once; a router sends each request to the pool that
  would finish it first, given the throughput each measured alone.
Scheduled rounds, each verifier's loads and verifications planned by the real scheduler within
its memory, are remote_prefix_scheduled.py's.
Memory: with per-request rounds and in the full-KV configurations, a worker keeps every session it
serves resident, as a paged server with prefix caching and VeriCache's workers do
(kv_memory.WorkerMemory): a prefix's KV is held once and shared by the sessions over it, cached
after they end (within the role's prefix budget, where the scenario sets one), fetched on a miss
(a verifier's full KV from the store, a drafter's compressed or full KV over the network), and a
session waits for room before it opens. A verifier with `verifier_resident_bytes` keeps sessions'
own full KV as VeriCache's does instead (residency.py), beside the shared prefixes: each of its
forwards waits for room for its session's, if another's dropped it, and rebuilds it over the
shared prefix, reading nothing from the store. Assumptions, stated: a compressed prefix keeps every
token at `compressed_ratio` of the full bytes (quantization, KIVI); the network link of each
drafter is its own.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from vericache.errors import InvalidRequestError
from vericache.sim.batch_loop import SimJob
from vericache.sim.cost import Row
from vericache.sim.decoding import SimSequence
from vericache.sim.kv_memory import Session
from vericache.sim.long_context import SimReport
from vericache.sim.remote_prefix_scenario import RemotePrefixScenario
from vericache.sim.remote_prefix_workers import Run, Worker, placed


def simulate_vericache(scenario: RemotePrefixScenario) -> SimReport:
    return Run(scenario).serve(VeriCacheRequest.start)


@dataclass(eq=False)
class VeriCacheRequest:
    run: Run
    prefix: int
    seq: SimSequence
    arrival_s: float
    drafter: Worker
    verifier: Worker

    @classmethod
    def start(cls, run: Run, prefix: int, num_tokens: int, arrival_s: float) -> None:
        key = run.placement_key(prefix)
        drafter, verifier = placed(run.drafters, key), placed(run.verifiers, key)
        request = cls(run, prefix, run.sequence(num_tokens), arrival_s, drafter, verifier)
        if verifier.residency is not None:  # its own full KV, beside the shared prefix's
            own = run.scenario.reserved_own_full_kv_bytes(request.seq.max_output_tokens)
            verifier.residency.open(request, own)
        # Memory in one order, the verifier's first: no two sessions wait on each other. Each
        # admission brings its prefix, unless held: the full KV from the store to the verifier,
        # the compressed KV over the network to the drafter.
        verifier.memory.admit(
            request.verifier_session(),
            lambda: drafter.memory.admit(request.drafter_session(), request._open),
        )

    def verifier_session(self) -> Session:
        """Over the prefix's full KV, which verifications attend over, beside the exact KV of
        its own tokens (which the residency holds instead, where the verifier keeps one)."""
        scenario = self.run.scenario
        residency = self.verifier.residency
        own = 0 if residency is not None else scenario.own_bytes(self.seq.max_output_tokens)
        key = self.run.prefix_key(self.prefix, self)
        return Session(key, scenario.prefix_bytes(compressed=False), own)

    def drafter_session(self) -> Session:
        """Over the prefix's compressed KV, beside the exact KV of its own tokens."""
        scenario = self.run.scenario
        own = scenario.own_bytes(self.seq.max_output_tokens)
        key = self.run.prefix_key(self.prefix, self)
        return Session(key, scenario.prefix_bytes(compressed=True), own)

    def finished(self) -> None:
        self.verifier.memory.release(self.verifier_session())
        self.drafter.memory.release(self.drafter_session())
        if self.verifier.residency is not None:
            self.verifier.residency.close(self)
        self.run.finish(self.verifier, self.arrival_s)
        self.drafter.num_requests -= 1

    def _open(self) -> None:
        """Both prefixes in place: the verifier prefills the prompt after its prefix."""
        self._prefill()

    def _prefill(self) -> None:
        row = self.run.scenario.row(self.run.scenario.suffix_tokens, 0, compressed=False)
        self._on_verifier(row, self._first_token)

    def _on_verifier(self, row: Row, then: Callable[[], None]) -> None:
        """One verifier forward over the session's full KV, brought onto its device first (and
        held there meanwhile) where the verifier keeps a residency."""
        residency = self.verifier.residency
        if residency is None:
            self.verifier.loop.submit(SimJob(lambda: row, 1, then))
            return

        def done() -> None:
            residency.release(self)
            then()

        residency.use(self, lambda: self.verifier.loop.submit(SimJob(lambda: row, 1, done)))

    def _first_token(self) -> None:
        self._committed(self.seq.first_token(), exact_tokens=self.run.scenario.suffix_tokens + 1)

    def _committed(self, num_tokens: int, exact_tokens: int) -> None:
        """Emits tokens; their exact KV crosses to the drafter with the next draft call."""
        self.run.emit(num_tokens)
        if self.seq.is_finished:
            self.finished()
            return
        num_drafts = self.seq.begin_round(self.run.scenario.draft_len)
        if num_drafts == 0:  # the budget leaves one token: the verifier alone chooses it
            self._verify()
            return
        exact_bytes = exact_tokens * self.run.scenario.kv_bytes_per_token
        self.drafter.link.send(exact_bytes, lambda: self._draft(num_drafts))

    def _draft(self, num_drafts: int) -> None:
        job = SimJob(self._draft_row, num_drafts, self._drafted, on_step=self.seq.draft_step)
        self.drafter.loop.submit(job)

    def _drafted(self) -> None:
        """The drafts cross to the verifier: a call, small enough to cost only latency."""
        self.run.sim.after(self.run.scenario.network_latency_s, self._verify)

    def _after_prefix(self) -> int:
        """Exact tokens a cache holds after the prefix: the suffix and the committed output."""
        return self.run.scenario.suffix_tokens + self.seq.num_output_tokens

    def _draft_row(self) -> Row:
        """A draft step over the compressed KV, which holds this round's drafts so far too."""
        return self.run.scenario.row(1, self._after_prefix() + self.seq.num_drafts, compressed=True)

    def _verify(self) -> None:
        row = self.run.scenario.row(self.seq.num_drafts + 1, self._after_prefix(), compressed=False)
        self._on_verifier(row, self._verified)

    def _verified(self) -> None:
        num_drafts = self.seq.num_drafts
        outcome = self.seq.verify(self.run.scenario.acceptance.accepted(num_drafts, self.run.rng))
        self.run.report.accepted_per_round.append(self.seq.seq.stats.accepted_per_round[-1])
        self.run.report.draft_lens.append(num_drafts)
        self._committed(len(outcome.committed), exact_tokens=len(outcome.committed))


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
    return Run(scenario).serve(lambda *args: _FullRequest.start(*args, pool=pool, rates=rates))


@dataclass(eq=False)
class _FullRequest:
    run: Run
    seq: SimSequence
    arrival_s: float
    worker: Worker
    prefix: int

    @classmethod
    def start(cls, run, prefix, num_tokens, arrival_s, pool: FullPool, rates) -> None:
        local = pool is FullPool.LOCAL or (pool is FullPool.BOTH and _route_local(run, rates))
        worker = placed(run.verifiers if local else run.drafters, run.placement_key(prefix))
        request = cls(run, run.sequence(num_tokens), arrival_s, worker, prefix)
        # The prefix's full KV, unless held: from the store (a verifier) or over the network.
        worker.memory.admit(request.session, request._prefill)

    @property
    def session(self) -> Session:
        scenario = self.run.scenario
        own = scenario.own_bytes(self.seq.max_output_tokens)
        key = self.run.prefix_key(self.prefix, self)
        return Session(key, scenario.prefix_bytes(compressed=False), own)

    def _prefill(self) -> None:
        row = self.run.scenario.row(self.run.scenario.suffix_tokens, 0, compressed=False)
        self.worker.loop.submit(SimJob(lambda: row, 1, self._decode))

    def _decode(self) -> None:
        self.run.emit(self.seq.first_token())
        num_steps = (
            0 if self.seq.is_finished else self.seq.decode_target(self.seq.seq.num_remaining)
        )
        job = SimJob(self._row, num_steps, self._finish, on_step=self._decoded)
        self.worker.loop.submit(job)

    def _row(self) -> Row:
        after_prefix = self.run.scenario.suffix_tokens + self.seq.num_output_tokens
        return self.run.scenario.row(1, after_prefix, compressed=False)

    def _decoded(self) -> None:
        self.run.emit(self.seq.decode_step())

    def _finish(self) -> None:
        self.worker.memory.release(self.session)
        self.run.finish(self.worker, self.arrival_s)


def _route_local(run: Run, rates: dict[FullPool, float]) -> bool:
    """Whether the verifiers' pool would finish one more request first: its requests in flight
    (with this one) over its throughput, against the drafters'."""
    local = sum(w.num_requests for w in run.verifiers) + 1
    remote = sum(w.num_requests for w in run.drafters) + 1
    return local / rates[FullPool.LOCAL] <= remote / rates[FullPool.REMOTE]


def compare(
    scenario: RemotePrefixScenario,
    vericache: Callable[[RemotePrefixScenario], SimReport] = simulate_vericache,
) -> dict:
    """VERICACHE (per-request rounds, or the simulation given) against FULL_LOCAL, FULL_REMOTE
    and FULL_BOTH on the same workers."""
    local = simulate_full(scenario, FullPool.LOCAL)
    remote = simulate_full(scenario, FullPool.REMOTE)
    rates = {FullPool.LOCAL: local.tokens_per_s, FullPool.REMOTE: remote.tokens_per_s}
    both = simulate_full(scenario, FullPool.BOTH, rates)
    vericache = vericache(scenario)
    best = max(local.tokens_per_s, remote.tokens_per_s, both.tokens_per_s)
    return {
        "vericache": vericache,
        "full_local": local,
        "full_remote": remote,
        "full_both": both,
        "vericache_over_best_full": vericache.tokens_per_s / best,
    }
