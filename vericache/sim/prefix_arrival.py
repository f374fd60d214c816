"""A simulated worker's ways of getting a prefix's KV other than its link alone: prefilling it
itself (where its scenario lets it recompute), and an inbound link whose arrivals its host then
takes in before a session may use them (remote_prefix_workers.py's `Worker` holds both)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from vericache.sim.batch_loop import chunked_job
from vericache.sim.events import Device

if TYPE_CHECKING:
    from vericache.sim.remote_prefix_workers import PrefixKey, Worker


class PrefixPrefill:
    """A worker's prefill of a full prefix it lacks (host_tier.Recompute), where the scenario lets
    it recompute: chunks of the prompt, batched with its device's other rows."""

    def __init__(self, worker: Worker):
        self.worker = worker

    def seconds(self, prefix: PrefixKey) -> float | None:
        if not self.worker.run.scenario.recompute_prefixes or prefix.is_compressed:
            return None
        return self.worker.run.prefix_prefill_s

    def run(self, prefix: PrefixKey, done: Callable[[], None]) -> None:
        self.worker.loop.submit(chunked_job(self.worker.run.scenario.prefix_prefill_rows(), done))


class ReceivedLink:
    """A worker's inbound link for prefixes whose every arrival is then taken in (its last
    pieces decoded and checked, its cache built) before its session can use it: by the worker's
    host, one prefix at a time, beside its device's forwards. The drafter takes a prefix in on
    the thread of the call that opened its session while its batch loop runs other sessions'
    forwards: on a GPU worker the host CPU does it, on the CPU benchmarks' worker the machine's
    second core."""

    def __init__(self, worker: Worker, name: str, bytes_per_s: float):
        self.worker = worker
        self.host = Device(worker.loop.device.sim, f"{name}-host")
        self.bytes_per_s = bytes_per_s

    def send(self, nbytes: int, delivered: Callable[[], None]) -> None:
        def take_in() -> None:
            self.host.submit(nbytes / self.bytes_per_s, delivered)

        self.worker.link.send(nbytes, take_in)
