"""Pipeline 2's workers as the simulator runs them: a device (or tensor-parallel group) with its
batch loop, its inbound link and its KV memory (sessions and the prefixes they share); and a run,
which serves a scenario's requests over them."""

from __future__ import annotations

import random
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vericache.errors import InvalidRequestError
from vericache.sim.batch_loop import SimBatchLoop
from vericache.sim.decoding import SimSequence
from vericache.sim.events import Device, Link, Simulation
from vericache.sim.long_context import SimReport
from vericache.sim.remote_prefix_scenario import RemotePrefixScenario

if TYPE_CHECKING:
    from vericache.sim.remote_prefix_scheduled import VerifierSchedule


class Worker:
    """A verifier or a drafter: its device's batch loop, its inbound link, its KV memory."""

    def __init__(self, run: Run, name: str, inbound_bytes_per_s: float, latency_s: float):
        # Each device of a tensor-parallel group moves its share over its own link at once.
        inbound_bytes_per_s *= run.scenario.tensor_parallel
        self.loop = SimBatchLoop(Device(run.sim, name), run.scenario.forward_s)
        self.link = Link(run.sim, f"{name}-in", inbound_bytes_per_s, latency_s)
        self.num_requests = 0  # in flight here, admitted or waiting for memory
        self.memory = WorkerMemory(run.scenario.kv_room_bytes, self.link)
        self.schedule: VerifierSchedule | None = None  # a verifier's, with scheduled rounds

    @property
    def kv_bytes(self) -> int:
        """The KV it holds now: its sessions' and prefixes', and what its scheduler planned."""
        planned = self.schedule.kv_bytes if self.schedule is not None else 0
        return self.memory.used_bytes + planned

    @property
    def peak_kv_bytes(self) -> int:
        """The most KV it held: its sessions' and prefixes', or what its scheduler planned."""
        planned = self.schedule.peak_kv_bytes if self.schedule is not None else 0
        return max(self.memory.peak_bytes, planned)


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
        self.report.peak_kv_bytes = max(w.peak_kv_bytes for w in workers)
        return self.report

    def sequence(self, num_tokens: int) -> SimSequence:
        """A request's tokens: its prompt is the prefix and the suffix."""
        scenario = self.scenario
        prompt_tokens = scenario.prefix_tokens + scenario.suffix_tokens
        return SimSequence(prompt_tokens, num_tokens, scenario.model.max_positions)

    def emit(self, num_tokens: int) -> None:
        self.report.num_output_tokens += num_tokens
        workers = self.verifiers + self.drafters
        link_bytes = sum(w.link.bytes_moved for w in workers)
        self.report.sample(self.sim.now, link_bytes, sum(w.kv_bytes for w in workers))

    def finish(self, worker: Worker, arrival_s: float) -> None:
        worker.num_requests -= 1
        self.report.latencies_s.append(self.sim.now - arrival_s)


def least_busy(workers: list[Worker]) -> Worker:
    worker = min(workers, key=lambda w: w.num_requests)
    worker.num_requests += 1
    return worker


@dataclass(frozen=True)
class Session:
    """What a session holds on a worker: a prefix, shared, and KV of its own."""

    prefix: int | None  # None: none to share (its own bytes hold all it needs)
    prefix_bytes: int
    own_bytes: int  # its suffix and output, and its own copy of anything it does not share


class WorkerMemory:
    """A worker's KV memory as a paged server manages it (vLLM's and SGLang's prefix caching): a
    prefix is held once and shared by the sessions over it, held on after the last of them ends
    (least recently used evicted first when room is needed), and fetched once however many
    sessions wait for it. A session is admitted when its own KV and its prefix, unless held,
    fit beside what is referenced, first come first served (no one overtakes a waiting session);
    its `then` runs once its prefix has arrived."""

    def __init__(self, capacity_bytes: int, link: Link):
        self.capacity_bytes = capacity_bytes
        self.link = link
        self.peak_bytes = 0
        self._own_bytes = 0  # of admitted sessions
        self._held: OrderedDict[int, int] = OrderedDict()  # prefix -> bytes, arrived or fetching
        self._refs: dict[int, int] = {}  # prefix -> sessions admitted over it
        self._fetching: dict[int, list[Callable[[], None]]] = {}
        self._waiting: deque[tuple[Session, Callable[[], None]]] = deque()

    @property
    def used_bytes(self) -> int:
        return self._own_bytes + sum(self._held.values())

    def admit(self, session: Session, then: Callable[[], None]) -> None:
        if session.own_bytes + session.prefix_bytes > self.capacity_bytes:
            raise InvalidRequestError(
                f"a session needs {session.own_bytes + session.prefix_bytes} bytes of KV, more "
                f"than a worker's {self.capacity_bytes}: raise tensor_parallel or shorten it"
            )
        self._waiting.append((session, then))
        self._admit_waiting()

    def release(self, session: Session) -> None:
        self._own_bytes -= session.own_bytes
        if session.prefix is not None:
            self._refs[session.prefix] -= 1
        self._admit_waiting()

    def holds(self, prefix: int) -> bool:
        return prefix in self._held and prefix not in self._fetching

    def _admit_waiting(self) -> None:
        while self._waiting and self._make_room(self._waiting[0][0]):
            session, then = self._waiting.popleft()
            self._own_bytes += session.own_bytes
            if session.prefix is None:
                then()
            else:
                self._refs[session.prefix] = self._refs.get(session.prefix, 0) + 1
                self._ensure(session, then)
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    def _make_room(self, session: Session) -> bool:
        """Evicts unreferenced prefixes, least recent first, until the session fits; whether it
        does."""
        needed = session.own_bytes
        if session.prefix is not None and session.prefix not in self._held:
            needed += session.prefix_bytes
        for prefix in list(self._held):
            if self.used_bytes + needed <= self.capacity_bytes:
                break
            if not self._refs.get(prefix) and prefix != session.prefix:
                del self._held[prefix]
        return self.used_bytes + needed <= self.capacity_bytes

    def _ensure(self, session: Session, then: Callable[[], None]) -> None:
        prefix = session.prefix
        if prefix in self._fetching:
            self._fetching[prefix].append(then)
        elif prefix in self._held:
            self._held.move_to_end(prefix)
            then()
        else:
            self._held[prefix] = session.prefix_bytes
            self._fetching[prefix] = [then]
            self.link.send(session.prefix_bytes, lambda: self._arrived(prefix))

    def _arrived(self, prefix: int) -> None:
        for then in self._fetching.pop(prefix):
            then()
