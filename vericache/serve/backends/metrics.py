"""Prometheus metrics of a VeriCache server, named like vLLM's so that existing dashboards work.

Every name is in the `vericache:` namespace where vLLM uses `vllm:`
(`vericache:num_requests_running` for `vllm:num_requests_running`,
`vericache:spec_decode_num_accepted_tokens_per_pos` for
`vllm:spec_decode_num_accepted_tokens_per_pos`, ...), with a `model_name` label as vLLM has; the
slow link, the full-KV store and device memory, which vLLM has no names for, follow the same
style. A server owns one `ServeMetrics` (its own registry, so that several servers can run in one
process), records events into it, and serves it over HTTP (`start_http`) for Prometheus to scrape.
`summary_line()` gives the periodic one-line log: tokens/s and accepted per round since the last.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)

from vericache.kv.shared_prefix import PrefixCacheStats
from vericache.serve.api_types import OutputChunk
from vericache.serve.store.catalog import StoredKind

log = logging.getLogger(__name__)
NAMESPACE = "vericache"
# Seconds; as vLLM's buckets for these histograms, from a few ms to minutes.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)  # fmt: skip
BATCH_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)
SHARE_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
# A worker's prefix cache, per worker (`ServeMetrics.prefix_cache_reported`): name -> (help, its
# value in the worker's PrefixCacheStats).
PREFIX_CACHE_GAUGES = {
    "budget_bytes": ("Bytes the worker may hold prefixes' KV in.", lambda s: s.budget_bytes),
    "resident_prefixes": (
        "Prefixes whose KV the worker holds, one copy each.",
        lambda s: s.num_prefixes,
    ),
    "resident_bytes": ("Bytes of the prefixes' KV the worker holds.", lambda s: s.resident_bytes),
    "sessions": (
        "Sessions reading the worker's copies of prefixes.",
        lambda s: sum(s.sessions_per_prefix),
    ),
    "max_sessions_per_prefix": (
        "Sessions reading the worker's most read prefix.",
        lambda s: max(s.sessions_per_prefix, default=0),
    ),
    "loads": (
        "Prefixes the worker loaded (a store read or a fetch) since it started.",
        lambda s: s.num_loads,
    ),
    "unshared_loads": (
        "Of those, loaded for one session alone: pins left no room.",
        lambda s: s.num_unshared,
    ),
}
# A request's store or link bytes: 0 (all held already), then 1 MB to 64 GB.
BYTES_BUCKETS = (0, *(4.0**k * 1e6 for k in range(9)))
RESTART_BUCKETS = (1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 300.0, 600.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


@dataclass
class _Totals:
    """Counter values at the last summary line."""

    at: float
    generation_tokens: float = 0.0
    drafts: float = 0.0
    accepted_tokens: float = 0.0


class ServeMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._running = self._gauge("num_requests_running", "Requests decoding now.")
        self._waiting = self._gauge("num_requests_waiting", "Requests queued for admission.")
        self._prompt_tokens = self._counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self._generation_tokens = self._counter("generation_tokens", "Output tokens generated.")
        self._success = self._counter(
            "request_success", "Finished requests, by finish reason.", ("finished_reason",)
        )
        self._failure = self._counter(
            "request_failure", "Calls that failed, by gRPC status code.", ("code",)
        )
        self._migrations = self._counter(
            "request_migrations", "Times requests went on elsewhere after a worker died."
        )
        self._restarts = Histogram(
            _name("worker_restart_seconds"),
            "Seconds from a worker found gone to its new process answering (a restarted actor).",
            ("model_name", "kind"), registry=self.registry, buckets=RESTART_BUCKETS,
        )  # fmt: skip
        for kind in ("verifier", "drafter"):  # every series from the start, at 0
            self._restarts.labels(self.model_name, kind)
        self._ttft = self._histogram(
            "time_to_first_token_seconds", "Time to the first output token.", TTFT_BUCKETS
        )
        self._itl = self._histogram(
            "inter_token_latency_seconds", "Time between streamed output tokens.", ITL_BUCKETS
        )
        self._e2e = self._histogram(
            "e2e_request_latency_seconds", "Time from arrival to the last token.", E2E_BUCKETS
        )
        self._drafts = self._counter("spec_decode_num_drafts", "Draft rounds verified.")
        self._round_calls = self._counter(
            "round_worker_calls",
            "Worker calls of VERICACHE rounds (draft and verify), per request taking part.",
        )
        self._draft_tokens = self._counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self._accepted = self._counter(
            "spec_decode_num_accepted_tokens", "Draft tokens the verifier accepted."
        )
        self._accepted_per_pos = self._counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by their position in the draft.",
            ("position",),
        )
        # Automatic prefix caching, in tokens, as vLLM counts it.
        self._prefix_queries = self._counter(
            "prefix_cache_queries", "Prompt tokens looked up among the tenant's prefixes."
        )
        self._prefix_hits = self._counter(
            "prefix_cache_hits", "Prompt tokens found in a registered prefix."
        )
        self._turn_hits = self._counter(
            "turn_cache_hits",
            "Prompt tokens after a prefix whose KV a worker kept from a finished turn.",
        )
        self._link_bytes = self._counter("link_bytes", "Bytes sent over the slow link.")
        self._link_seconds = self._counter("link_seconds", "Seconds requests waited on the link.")
        self._store = self._counter("store_lookups", "Full-KV store lookups.", ("result",))
        self._store_bytes = self._counter("store_bytes", "Bytes loaded from the full-KV store.")
        self._store_corruptions = self._counter(
            "store_corruptions", "Stored data that failed its integrity check.", ("kind",)
        )
        for kind in StoredKind:  # every series from the start, at 0
            self._store_corruptions.labels(self.model_name, kind.value)
        self._device_memory = self._gauge(
            "device_memory_bytes", "Device memory in use by the KV caches and weights."
        )
        # Scheduled rounds (scheduled.py): one observation per iteration planned.
        self._draft_batch = self._histogram(
            "scheduler_draft_batch_size", "Requests drafting in an iteration.", BATCH_BUCKETS
        )
        self._verify_batch = self._histogram(
            "scheduler_verify_batch_size", "Requests verifying in an iteration.", BATCH_BUCKETS
        )
        self._link_share = self._histogram(
            "scheduler_link_utilisation",
            "Share of an iteration's full-KV load link time that is booked.",
            SHARE_BUCKETS,
        )
        self._memory_peak = self._gauge(
            "scheduler_memory_peak_bytes",
            "High-water mark of planned device memory: weights, resident and loaded KV.",
        )
        # Per request: what it read from the store and sent over the link (Result.stats too).
        self._request_store_bytes = self._histogram(
            "request_store_bytes", "Bytes a request loaded from the full-KV store.", BYTES_BUCKETS
        )
        self._request_link_bytes = self._histogram(
            "request_link_bytes", "Bytes a request sent over the slow link.", BYTES_BUCKETS
        )
        # Per worker, as its probe last found them: its copies of prefixes' KV, which sessions
        # share (kv/shared_prefix.py).
        self._prefix_cache = {
            field: self._worker_gauge(f"prefix_cache_{field}", doc)
            for field, (doc, _) in PREFIX_CACHE_GAUGES.items()
        }
        # A warm drafter node's host tier (warm_node.py), and the rounds such nodes verified.
        self._host_tier_bytes = self._worker_gauge(
            "host_tier_resident_bytes", "Bytes of prefixes' full KV a drafter's host tier holds."
        )
        self._host_tier_prefixes = self._worker_gauge(
            "host_tier_resident_prefixes", "Prefixes a drafter's host tier holds, one copy each."
        )
        self._local_rounds = self._counter(
            "local_rounds", "VERICACHE rounds a warm drafter node verified itself."
        )
        self._kept_set_refreshes = self._counter(
            "kept_set_refreshes",
            "Refreshes of steered drafters' kept sets, by outcome: taken in, or dropped (damaged "
            "or made for another set on the way).",
            ("outcome",),
        )
        self._auto_paths = self._counter(
            "auto_paths", "Paths `mode: auto` chose for its requests.", ("path",)
        )
        self._last = _Totals(at=time.monotonic())

    # -- events ---------------------------------------------------------------------------------

    def set_queue(self, num_running: int, num_waiting: int) -> None:
        self._running.labels(self.model_name).set(num_running)
        self._waiting.labels(self.model_name).set(num_waiting)

    def request_admitted(self, num_prompt_tokens: int) -> None:
        self._prompt_tokens.labels(self.model_name).inc(num_prompt_tokens)

    def tokens_streamed(self, num_tokens: int, seconds_since_last: float, is_first: bool) -> None:
        """A chunk of output tokens reached the client `seconds_since_last` after the previous
        one (after the request's arrival, for the first). A chunk of n tokens counts n latencies
        of seconds / n, as a client reading them one by one would see."""
        if num_tokens < 1:
            return
        self._generation_tokens.labels(self.model_name).inc(num_tokens)
        if is_first:
            self._ttft.labels(self.model_name).observe(seconds_since_last)
            num_tokens, seconds_since_last = num_tokens - 1, 0.0
        for _ in range(num_tokens):
            self._itl.labels(self.model_name).observe(seconds_since_last / max(num_tokens, 1))

    def round_verified(self, num_drafted: int, num_accepted: int) -> None:
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(f"accepted {num_accepted} of {num_drafted} draft tokens")
        self._drafts.labels(self.model_name).inc()
        self._draft_tokens.labels(self.model_name).inc(num_drafted)
        self._accepted.labels(self.model_name).inc(num_accepted)
        for position in range(num_accepted):  # accepted drafts are a prefix of the draft
            self._accepted_per_pos.labels(self.model_name, str(position)).inc()

    def round_calls_made(self, num_calls: int, num_local_rounds: int = 0) -> None:
        self._round_calls.labels(self.model_name).inc(num_calls)
        self._local_rounds.labels(self.model_name).inc(num_local_rounds)

    def kept_set_refreshed(self, num_taken: int, num_dropped: int) -> None:
        self._kept_set_refreshes.labels(self.model_name, "taken").inc(num_taken)
        self._kept_set_refreshes.labels(self.model_name, "dropped").inc(num_dropped)

    def auto_path_chosen(self, path: str) -> None:
        self._auto_paths.labels(self.model_name, path).inc()

    def prefix_cache_queried(self, num_tokens: int) -> None:
        self._prefix_queries.labels(self.model_name).inc(num_tokens)

    def prefix_cache_hit(self, num_tokens: int) -> None:
        self._prefix_hits.labels(self.model_name).inc(num_tokens)

    def turn_cache_hit(self, num_tokens: int) -> None:
        self._turn_hits.labels(self.model_name).inc(num_tokens)

    def request_finished(self, finish_reason: str, e2e_s: float) -> None:
        self._success.labels(self.model_name, finish_reason).inc()
        self._e2e.labels(self.model_name).observe(e2e_s)

    def request_failed(self, code: str) -> None:
        self._failure.labels(self.model_name, code).inc()

    def requests_migrated(self, count: int) -> None:
        self._migrations.labels(self.model_name).inc(count)

    def worker_restarted(self, kind: str, seconds: float) -> None:
        """A worker of `kind` ("verifier" or "drafter") answers again `seconds` after a call or
        probe found it gone."""
        self._restarts.labels(self.model_name, kind).observe(seconds)

    def link_used(self, num_bytes: int, wait_s: float) -> None:
        self._link_bytes.labels(self.model_name).inc(num_bytes)
        self._link_seconds.labels(self.model_name).inc(wait_s)

    def store_lookup(self, hit: bool, num_bytes: int = 0) -> None:
        self._store.labels(self.model_name, "hit" if hit else "miss").inc()
        self._store_bytes.labels(self.model_name).inc(num_bytes)

    def store_corrupted(self, kind: StoredKind) -> None:
        self._store_corruptions.labels(self.model_name, kind.value).inc()

    def set_device_memory(self, num_bytes: int) -> None:
        self._device_memory.labels(self.model_name).set(num_bytes)

    def request_traffic(self, store_bytes: int, link_bytes: int) -> None:
        self._request_store_bytes.labels(self.model_name).observe(store_bytes)
        self._request_link_bytes.labels(self.model_name).observe(link_bytes)

    def prefix_cache_reported(
        self, worker: str, stats: PrefixCacheStats, host_tier: PrefixCacheStats | None = None
    ) -> None:
        """A worker's copies of prefixes' KV, and a drafter's host tier, as its probe found them."""
        for field, (_, value) in PREFIX_CACHE_GAUGES.items():
            self._prefix_cache[field].labels(self.model_name, worker).set(value(stats))
        if host_tier is not None:
            self._host_tier_bytes.labels(self.model_name, worker).set(host_tier.resident_bytes)
            self._host_tier_prefixes.labels(self.model_name, worker).set(host_tier.num_prefixes)

    def iteration_planned(self, iteration, peak_memory_bytes: int) -> None:
        """One planned iteration (`vericache.scheduler.IterationMetrics`), and the scheduler's
        device-memory high-water mark so far."""
        self._draft_batch.labels(self.model_name).observe(iteration.num_drafting)
        self._verify_batch.labels(self.model_name).observe(iteration.num_verifying)
        self._link_share.labels(self.model_name).observe(iteration.link_utilisation)
        self._memory_peak.labels(self.model_name).set(peak_memory_bytes)

    # -- output ---------------------------------------------------------------------------------

    def exposition(self) -> bytes:
        """The text format Prometheus scrapes."""
        return generate_latest(self.registry)

    def start_http(self, port: int, host: str = "127.0.0.1"):
        """Serves `/metrics` on a daemon thread; returns (server, thread) to shut it down."""
        return start_http_server(port, host, registry=self.registry)

    def summary_line(self) -> str:
        """Tokens/s and accepted per round since the previous call."""
        now = time.monotonic()
        totals = _Totals(
            at=now,
            generation_tokens=self._value("generation_tokens_total"),
            drafts=self._value("spec_decode_num_drafts_total"),
            accepted_tokens=self._value("spec_decode_num_accepted_tokens_total"),
        )
        elapsed = max(now - self._last.at, 1e-9)
        tokens = totals.generation_tokens - self._last.generation_tokens
        drafts = totals.drafts - self._last.drafts
        accepted = totals.accepted_tokens - self._last.accepted_tokens
        self._last = totals
        per_round = f"{accepted / drafts:.1f}" if drafts else "-"
        return (
            f"{tokens / elapsed:.1f} tokens/s, {per_round} accepted per round over {drafts:.0f} "
            f"rounds, {self._value('num_requests_running'):.0f} running, "
            f"{self._value('num_requests_waiting'):.0f} waiting"
        )

    # -- helpers --------------------------------------------------------------------------------

    def _value(self, sample_name: str) -> float:
        """A sample of this server's model, by its name less the namespace."""
        labels = {"model_name": self.model_name}
        return self.registry.get_sample_value(_name(sample_name), labels) or 0.0

    def _counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        counter = Counter(_name(name), doc, ("model_name", *labels), registry=self.registry)
        return self._with_series(counter) if not labels else counter

    def _gauge(self, name: str, doc: str) -> Gauge:
        return self._with_series(Gauge(_name(name), doc, ("model_name",), registry=self.registry))

    def _worker_gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(_name(name), doc, ("model_name", "worker"), registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        histogram = Histogram(
            _name(name), doc, ("model_name",), registry=self.registry, buckets=buckets
        )
        return self._with_series(histogram)

    def _with_series(self, metric):
        """A metric labelled by the model alone gets its series now, at 0, as vLLM's do: rates
        and dashboards work before the first request."""
        metric.labels(self.model_name)
        return metric


def _name(name: str) -> str:
    # vLLM's style: the namespace joined with a colon (prometheus_client's namespace= joins "_").
    return f"{NAMESPACE}:{name}"


async def metered(metrics: ServeMetrics, served, events: AsyncIterator) -> AsyncIterator:
    """Passes a served request's Generate events through
    (`vericache.serve.backends.rounds.ServedRequest`), recording it: the streamed tokens as they go
    (latencies from the request's admission), then its rounds, link and store traffic, and how it
    ended ("abort" when the stream was closed early or cancelled; a request that failed is the
    servicer's to count, by its status code), in the metrics and as one log line."""
    metrics.request_admitted(len(served.seq.request.prompt_ids))
    last, is_first = served.started_at, True
    failed = False
    try:
        async for event in events:
            if isinstance(event, OutputChunk) and event.token_ids:
                now = time.perf_counter()
                metrics.tokens_streamed(len(event.token_ids), now - last, is_first)
                last, is_first = now, False
            yield event
    except Exception:
        failed = True
        raise
    finally:
        stats = served.seq.stats
        for drafted, accepted in zip(stats.drafted_per_round, stats.accepted_per_round):
            metrics.round_verified(drafted, accepted)
        metrics.round_calls_made(served.num_round_calls, served.num_local_rounds)
        refreshes = served.kept_set_refreshes
        metrics.kept_set_refreshed(refreshes.taken, refreshes.dropped)
        metrics.requests_migrated(served.num_migrations)
        metrics.turn_cache_hit(served.reused_tokens)
        traffic = served.traffic
        metrics.link_used(traffic.link_bytes, traffic.link_s)
        metrics.request_traffic(traffic.store_bytes, traffic.link_bytes)
        if traffic.store_bytes:
            metrics.store_lookup(hit=True, num_bytes=traffic.store_bytes)
        for kind in traffic.corruptions:
            metrics.store_corrupted(kind)
            # The worker that found it logs in its own process (a Ray worker's log): the
            # server's log says it too, with the request that met it.
            log.warning(
                "a worker found stored %s failing its integrity check (never served: rebuilt, "
                "or DATA_LOSS for its prefix)", kind.value,
                extra={"request_id": served.plan.session_id, "kind": kind.value},
            )  # fmt: skip
        elapsed = time.perf_counter() - served.started_at
        finish_reason = served.seq.finish_reason or ("error" if failed else "abort")
        if not failed:
            metrics.request_finished(finish_reason, elapsed)
        _log_finished(served, finish_reason, elapsed)


def _log_finished(served, finish_reason: str, elapsed_s: float) -> None:
    stats, plan = served.seq.stats, served.plan
    params = served.seq.request.params
    accepted = stats.accepted_per_round
    mean_accepted = round(sum(accepted) / len(accepted), 2) if accepted else None
    log.info(
        "request finished",
        extra={
            "request_id": plan.session_id,
            "tenant": plan.tenant,
            "mode": plan.mode.value,
            "prefix_id": plan.prefix_id,
            "prompt_tokens": len(served.seq.request.prompt_ids),
            "output_tokens": len(served.seq.output_ids),
            "finish_reason": finish_reason,
            "temperature": params.temperature,
            "seed": served.seq.seed,
            "coupling": params.coupling if params.is_sampled else None,
            "rounds": stats.rounds,
            "mean_accepted_per_round": mean_accepted,
            "link_bytes": served.traffic.link_bytes,
            "elapsed_s": round(elapsed_s, 4),
        },
    )
