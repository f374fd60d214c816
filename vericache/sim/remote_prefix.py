"""Pipeline 2 simulated: remote prefix caching over G_local verifiers beside the full-KV store and
G_remote drafters across a slow network, against full-KV serving on the same devices.

Every worker is a device with a batch loop (batch_loop.py): the jobs it holds share each forward.
- VERICACHE, per-request rounds (the coordinator's default): a request's drafter fetches its
  prefix's compressed KV over the network unless it holds it (an LRU in its memory beside the
  weights); its verifier loads the prefix's full KV from the store and prefills the rest of the
  prompt, and the prompt's exact KV crosses to the drafter. Then rounds back to back, each begun
  and committed by the engine's own round (decoding.py): the drafter drafts what the token budget
  and the context allow (up to x), one step each, batched with its other requests; the draft call
  crosses back (latency); the verifier verifies them and one more token in one forward, batched
  with whatever else is due; the committed tokens' exact KV crosses with the next draft call. A
  round with no drafts to make (one token left) calls the verifier alone, as the coordinator does.
- FULL_LOCAL: the verifiers decode alone over the full KV from the store.
- FULL_REMOTE: the drafters fetch full KV over the network (their LRU holds what fits) and decode.
- FULL_BOTH: every device serves full KV at once; a router sends each request to the pool that
  would finish it first, given the throughput each measured alone.
Scheduled rounds, each verifier's loads and verifications planned by the real scheduler within
its memory, are remote_prefix_scheduled.py's.
Assumptions, stated: with per-request rounds and in the full-KV configurations, a worker keeps
every session it serves resident (its memory holds the requests in flight, unbounded); a
compressed prefix keeps every token at `compressed_ratio` of the full bytes (quantization, KIVI);
the network link of each drafter is its own.
"""

from __future__ import annotations

import enum
import random
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vericache.errors import InvalidRequestError
from vericache.sim.batch_loop import SimBatchLoop, SimJob
from vericache.sim.cost import Row, forward_cost
from vericache.sim.decoding import SimSequence
from vericache.sim.events import Device, Link, Simulation
from vericache.sim.long_context import SimReport
from vericache.sim.profiles import DeviceProfile, ModelProfile
from vericache.sim.workload import AcceptanceTrace, OutputLengths

if TYPE_CHECKING:
    from vericache.sim.remote_prefix_scheduled import VerifierSchedule


@dataclass(frozen=True)
class RemotePrefixScenario:
    model: ModelProfile
    device: DeviceProfile  # every verifier and drafter
    num_verifiers: int
    num_drafters: int
    prefix_tokens: int
    num_prefixes: int  # each request's prefix is drawn uniformly (seeded)
    suffix_tokens: int  # the prompt after its prefix
    compressed_ratio: float  # compressed KV bytes / full KV bytes (KIVI 4-bit: about 0.27)
    store_bytes_per_s: float  # the store to each verifier
    network_bytes_per_s: float  # the store side to each drafter
    network_latency_s: float
    draft_len: int
    arrivals: tuple[float, ...]
    output_lengths: OutputLengths
    acceptance: AcceptanceTrace
    seed: int = 0

    def __post_init__(self):
        counts = (self.num_verifiers, self.num_drafters, self.prefix_tokens, self.num_prefixes)
        if min(*counts, self.suffix_tokens, self.draft_len) < 1 or not self.arrivals:
            raise InvalidRequestError("a scenario needs workers, prefixes, a suffix and requests")
        if not 0 < self.compressed_ratio <= 1 or self.network_latency_s < 0:
            raise InvalidRequestError("compressed_ratio lies in (0, 1], latency >= 0")
        if self.prefix_tokens + self.suffix_tokens >= self.model.max_positions:
            raise InvalidRequestError(
                f"a prompt of {self.prefix_tokens + self.suffix_tokens} tokens leaves no room in "
                f"{self.model.name}'s context of {self.model.max_positions}"
            )

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token()

    def prefix_bytes(self, compressed: bool) -> int:
        ratio = self.compressed_ratio if compressed else 1.0
        return int(self.prefix_tokens * self.kv_bytes_per_token * ratio)

    def row(self, num_new: int, num_after_prefix: int, compressed: bool) -> Row:
        """A row over the prefix (compressed or full) and `num_after_prefix` exact tokens."""
        context = self.prefix_tokens + num_after_prefix
        kv_bytes = self.prefix_bytes(compressed) + num_after_prefix * self.kv_bytes_per_token
        return Row(num_new, context, kv_bytes / context)

    def forward_s(self, rows: list[Row]) -> float:
        return forward_cost(self.model, self.device, rows).seconds


class Worker:
    """A verifier or a drafter: its device's batch loop, its inbound link, the prefixes it holds."""

    def __init__(self, run: Run, name: str, inbound_bytes_per_s: float, latency_s: float):
        self.loop = SimBatchLoop(Device(run.sim, name), run.scenario.forward_s)
        self.link = Link(run.sim, f"{name}-in", inbound_bytes_per_s, latency_s)
        self.num_requests = 0  # in flight here
        room = run.scenario.device.memory_bytes - run.scenario.model.weights_bytes()
        self.prefixes = PrefixCache(max(0, room))
        self.schedule: VerifierSchedule | None = None  # a verifier's, with scheduled rounds


class PrefixCache:
    """Prefixes a drafter holds, least recently used evicted first; fetches coalesce."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._held: OrderedDict[int, int] = OrderedDict()  # prefix -> bytes
        self._fetching: dict[int, list[Callable[[], None]]] = {}

    def ensure(self, prefix: int, num_bytes: int, link: Link, then: Callable[[], None]) -> None:
        if prefix in self._held:
            self._held.move_to_end(prefix)
            then()
        elif prefix in self._fetching:
            self._fetching[prefix].append(then)
        else:
            self._fetching[prefix] = [then]
            link.send(num_bytes, lambda: self._arrived(prefix, num_bytes))

    def _arrived(self, prefix: int, num_bytes: int) -> None:
        self._held[prefix] = num_bytes
        while sum(self._held.values()) > self.capacity_bytes and len(self._held) > 1:
            self._held.popitem(last=False)
        for then in self._fetching.pop(prefix):
            then()


class Run:
    def __init__(self, scenario: RemotePrefixScenario):
        self.scenario = scenario
        self.sim = Simulation()
        self.rng = random.Random(scenario.seed + 1)
        self.verifiers = [
            Worker(self, f"verifier{i}", scenario.store_bytes_per_s, 0.0)
            for i in range(scenario.num_verifiers)
        ]
        self.drafters = [
            Worker(self, f"drafter{i}", scenario.network_bytes_per_s, scenario.network_latency_s)
            for i in range(scenario.num_drafters)
        ]
        self.report = SimReport(sources=(scenario.device.source, scenario.acceptance.source))

    def serve(self, start: Callable[[Run, int, int, float], None]) -> SimReport:
        """Starts each request at its arrival with its prefix and output length (the same draws
        in every configuration of a scenario)."""
        draws = random.Random(self.scenario.seed)
        for arrival in sorted(self.scenario.arrivals):
            num_tokens = self.scenario.output_lengths.draw(draws)
            prefix = draws.randrange(self.scenario.num_prefixes)
            self.sim.at(arrival, lambda p=prefix, n=num_tokens, t=arrival: start(self, p, n, t))
        self.sim.run()
        self.report.elapsed_s = self.sim.now
        workers = self.verifiers + self.drafters
        self.report.device_busy_s = sum(w.loop.device.busy_s for w in workers)
        self.report.num_forwards = sum(w.loop.num_forwards for w in workers)
        self.report.link_bytes = sum(w.link.bytes_delivered for w in workers)
        return self.report

    def sequence(self, num_tokens: int) -> SimSequence:
        """A request's tokens: its prompt is the prefix and the suffix."""
        scenario = self.scenario
        prompt_tokens = scenario.prefix_tokens + scenario.suffix_tokens
        return SimSequence(prompt_tokens, num_tokens, scenario.model.max_positions)

    def emit(self, num_tokens: int) -> None:
        self.report.num_output_tokens += num_tokens

    def finish(self, worker: Worker, arrival_s: float) -> None:
        worker.num_requests -= 1
        self.report.latencies_s.append(self.sim.now - arrival_s)


def _least_busy(workers: list[Worker]) -> Worker:
    worker = min(workers, key=lambda w: w.num_requests)
    worker.num_requests += 1
    return worker


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
        drafter, verifier = _least_busy(run.drafters), _least_busy(run.verifiers)
        request = cls(run, prefix, run.sequence(num_tokens), arrival_s, drafter, verifier)
        compressed = run.scenario.prefix_bytes(compressed=True)
        drafter.prefixes.ensure(prefix, compressed, drafter.link, request._open)

    def _open(self) -> None:
        scenario = self.run.scenario
        self.verifier.link.send(scenario.prefix_bytes(compressed=False), self._prefill)

    def _prefill(self) -> None:
        row = self.run.scenario.row(self.run.scenario.suffix_tokens, 0, compressed=False)
        self.verifier.loop.submit(SimJob(lambda: row, 1, self._first_token))

    def _first_token(self) -> None:
        self._committed(self.seq.first_token(), exact_tokens=self.run.scenario.suffix_tokens + 1)

    def _committed(self, num_tokens: int, exact_tokens: int) -> None:
        """Emits tokens; their exact KV crosses to the drafter with the next draft call."""
        self.run.emit(num_tokens)
        if self.seq.is_finished:
            self.run.finish(self.verifier, self.arrival_s)
            self.drafter.num_requests -= 1
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
        self.verifier.loop.submit(SimJob(lambda: row, 1, self._verified))

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

    @classmethod
    def start(cls, run, prefix, num_tokens, arrival_s, pool: FullPool, rates) -> None:
        local = pool is FullPool.LOCAL or (pool is FullPool.BOTH and _route_local(run, rates))
        worker = _least_busy(run.verifiers if local else run.drafters)
        request = cls(run, run.sequence(num_tokens), arrival_s, worker)
        scenario = run.scenario
        full = scenario.prefix_bytes(compressed=False)
        if local:  # from the store, for every request
            worker.link.send(full, request._prefill)
        else:  # over the network, unless the drafter holds it
            worker.prefixes.ensure(prefix, full, worker.link, request._prefill)

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
