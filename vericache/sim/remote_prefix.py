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
- Warm nodes (`warm_nodes`, as served: serve/workers/warm_node.py): once a drafter node has the
  prefix's compressed KV and drafts over it, it streams the prefix's full KV over its link into its
  host tier, in the background (compressed fetches and the rounds' exact KV go first). Once the copy
  is complete, its sessions' next round boundary moves their verification onto the node: the
  central verifier lets go of the session, the node prefills the session's tokens after the
  prefix once over its full KV (but for those a turn it kept holds), and each round then drafts
  and verifies there, with no link traffic: a verification reads the prefix's full KV from the
  host tier over PCIe (streamed through the forward, a layer's worth on the device at a time),
  unless the device holds a copy, which it keeps after a read where room is free (least
  recently used out first). A session whose drafter is warm when it arrives never visits the
  central verifier. Placement prefers warm nodes (scheduler/placement.py).
- Sequential turns (`turns_per_session`): each turn is a request of its own, as served (a
  Generate call whose prompt is the prefix, the conversation so far and the new turn), arriving
  when the one before it ends and placed anew (its path chosen anew under `mode: auto`). A central
  verifier keeps a finished session's exact KV after the prefix in its turn cache (turn_kv.py),
  on its device and, where the node has a host tier (the served `--turn-host-bytes`), spilled
  there and loaded back over PCIe, so a later turn it verifies prefills only its new tokens where
  the KV is still there. A drafter keeps the turns its node verified (and under `mode: auto` its
  full-KV turns) in its own turn cache, as served: a session that opens its verification on a
  warm node (arriving there, or moving there) prefills only what a kept turn there lacks; a
  drafter keeps none of the sessions a central verifier verifies (as served: its draft cache
  holds their compressed prefix), so the verifier still hands the exact KV of every token after
  the prefix to it with the first draft call.
- FULL_LOCAL, FULL_REMOTE, FULL_BOTH: remote_prefix_full.py; `mode: auto`, each request's choice
  of path: remote_prefix_auto.py.
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

from collections.abc import Callable
from dataclasses import dataclass, field

from vericache.sim.batch_loop import SimJob, chunked_job
from vericache.sim.cost import Row
from vericache.sim.decoding import SimSequence
from vericache.sim.kv_memory import Session
from vericache.sim.long_context import SimReport
from vericache.sim.remote_prefix_full import FullPool, simulate_full, simulate_pools
from vericache.sim.remote_prefix_scenario import RemotePrefixScenario
from vericache.sim.remote_prefix_workers import PrefixKey, Run, SessionTurns, Worker
from vericache.sim.turn_kv import KeptTurns, ReusedTurn, keep, let_go, load, reuse, served_keeps

__all__ = [
    "FullPool",
    "VeriCacheRequest",
    "compare",
    "simulate_full",
    "simulate_pools",
    "simulate_vericache",
]


def simulate_vericache(scenario: RemotePrefixScenario) -> SimReport:
    return Run(scenario).serve(VeriCacheRequest.start)


@dataclass(eq=False)
class VeriCacheRequest:
    run: Run
    prefix: int
    turns: SessionTurns
    seq: SimSequence
    arrival_s: float
    drafter: Worker
    verifier: Worker | None  # the central verifier; None while the drafter's node verifies
    own_bytes: int = 0  # its own tokens' exact KV, as reserved from its open to its end
    # What the worker that verifies it (its central verifier, or its node) keeps of a finished
    # turn, and what the one that prefilled its prompt reuses of its session's turn before.
    keeps: KeptTurns = KeptTurns.NONE
    reused: ReusedTurn = field(default_factory=ReusedTurn)

    @classmethod
    def start(
        cls,
        run: Run,
        prefix: int,
        turns: SessionTurns,
        arrival_s: float,
        drafter: Worker | None = None,
    ) -> None:
        """Opens the session on `drafter` (placed and counted by the caller), or on the drafter
        placement gives; verified on its node where that is warm, else by a central verifier."""
        drafter = drafter or run.place(run.drafters, prefix)
        seq = run.sequence(turns)
        own_bytes = run.own_bytes(turns, seq)
        if drafter.is_warm(prefix):
            # Its node's full KV of the turn before, read in place, is not its own to reserve.
            keeps = served_keeps(drafter)
            reused = reuse(drafter, turns, keeps)
            own_bytes -= reused.held_bytes
            request = cls(
                run, prefix, turns, seq, arrival_s, drafter, None, own_bytes, keeps, reused
            )
            drafter.num_local_sessions += 1
            drafter.memory.admit(request.drafter_session(), request._open)
            return
        verifier = run.place(run.verifiers, prefix)
        request = cls(run, prefix, turns, seq, arrival_s, drafter, verifier, own_bytes)
        if verifier.residency is not None:  # its own full KV, beside the shared prefix's
            own = run.scenario.reserved_own_full_kv_bytes(request.seq.max_output_tokens)
            verifier.residency.open(request, own)
        request.keeps = served_keeps(verifier)
        request.reused = reuse(verifier, turns, request.keeps)
        # Memory in one order, the verifier's first: no two sessions wait on each other. Each
        # admission brings its prefix, unless held: the full KV from the store to the verifier,
        # the compressed KV over the network to the drafter.
        verifier.memory.admit(
            request.verifier_session(),
            lambda: drafter.memory.admit(request.drafter_session(), request._open),
        )

    @property
    def full_key(self) -> PrefixKey:
        return self.run.prefix_key(self.prefix, self, compressed=False)

    def verifier_session(self) -> Session:
        """Over the prefix's full KV, which verifications attend over, beside the exact KV of
        its own tokens (which the residency holds instead, where the verifier keeps one), but
        for those its session's turn before left there."""
        own = 0 if self.verifier.residency is not None else self.own_bytes
        own -= self.reused.held_bytes
        return Session(self.full_key, self.run.scenario.prefix_bytes(compressed=False), own)

    def drafter_session(self) -> Session:
        """Over the prefix's compressed KV, beside the exact KV of its own tokens."""
        key = self.run.prefix_key(self.prefix, self, compressed=True)
        return Session(key, self.run.scenario.prefix_bytes(compressed=True), self.own_bytes)

    def finished(self) -> None:
        """The worker that verified its last round keeps its full KV after the prefix for its
        session's next turn: its central verifier, or its node (once its session has let go of
        the drafter's memory, which the kept turn takes)."""
        verifier = self.verifier
        if verifier is not None:
            self._release_verifier()
        else:
            self.drafter.num_local_sessions -= 1
            let_go(self.drafter, self.reused)
        self.drafter.memory.release(self.drafter_session())
        keep(verifier or self.drafter, self.turns, self._after_prefix(), self.keeps)
        self.run.finish(self, *([verifier] if verifier else []), self.drafter)

    def _release_verifier(self) -> None:
        """The central verifier lets go of the session's KV: the prefix's share and its own,
        and what its session's turn before left there."""
        verifier = self.verifier
        verifier.memory.release(self.verifier_session())
        let_go(verifier, self.reused)
        if verifier.residency is not None:
            verifier.residency.close(self)

    def _open(self) -> None:
        """Both prefixes in place (or the compressed one, on a warm node): the turn's prompt
        after its prefix is prefilled, once what its verifying worker reuses from its host tier
        has come over PCIe."""
        load(self.verifier or self.drafter, self.reused, self._prefill)

    def _prefill(self) -> None:
        """The prompt after the prefix over the full KV, on the central verifier or the node,
        but for the tokens whose KV its session's turn before left there."""
        rows = self._prefill_rows(self.reused.num_tokens)
        if self.verifier is None:
            self._on_local(rows, self._first_token)
        else:
            self._on_verifier(rows, self._first_token)

    def _prefill_rows(self, num_reused: int = 0) -> list[Row]:
        """A prefill of the exact tokens after the prefix past the first `num_reused`, over its
        full KV."""
        num_new = self._after_prefix() - num_reused
        return self.run.scenario.prefill_rows(num_new, num_reused, self.full_key)

    def _on_verifier(self, rows: list[Row], then: Callable[[], None]) -> None:
        """Verifier forwards, one per row, over the session's full KV, brought onto its device
        first (and held there meanwhile) where the verifier keeps a residency."""
        residency = self.verifier.residency
        if residency is None:
            self.verifier.loop.submit(chunked_job(rows, then))
            return

        def done() -> None:
            residency.release(self)
            then()

        residency.use(self, lambda: self.verifier.loop.submit(chunked_job(rows, done)))

    def _on_local(self, rows: list[Row], then: Callable[[], None]) -> None:
        """Forwards on the warm node, one per row, over the prefix's full KV: its device's copy
        where it holds one, else read as its device's misses come (TieredFetch.read: from its
        host tier over PCIe, or where the tier has let it go, fetched again as a cold worker
        would), and kept on the device after where room is free."""
        drafter, key = self.drafter, self.full_key
        nbytes = self.run.scenario.prefix_bytes(compressed=False)

        def forward() -> None:
            drafter.memory.offer(key, nbytes)
            drafter.loop.submit(chunked_job(rows, then))

        if drafter.memory.holds(key):
            drafter.memory.touch(key)
            drafter.loop.submit(chunked_job(rows, then))
        else:
            drafter.fetches.read(key, nbytes, forward)

    def _first_token(self) -> None:
        """The prompt's exact KV after the prefix (and the first token's) crosses to the drafter
        with the first draft call, as the verifier's open hands it over."""
        num_tokens = self.seq.first_token()
        self._committed(num_tokens, exact_tokens=self._after_prefix())

    def _committed(self, num_tokens: int, exact_tokens: int) -> None:
        """Emits tokens; their exact KV crosses to the drafter with the next draft call."""
        self.run.emit(num_tokens)
        if self.seq.is_finished:
            self.finished()
        elif self._can_go_local():
            self._go_local(lambda: self._begin_round(0))
        else:
            self._begin_round(exact_tokens)

    def _can_go_local(self) -> bool:
        """Whether its node has become warm for its prefix while a central verifier served it."""
        if self.verifier is None or not self.run.scenario.warm_nodes:
            return False
        return self.drafter.host_tier.holds(self.full_key)

    def _go_local(self, then: Callable[[], None]) -> None:
        """Between two rounds: the node prefills the session's tokens after the prefix over its
        full KV, but for those a turn it kept holds (copied into the session, whose memory is
        reserved already: the kept turn stays, as served), and verifies its rounds from now on."""
        self._release_verifier()
        self.verifier.num_requests -= 1
        self.verifier = None
        drafter = self.drafter
        drafter.num_local_sessions += 1
        self.run.report.num_warm_switches += 1
        self.keeps = served_keeps(drafter)
        self.reused = reuse(drafter, self.turns, self.keeps)
        rows = self._prefill_rows(self.reused.num_tokens)
        load(drafter, self.reused, lambda: self._on_local(rows, then))

    def _begin_round(self, exact_tokens: int) -> None:
        num_drafts = self.seq.begin_round(self.run.scenario.draft_len)
        if num_drafts == 0:  # the budget leaves one token: the verifier alone chooses it
            self._verify()
        elif self.verifier is None:  # on its node: the committed tokens' KV is in place
            self._draft(num_drafts)
        else:
            scenario = self.run.scenario
            exact_bytes = exact_tokens * scenario.kv_bytes_per_token
            exact_bytes += scenario.refresh_bytes_due(self.seq.seq.stats.rounds)
            self.drafter.link.send(exact_bytes, lambda: self._draft(num_drafts))

    def _draft(self, num_drafts: int) -> None:
        if self.verifier is not None and self.run.scenario.warm_nodes:
            full_bytes = self.run.scenario.prefix_bytes(compressed=False)
            self.drafter.stream_full(self.full_key, full_bytes)
        job = SimJob(self._draft_row, num_drafts, self._drafted, on_step=self.seq.draft_step)
        self.drafter.loop.submit(job)

    def _drafted(self) -> None:
        """The drafts cross to the verifier: a call, small enough to cost only latency (none on
        the drafter's own node)."""
        if self.verifier is None:
            self._verify()
        else:
            self.run.sim.after(self.run.scenario.network_latency_s, self._verify)

    def _after_prefix(self) -> int:
        """Exact tokens a cache holds after the prefix: earlier turns, the suffix and the
        committed output."""
        return self.run.scenario.tokens_after_prefix(
            self.turns.history_tokens, self.seq.num_output_tokens
        )

    def _draft_row(self) -> Row:
        """A draft step over the compressed KV, which holds this round's drafts so far too."""
        key = self.run.prefix_key(self.prefix, self, compressed=True)
        num_after = self._after_prefix() + self.seq.num_drafts
        return self.run.scenario.row(1, num_after, compressed=True, prefix_key=key)

    def _verify(self) -> None:
        scenario = self.run.scenario
        row = scenario.row(
            self.seq.num_drafts + 1, self._after_prefix(), False, prefix_key=self.full_key
        )
        if self.verifier is None:
            self.run.report.num_local_verifications += 1
            self._on_local([row], self._verified)
        else:
            self.run.report.num_central_verifications += 1
            self._on_verifier([row], self._verified)

    def _verified(self) -> None:
        num_drafts = self.seq.num_drafts
        outcome = self.seq.verify(self.run.accepted(self.turns, num_drafts))
        self.run.report.accepted_per_round.append(self.seq.seq.stats.accepted_per_round[-1])
        self.run.report.draft_lens.append(num_drafts)
        self._committed(len(outcome.committed), exact_tokens=len(outcome.committed))


def compare(
    scenario: RemotePrefixScenario,
    vericache: Callable[[RemotePrefixScenario], SimReport] = simulate_vericache,
) -> dict:
    """VERICACHE (per-request rounds, or the simulation given) against FULL_LOCAL, FULL_REMOTE
    and FULL_BOTH on the same workers."""
    pools = simulate_pools(scenario)
    local, remote, both = pools[FullPool.LOCAL], pools[FullPool.REMOTE], pools[FullPool.BOTH]
    vericache = vericache(scenario)
    best = max(local.tokens_per_s, remote.tokens_per_s, both.tokens_per_s)
    return {
        "vericache": vericache,
        "full_local": local,
        "full_remote": remote,
        "full_both": both,
        "vericache_over_best_full": vericache.tokens_per_s / best,
    }
