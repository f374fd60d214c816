"""Pipeline 2's workers as the simulator runs them: a device (or tensor-parallel group) with its
batch loop, its inbound link and its KV memory (sessions and the prefixes they share); and a run,
which serves a scenario's requests over them."""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

from vericache.errors import InvalidRequestError
from vericache.scheduler.placement import Candidate, place
from vericache.sim.batch_loop import SimBatchLoop
from vericache.sim.decoding import SimSequence
from vericache.sim.events import Device, Link, Simulation
from vericache.sim.kv_memory import WorkerMemory
from vericache.sim.long_context import SimReport
from vericache.sim.remote_prefix_scenario import RemotePrefixScenario
from vericache.sim.residency import SimResidency

if TYPE_CHECKING:
    from vericache.sim.remote_prefix_scheduled import VerifierSchedule


class Worker:
    """A verifier or a drafter: its device's batch loop, its inbound link, its KV memory."""

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
        # Each device of a tensor-parallel group moves its share over its own link at once.
        inbound_bytes_per_s *= run.scenario.tensor_parallel
        self.name = name  # what placement ranks it by, as the server's worker names
        self.loop = SimBatchLoop(Device(run.sim, name), run.scenario.forward_s)
        self.link = Link(run.sim, f"{name}-in", inbound_bytes_per_s, latency_s)
        self.num_requests = 0  # in flight here, admitted or waiting for memory
        caching = run.scenario.prefix_caching
        # A verifier's residency keeps its budget apart from the prefixes, as the served one.
        room = run.scenario.kv_room_bytes - (resident_bytes or 0)
        inbound = (
            self.link if receive_bytes_per_s is None else _Received(self, name, receive_bytes_per_s)
        )
        self.memory = WorkerMemory(room, inbound, caching, prefix_budget_bytes)
        # A verifier's sessions' own full KV, where it keeps VeriCache's residency.
        self.residency = None if resident_bytes is None else SimResidency(resident_bytes)
        self.schedule: VerifierSchedule | None = None  # a verifier's, with scheduled rounds

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


class _Received:
    """A worker's inbound link for prefixes whose every arrival is then taken in (decoded and
    checked) before its session can use it: by the worker's host, one prefix at a time, beside
    its device's forwards. The drafter takes a prefix in on the thread of the call that opened
    its session while its batch loop runs other sessions' forwards: on a GPU worker the host CPU
    does it, on the CPU benchmarks' worker the machine's second core. Charging it to the device
    between forwards instead predicted bench remote-prefix's FULL_REMOTE 16-19% slow; beside
    them, within 7%."""

    def __init__(self, worker: Worker, name: str, bytes_per_s: float):
        self.worker = worker
        self.host = Device(worker.loop.device.sim, f"{name}-host")
        self.bytes_per_s = bytes_per_s

    def send(self, nbytes: int, delivered: Callable[[], None]) -> None:
        def take_in() -> None:
            self.host.submit(nbytes / self.bytes_per_s, delivered)

        self.worker.link.send(nbytes, take_in)


class Run:
    def __init__(self, scenario: RemotePrefixScenario):
        self.scenario = scenario
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
        self._pending: list[tuple[int, int]] = []  # (prefix, output tokens), a closed loop's next
        self._start: Callable[[Run, int, int, float], None] | None = None

    def serve(self, start: Callable[[Run, int, int, float], None]) -> SimReport:
        """Starts each request with its prefix and output length (the same draws in every
        configuration of a scenario): at its arrival, or with a concurrency, the first that many
        at once and each of the others when one finishes (a closed loop, as a load generator
        with that many clients runs)."""
        draws = random.Random(self.scenario.seed)
        jobs = []
        num_prefixes, in_turn = self.scenario.num_prefixes, self.scenario.prefixes_in_turn
        for index, arrival in enumerate(sorted(self.scenario.arrivals)):
            num_tokens = self.scenario.output_lengths.draw(draws)
            drawn = draws.randrange(num_prefixes)  # drawn either way: the same lengths follow
            jobs.append((arrival, index % num_prefixes if in_turn else drawn, num_tokens))
        if self.scenario.concurrency is None:
            for arrival, prefix, num_tokens in jobs:
                self.sim.at(arrival, lambda p=prefix, n=num_tokens, t=arrival: start(self, p, n, t))
        else:
            self._pending = [(prefix, num_tokens) for _, prefix, num_tokens in reversed(jobs)]
            self._start = start
            for _ in range(self.scenario.concurrency):
                self._start_next()
        self.sim.run()
        if len(self.report.latencies_s) != len(jobs):
            raise InvalidRequestError(
                f"the simulation ended with {len(jobs) - len(self.report.latencies_s)} of "
                f"{len(jobs)} requests unserved: they never fit or never got their KV"
            )
        self.report.elapsed_s = self.sim.now
        workers = self.verifiers + self.drafters
        self.report.device_busy_s = sum(w.loop.device.busy_s for w in workers)
        self.report.num_forwards = sum(w.loop.num_forwards for w in workers)
        self.report.link_bytes = sum(w.link.bytes_delivered for w in workers)
        self.report.peak_kv_bytes = max(w.peak_kv_bytes for w in workers)
        return self.report

    def sequence(self, num_tokens: int) -> SimSequence:
        """A request's tokens: its prompt is the prefix and the suffix."""
        scenario = self.scenario
        prompt_tokens = scenario.prefix_tokens + scenario.suffix_tokens
        return SimSequence(prompt_tokens, num_tokens, scenario.model.max_positions)

    def placement_key(self, prefix: int) -> str | None:
        """What placement ranks workers by: the prefix, or nothing where no prefix is held."""
        return f"prefix-{prefix}" if self.scenario.prefix_caching else None

    def prefix_key(self, prefix: int, request: object) -> Hashable:
        """What a session's prefix is held under: the prefix, shared, or without prefix caching
        a copy of the session's own."""
        return prefix if self.scenario.prefix_caching else (prefix, id(request))

    def emit(self, num_tokens: int) -> None:
        self.report.num_output_tokens += num_tokens
        workers = self.verifiers + self.drafters
        link_bytes = sum(w.link.bytes_moved for w in workers)
        self.report.sample(self.sim.now, link_bytes, sum(w.kv_bytes for w in workers))

    def finish(self, worker: Worker, arrival_s: float) -> None:
        worker.num_requests -= 1
        self.report.latencies_s.append(self.sim.now - arrival_s)
        if self.scenario.concurrency is not None:
            self._start_next()

    def _start_next(self) -> None:
        if self._pending:
            prefix, num_tokens = self._pending.pop()
            now = self.sim.now
            self.sim.at(now, lambda: self._start(self, prefix, num_tokens, now))


def placed(workers: list[Worker], prefix_key: str | None) -> Worker:
    """The worker the server would place the request on (scheduler/placement.py): its prefix's
    holder, or the least busy once out of balance or without a prefix."""
    candidates = [Candidate(worker.name, worker.num_requests) for worker in workers]
    worker = workers[place(prefix_key, candidates)]
    worker.num_requests += 1
    return worker
