"""What the serving benchmarks share: a local Ray instance, fresh servers on Ray workers (one thread
each: a worker stands for one GPU), a request stream served through the client SDK (with a router
when one stream feeds several modes), and the CPU seconds each kind of process spent meanwhile."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from vericache.client import Client, Result
from vericache.scheduler.placement import PoolOption, choose_pool
from vericache.serve.config import CoordinatorConfig, DrafterConfig, VerifierConfig
from vericache.serve.launch.server import HttpSettings

# (prefix id, prompt) of one request.
Job = tuple[str, str]


@contextlib.contextmanager
def ray_session(num_drafters: int):
    """A local Ray instance offering the verifier and drafter resources, unless one is running."""
    import ray

    from vericache.serve.launch.cluster import DRAFTER_RESOURCE, VERIFIER_RESOURCE

    if ray.is_initialized():
        yield
        return
    ray.init(
        num_cpus=os.cpu_count(),
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=256 << 20,
        resources={VERIFIER_RESOURCE: 1, DRAFTER_RESOURCE: num_drafters},
    )
    try:
        yield
    finally:
        ray.shutdown()


def ray_server(
    verifier: VerifierConfig,
    drafter: DrafterConfig,
    num_drafters: int,
    config: CoordinatorConfig | None = None,
    http: HttpSettings | None = None,
):
    """Fresh Ray workers, one thread each (a worker stands for a GPU), and a server over them
    (with the OpenAI-compatible HTTP API too, given `http`)."""
    from vericache.serve.launch.cluster import ray_workers
    from vericache.serve.launch.server import distributed_server

    verifier = replace(verifier, num_threads=1, transfer_host="127.0.0.1")
    drafter = replace(drafter, num_threads=1)

    def workers():
        return ray_workers(verifier, drafter, 1, num_drafters, placement_timeout_s=300)

    return distributed_server(workers, verifier.model, config=config, http=http)


@dataclass(frozen=True)
class RoutedPool:
    """A pool of full-KV workers a router sends requests to, as the router knows it."""

    mode: str  # how a request asks for it: full_local, full_remote
    tokens_per_s: float  # what it served alone
    # Prefixes its workers hold at once, as the router counts them (the least recently sent
    # out past it); None: every one (the verifiers, beside the store).
    prefix_capacity: int | None = None


class Router:
    """Sends each request to the pool that would finish it first (scheduler/placement.py
    `choose_pool`): behind the requests in flight there at the pool's measured throughput, after
    the prefix's full KV has crossed to it (`fetch_s`, by prefix id) where the pool does not hold
    it. Like a cache-aware router, it counts a prefix as held by a pool it sent it to, the least
    recently sent out past the pool's capacity."""

    def __init__(self, pools: list[RoutedPool], fetch_s: dict[str, float], num_tokens: int):
        self.pools = pools
        self.fetch_s = fetch_s
        self.num_tokens = num_tokens
        self._in_flight = dict.fromkeys((pool.mode for pool in pools), 0)
        self._held: dict[str, list[str]] = {pool.mode: [] for pool in pools}  # least recent first
        self._lock = threading.Lock()

    def acquire(self, prefix_id: str) -> str:
        with self._lock:
            options = [
                PoolOption(self._in_flight[p.mode], p.tokens_per_s, self._ready_s(p, prefix_id))
                for p in self.pools
            ]
            pool = self.pools[choose_pool(options, self.num_tokens)]
            self._in_flight[pool.mode] += 1
            if pool.prefix_capacity is not None:  # a pool that holds every prefix keeps no count
                held = self._held[pool.mode]
                if prefix_id in held:
                    held.remove(prefix_id)
                held.append(prefix_id)
                del held[: max(0, len(held) - pool.prefix_capacity)]
            return pool.mode

    def _ready_s(self, pool: RoutedPool, prefix_id: str) -> float:
        if pool.prefix_capacity is None or prefix_id in self._held[pool.mode]:
            return 0.0
        return self.fetch_s[prefix_id]

    def release(self, mode: str) -> None:
        with self._lock:
            self._in_flight[mode] -= 1


def serve_stream(
    target: str,
    jobs: list[Job],
    mode: str | Router,
    max_tokens: int,
    draft_len: int,
    concurrency: int,
    steer_every: int = 0,
):
    """Submits every request, `concurrency` at a time, in `mode` (or where `mode` routes each;
    VERICACHE's kept sets steered every `steer_every` rounds, 0: not, whatever the server's
    default): the wall time, each
    Result, the mode each ran in, and the CPU seconds spent meanwhile (`cpu_seconds` keys)."""
    router = mode if isinstance(mode, Router) else None
    with Client(target) as client:

        def one(job: Job) -> tuple[Result, str]:
            prefix_id, prompt = job
            chosen = router.acquire(prefix_id) if router else mode
            try:
                result = client.generate(
                    prompt, prefix_id=prefix_id, mode=chosen, max_tokens=max_tokens,
                    draft_len=draft_len, steer_every=steer_every,
                )  # fmt: skip
            finally:
                if router:
                    router.release(chosen)
            return result, chosen

        cpu_before = cpu_seconds()
        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            served = list(pool.map(one, jobs))
        wall_s = time.perf_counter() - start
        cpu = {key: value - cpu_before[key] for key, value in cpu_seconds().items()}
    return wall_s, [result for result, _ in served], cpu, [chosen for _, chosen in served]


def cpu_seconds() -> dict[str, float]:
    """CPU seconds so far of the drafter and verifier processes (Ray titles them after their
    class), of this process, and of the whole machine; `other` is what the rest used."""
    import psutil

    used = {"drafters": 0.0, "verifiers": 0.0}
    for process in psutil.process_iter(["cmdline", "cpu_times"]):
        title = " ".join(process.info["cmdline"] or [])
        role = "drafters" if title.startswith("ray::Drafter") else None
        role = "verifiers" if title.startswith("ray::_RayVerifier") else role
        if role is not None and process.info["cpu_times"] is not None:
            used[role] += process.info["cpu_times"].user + process.info["cpu_times"].system
    this = psutil.Process().cpu_times()
    used["this_process"] = this.user + this.system
    machine = psutil.cpu_times()
    busy = machine.user + machine.nice + machine.system + machine.irq + machine.softirq
    used["other"] = busy - sum(used.values())
    return used


def stream_record(wall_s: float, results: list[Result], cpu_s: dict | None = None) -> dict:
    """Throughput and traffic of one served stream (sums over its requests)."""
    stats = [result.stats for result in results]
    num_tokens = sum(len(result.token_ids) for result in results)
    accepted = [a for s in stats for a in s["accepted_per_round"]]
    return {
        "tokens_per_s": num_tokens / wall_s,
        "wall_s": wall_s,
        "num_tokens": num_tokens,
        "link_bytes": sum(s["link_bytes"] for s in stats),
        "store_bytes": sum(s["store_bytes"] for s in stats),
        "link_wait_s": sum(s["link_wait_s"] for s in stats),
        "store_wait_s": sum(s["store_wait_s"] for s in stats),
        "mean_ttft_s": sum(s["ttft_s"] for s in stats) / len(stats),
        "mean_latency_s": sum(s["total_s"] for s in stats) / len(stats),
        "rounds": sum(s["rounds"] for s in stats),
        "mean_accepted_per_round": sum(accepted) / len(accepted) if accepted else None,
        "accepted_per_round_by_request": [list(s["accepted_per_round"]) for s in stats],
        "cpu_s": cpu_s,
    }


def metric(server, name: str) -> float:
    """A sample of an in-process server's metrics, by its name less the namespace."""
    metrics = server.coordinator.metrics
    labels = {"model_name": metrics.model_name}
    return metrics.registry.get_sample_value(f"vericache:{name}", labels) or 0.0
