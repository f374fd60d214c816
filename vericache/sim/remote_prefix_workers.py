"""Pipeline 2's workers as the simulator runs them: a device (or tensor-parallel group) with its
batch loop, its inbound link, its host link and host tier, and its KV memory (sessions and the
prefixes they share); and a run, which serves a scenario's requests over them."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from vericache.errors import InvalidRequestError
from vericache.scheduler.placement import Candidate, place
from vericache.sim.batch_loop import ForwardCount, SimBatchLoop
from vericache.sim.closed_loop import ClosedLoop
from vericache.sim.cost import Row
from vericache.sim.decoding import SimSequence
from vericache.sim.events import Device, Link, Simulation
from vericache.sim.host_tier import HostTier, Source, TieredFetch
from vericache.sim.kv_memory import WorkerMemory
from vericache.sim.long_context import SimReport
from vericache.sim.prefix_arrival import PrefixPrefill, ReceivedLink
from vericache.sim.remote_prefix_scenario import RemotePrefixScenario
from vericache.sim.residency import SimResidency

if TYPE_CHECKING:
    from vericache.sim.remote_prefix_scheduled import VerifierSchedule


@dataclass(frozen=True)
class PrefixKey:
    """What a worker holds a prefix's KV under."""

    index: int  # the prefix
    is_compressed: bool
    owner: int | None = None  # without prefix caching: the session whose own copy it is


@dataclass
class SessionTurns:
    """A session's turns (one, but for sequential turns), each a request of its own that arrives
    when the one before it ends: the output tokens each may emit, and the tokens the turns before
    the current one added after the prefix (suffixes, outputs)."""

    output_lengths: tuple[int, ...]
    index: int = 0
    history_tokens: int = 0
    number: int = 0  # the session's place in the scenario's order of arrivals
    num_rounds: int = 0  # VeriCache rounds its turns have verified

    @property
    def is_last(self) -> bool:
        return self.index == len(self.output_lengths) - 1

    @property
    def num_tokens(self) -> int:
        return self.output_lengths[self.index]

    def advance(self, suffix_tokens: int, num_output_tokens: int) -> None:
        self.history_tokens += suffix_tokens + num_output_tokens
        self.index += 1


class Worker:
    """A verifier or a drafter: its device's batch loop, its inbound link, its host link and host
    tier, its KV memory."""

    def __init__(
        self,
        run: Run,
        name: str,
        inbound_bytes_per_s: float,
        latency_s: float,
        prefix_budget_bytes: int | None,
        receive_bytes_per_s: float | None = None,
        resident_bytes: int | None = None,
    ):
        scenario = run.scenario
        # Each device of a tensor-parallel group moves its share over its own links at once.
        inbound_bytes_per_s *= scenario.tensor_parallel
        self.run = run
        self.name = name  # what placement ranks it by, as the server's worker names
        self.loop = SimBatchLoop(Device(run.sim, name), self._forward_s)
        self.link = Link(run.sim, f"{name}-in", inbound_bytes_per_s, latency_s)
        host_bytes_per_s = scenario.device.host_to_device_bytes_per_s * scenario.tensor_parallel
        self.host_link = Link(run.sim, f"{name}-host", host_bytes_per_s)
        self.num_requests = 0  # in flight here, admitted or waiting for memory
        self.num_local_sessions = 0  # of them, VeriCache sessions it verifies (a warm node)
        self.compute_bound_s = 0.0  # forwards whose flops take longer than their bytes
        self.memory_bound_s = 0.0
        tier_bytes = scenario.host_tier_bytes
        self.host_tier = HostTier(tier_bytes) if tier_bytes is not None else None
        self._streaming: set[PrefixKey] = set()  # full KV on its way into the host tier
        # A verifier's residency keeps its budget apart from the prefixes, as the served one.
        room = scenario.kv_room_bytes - (resident_bytes or 0)
        inbound = (
            self.link
            if receive_bytes_per_s is None
            else ReceivedLink(self, name, receive_bytes_per_s)
        )
        # Where its device gets a prefix it lacks, and when one would land. With neither a host
        # tier nor recomputing, the link is the only way: its memory sends over it itself, and
        # the report counts no source.
        holds_up = (lambda: self.loop.num_jobs) if run.weighs_recompute else None
        self.fetches = TieredFetch(
            self.link, self.host_link, self.host_tier, PrefixPrefill(self), inbound.send, holds_up
        )
        has_choice = self.host_tier is not None or scenario.recompute_prefixes
        self.memory = WorkerMemory(
            room, inbound, scenario.prefix_caching, prefix_budget_bytes,
            source=self.fetches if has_choice else None, clock=lambda: run.sim.now,
        )  # fmt: skip
        # A verifier's sessions' own full KV, where it keeps VeriCache's residency.
        self.residency = None if resident_bytes is None else SimResidency(resident_bytes)
        self.schedule: VerifierSchedule | None = None  # a verifier's, with scheduled rounds

    def _forward_s(self, rows: list[Row]) -> float:
        cost = self.run.scenario.forward_cost(rows)
        seconds = cost.seconds * self.run.co_runner_slowdown(self) + self.run.host_work_s(self)
        if cost.is_compute_bound:
            self.compute_bound_s += seconds
        else:
            self.memory_bound_s += seconds
        return seconds

    @property
    def is_computing(self) -> bool:
        """Whether its device has forwards to run: running one, or jobs between two."""
        return self.loop.num_jobs > 0 or self.loop.device.is_busy

    def tier_holds_full(self, prefix: int) -> bool:
        """Whether its host tier holds the prefix's full KV."""
        return self.host_tier is not None and self.host_tier.holds(PrefixKey(prefix, False))

    def is_warm(self, prefix: int) -> bool:
        """Whether it verifies its sessions on the prefix itself: warm nodes, the prefix's full KV
        in its host tier."""
        return self.run.scenario.warm_nodes and self.tier_holds_full(prefix)

    def stream_full(self, key: PrefixKey, nbytes: int) -> None:
        """Streams the prefix's full KV over its link into its host tier, in the background,
        unless the tier holds it or it is on its way."""
        tier = self.host_tier
        if (
            tier is None
            or tier.holds(key)
            or key in self._streaming
            or nbytes > tier.capacity_bytes
        ):
            return
        self._streaming.add(key)

        def arrived() -> None:
            self._streaming.discard(key)
            tier.put(key, nbytes)
            self.run.report.num_warm_streams += 1

        self.link.send(nbytes, arrived, background=True)

    @property
    def kv_bytes(self) -> int:
        """The KV it holds now: its sessions' and prefixes', and the own full KV its residency
        holds or else the full KV its scheduler planned."""
        if self.residency is not None:
            return self.memory.used_bytes + self.residency.held_bytes
        planned = self.schedule.kv_bytes if self.schedule is not None else 0
        return self.memory.used_bytes + planned

    @property
    def peak_kv_bytes(self) -> int:
        """The most KV it held: its sessions' and prefixes', with (at most: each at its own peak)
        the own full KV its residency held, or else the full KV its scheduler planned."""
        if self.residency is not None:
            return self.memory.peak_bytes + self.residency.peak_bytes
        planned = self.schedule.peak_kv_bytes if self.schedule is not None else 0
        return max(self.memory.peak_bytes, planned)


class Turn(Protocol):
    """A request: one turn of a session."""

    prefix: int
    turns: SessionTurns
    seq: SimSequence
    arrival_s: float  # its session's: a session's latency runs from it to its last token


Start = Callable[["Run", int, SessionTurns, float], None]
# Below this share of the run's time busy, no resource binds: the arrivals do.
BINDING_SHARE = 0.5


class Run:
    def __init__(self, scenario: RemotePrefixScenario, weighs_recompute: bool = False):
        self.scenario = scenario
        # Whether its workers weigh a prefix's recompute for the jobs it holds up (`mode: auto`).
        self.weighs_recompute = weighs_recompute
        self.sim = Simulation()
        self.rng = random.Random(scenario.seed + 1)
        self.verifiers = [
            Worker(
                self, f"verifier-{i}", scenario.store_bytes_per_s, 0.0,
                scenario.verifier_prefix_cache_bytes,
                resident_bytes=scenario.verifier_resident_bytes,
            )
            for i in range(scenario.num_verifiers)
        ]  # fmt: skip
        self.drafters = [
            Worker(
                self, f"drafter-{i}", scenario.network_bytes_per_s, scenario.network_latency_s,
                scenario.drafter_prefix_cache_bytes, scenario.network_receive_bytes_per_s,
            )
            for i in range(scenario.num_drafters)
        ]  # fmt: skip
        self.report = SimReport(sources=(scenario.device.source, scenario.acceptance.source))
        self._loop: ClosedLoop[tuple[int, SessionTurns]] | None = None  # with a concurrency
        self._untimed_forwards: dict[str, ForwardCount] = {}  # per role, the first wave's
        self._start: Start | None = None

    @property
    def workers(self) -> list[Worker]:
        return self.verifiers + self.drafters

    def serve(self, start: Start) -> SimReport:
        """Starts each session with its prefix and turns' output lengths (the same draws in every
        configuration of a scenario): at its arrival, or with a concurrency, the first that many
        at once and each of the others when one finishes (a closed loop, as a load generator
        with that many clients runs). `start` starts each of its turns."""
        self._start = start
        jobs = sessions(self.scenario)
        if self.scenario.concurrency is None:
            for number, (arrival, prefix, lengths) in enumerate(jobs):
                turns = SessionTurns(lengths, number=number)
                self.sim.at(arrival, lambda p=prefix, u=turns, t=arrival: start(self, p, u, t))
        else:
            pending = [
                (prefix, SessionTurns(lengths, number=number))
                for number, (_, prefix, lengths) in enumerate(jobs)
            ]
            self._loop = ClosedLoop(
                pending, self.scenario.concurrency, self._start_now, self.scenario.warmup_sessions
            )
            self._loop.begin()
        self.sim.run()
        if len(self.report.latencies_s) != len(jobs):
            raise InvalidRequestError(
                f"the simulation ended with {len(jobs) - len(self.report.latencies_s)} of "
                f"{len(jobs)} requests unserved: they never fit or never got their KV"
            )
        self._account()
        return self.report

    def _account(self) -> None:
        report, workers = self.report, self.workers
        report.elapsed_s = self.sim.now
        report.device_busy_s = sum(w.loop.device.busy_s for w in workers)
        report.num_forwards = sum(w.loop.num_forwards for w in workers)
        report.link_bytes = sum(w.link.bytes_delivered for w in workers)
        report.peak_kv_bytes = max(w.peak_kv_bytes for w in workers)
        report.utilization = self.utilization()
        report.timed_forwards = {
            role: count - self._untimed_forwards.get(role, ForwardCount())
            for role, count in self.forward_counts().items()
        }
        report.binds = binding(report.utilization)
        report.prefix_sources = {
            source.value: sum(w.fetches.counts[source] for w in workers) for source in Source
        }

    def forward_counts(self) -> dict[str, ForwardCount]:
        """Per role, its workers' forwards so far and the jobs they held."""
        roles = {"verifiers": self.verifiers, "drafters": self.drafters}
        return {
            role: sum((w.loop.count for w in workers), ForwardCount())
            for role, workers in roles.items()
        }

    def utilization(self) -> dict[str, dict[str, float]]:
        """Per role, each resource's busiest worker's share of the run: its inbound link (the
        store's, the network's), its host link (PCIe), its device in forwards bound by compute
        and by HBM bandwidth, and its memory's time with a session waiting for room."""
        elapsed = self.sim.now or 1.0

        def shares(workers: list[Worker], inbound: str) -> dict[str, float]:
            def most(value: Callable[[Worker], float]) -> float:
                return max(value(w) for w in workers) / elapsed

            return {
                inbound: most(lambda w: w.link.busy_s),
                "host_link": most(lambda w: w.host_link.busy_s),
                "compute": most(lambda w: w.compute_bound_s),
                "hbm_bandwidth": most(lambda w: w.memory_bound_s),
                "hbm_capacity": most(lambda w: w.memory.blocked_s),
            }

        return {
            "verifiers": shares(self.verifiers, "store_link"),
            "drafters": shares(self.drafters, "network_link"),
        }

    def accepted(self, turns: SessionTurns, num_drafts: int) -> int:
        """The drafts a round of `num_drafts` on the session accepts: its next recorded round
        where the scenario has one (no more than it drafts), else one drawn from its acceptance."""
        recorded = self.scenario.accepted_by_session
        rounds = recorded[turns.number] if turns.number < len(recorded) else ()
        turns.num_rounds += 1
        if turns.num_rounds <= len(rounds):
            return min(rounds[turns.num_rounds - 1], num_drafts)
        return self.scenario.acceptance.accepted(num_drafts, self.rng)

    def co_runner_slowdown(self, worker: Worker) -> float:
        """A forward's time on `worker` over its time alone: where the workers share one memory
        system, the device's measured slowdown beyond 1 for each other worker computing now."""
        if not self.scenario.workers_share_memory:
            return 1.0
        busy = sum(1 for other in self.workers if other is not worker and other.is_computing)
        return self.scenario.device.slowdown_beside(busy)

    def host_work_s(self, worker: Worker) -> float:
        """The serving work a forward on `worker` waits for, with it and the workers computing
        beside it (`RemotePrefixScenario.host_work_s`)."""
        busy = 1 + sum(1 for other in self.workers if other is not worker and other.is_computing)
        return self.scenario.host_work_s(busy)

    @functools.cached_property
    def prefix_prefill_s(self) -> float:
        """A full prefix's prefill alone on one worker, by the cost model."""
        rows = self.scenario.prefix_prefill_rows()
        return sum(self.scenario.forward_s([row]) for row in rows)

    @functools.cached_property
    def mean_accepted(self) -> float:
        """Drafts a round of x accepts on average, by the scenario's acceptance."""
        return self.scenario.acceptance.mean_accepted(self.scenario.draft_len)

    def sequence(self, turns: SessionTurns) -> SimSequence:
        """A turn's tokens: its prompt is the prefix, the earlier turns and its suffix."""
        prompt_tokens = self.scenario.prompt_tokens(turns.history_tokens)
        return SimSequence(prompt_tokens, turns.num_tokens, self.scenario.model.max_positions)

    def own_bytes(self, turns: SessionTurns, seq: SimSequence) -> int:
        """The exact KV a turn comes to hold: every token after the prefix, its session's
        earlier turns' too (less what its worker kept of those: turn_kv.py), and every output
        token its budget and its context allow."""
        scenario = self.scenario
        num_tokens = scenario.tokens_after_prefix(turns.history_tokens, seq.max_output_tokens)
        return num_tokens * scenario.kv_bytes_per_token

    def placement_key(self, prefix: int) -> str | None:
        """What placement ranks workers by: the prefix, or nothing where no prefix is held."""
        return f"prefix-{prefix}" if self.scenario.prefix_caching else None

    def prefix_key(self, prefix: int, request: object, compressed: bool) -> PrefixKey:
        """What a session's prefix is held under: the prefix, shared, or without prefix caching
        a copy of the session's own."""
        owner = None if self.scenario.prefix_caching else id(request)
        return PrefixKey(prefix, compressed, owner)

    def choose(self, workers: list[Worker], prefix: int, prefer: Worker | None = None) -> Worker:
        """The worker the server would place the request on (scheduler/placement.py): a node
        whose host tier holds the prefix's full KV (or `prefer`, one that holds more of the
        prompt: a full-KV turn's session's KV) first, its prefix's holder, or the least busy
        once out of balance or without a prefix."""
        candidates = [
            Candidate(
                w.name,
                w.num_requests,
                is_warm=w is prefer or w.tier_holds_full(prefix),
            )
            for w in workers
        ]
        return workers[place(self.placement_key(prefix), candidates)]

    def place(self, workers: list[Worker], prefix: int, prefer: Worker | None = None) -> Worker:
        """`choose`, the request counted in flight there."""
        worker = self.choose(workers, prefix, prefer)
        worker.num_requests += 1
        return worker

    def emit(self, num_tokens: int) -> None:
        self.report.num_output_tokens += num_tokens
        workers = self.workers
        link_bytes = sum(w.link.bytes_moved for w in workers)
        self.report.sample(self.sim.now, link_bytes, sum(w.kv_bytes for w in workers))

    def finish(self, request: Turn, *workers: Worker) -> None:
        """A request ended: no longer in flight on `workers`. Its session's next turn arrives now,
        a request of its own, started (its path chosen, its workers placed) as any other; or its
        session ended."""
        for worker in workers:
            worker.num_requests -= 1
        turns = request.turns
        if not turns.is_last:
            turns.advance(self.scenario.suffix_tokens, request.seq.num_output_tokens)
            prefix, arrival_s = request.prefix, request.arrival_s
            self.sim.at(self.sim.now, lambda: self._start(self, prefix, turns, arrival_s))
            return
        self.report.latencies_s.append(self.sim.now - request.arrival_s)
        if self._loop is not None and self._loop.ended():  # the untimed wave's last
            self.report.timed_from_s = self.sim.now
            self.report.untimed_tokens = self.report.num_output_tokens
            self._untimed_forwards = self.forward_counts()

    def _start_now(self, session: tuple[int, SessionTurns]) -> None:
        prefix, turns = session
        now = self.sim.now
        self.sim.at(now, lambda: self._start(self, prefix, turns, now))


def sessions(scenario: RemotePrefixScenario) -> list[tuple[float, int, tuple[int, ...]]]:
    """Each session's arrival, prefix and turns' output lengths: the same draws in every
    configuration of a scenario. With prefixes in turn, an untimed first wave asks the prefixes
    the sessions after it start with, as a benchmark's wave serves its stream's first requests."""
    draws = random.Random(scenario.seed)
    drawn = []
    num_prefixes, wave = scenario.num_prefixes, scenario.warmup_sessions
    for index, arrival in enumerate(sorted(scenario.arrivals)):
        turns = scenario.turns_per_session
        lengths = tuple(scenario.output_lengths.draw(draws) for _ in range(turns))
        prefix = draws.randrange(num_prefixes)  # drawn either way: the same lengths follow
        if scenario.prefixes_in_turn:
            prefix = (index if index < wave else index - wave) % num_prefixes
        drawn.append((arrival, prefix, lengths))
    return drawn


def binding(utilization: dict[str, dict[str, float]]) -> str:
    """The busiest resource and the next, as "role' resource (share)"; "arrivals" first where
    none is busy for BINDING_SHARE of the run."""
    ranked = sorted(
        (
            (share, role, name)
            for role, shares in utilization.items()
            for name, share in shares.items()
        ),
        reverse=True,
    )
    (share, role, name), (next_share, next_role, next_name) = ranked[0], ranked[1]
    busiest = f"{role}' {name} ({share:.0%}), then {next_role}' {next_name} ({next_share:.0%})"
    return busiest if share >= BINDING_SHARE else f"arrivals (busiest: {busiest})"
