"""Server metrics: vLLM's names in the vericache namespace, values from recorded events, the
Prometheus text served over HTTP on loopback, and the periodic summary line."""

from __future__ import annotations

import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from vericache.kv.shared_prefix import PrefixCacheStats
from vericache.serve.backends.metrics import ServeMetrics

MODEL = "smollm2-135m"
# vLLM's metric names (vllm:... there) that dashboards read.
VLLM_NAMES = {
    "num_requests_running",
    "num_requests_waiting",
    "prompt_tokens",
    "generation_tokens",
    "request_success",
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
    "spec_decode_num_accepted_tokens_per_pos",
}


def samples(metrics: ServeMetrics) -> dict[tuple, float]:
    """(sample name, labels without model_name) -> value."""
    out = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for sample in family.samples:
            assert sample.labels.pop("model_name") == MODEL
            out[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return out


def test_names_mirror_vllm():
    families = {
        f.name for f in text_string_to_metric_families(ServeMetrics(MODEL).exposition().decode())
    }
    assert {f"vericache:{name}" for name in VLLM_NAMES} <= families


def test_rounds_count_drafts_and_accepted_tokens_by_position():
    metrics = ServeMetrics(MODEL)
    metrics.round_verified(8, 5)
    metrics.round_verified(4, 4)
    metrics.round_verified(3, 0)
    values = samples(metrics)
    assert values["vericache:spec_decode_num_drafts_total", ()] == 3
    assert values["vericache:spec_decode_num_draft_tokens_total", ()] == 15
    assert values["vericache:spec_decode_num_accepted_tokens_total", ()] == 9
    per_pos = "vericache:spec_decode_num_accepted_tokens_per_pos_total"
    counts = [values.get((per_pos, (("position", str(p)),)), 0) for p in range(6)]
    assert counts == [2, 2, 2, 2, 1, 0]
    with pytest.raises(ValueError):
        metrics.round_verified(2, 3)


def test_streamed_tokens_give_ttft_and_inter_token_latency():
    metrics = ServeMetrics(MODEL)
    metrics.request_admitted(120)
    metrics.tokens_streamed(3, 0.5, is_first=True)  # TTFT 0.5 s, then 2 tokens at once
    metrics.tokens_streamed(4, 0.4, is_first=False)  # 4 tokens, 0.1 s each
    metrics.request_finished("stop", 1.2)
    values = samples(metrics)
    assert values["vericache:prompt_tokens_total", ()] == 120
    assert values["vericache:generation_tokens_total", ()] == 7
    assert values["vericache:time_to_first_token_seconds_count", ()] == 1
    assert values["vericache:time_to_first_token_seconds_sum", ()] == pytest.approx(0.5)
    assert values["vericache:inter_token_latency_seconds_count", ()] == 6
    assert values["vericache:inter_token_latency_seconds_sum", ()] == pytest.approx(0.4)
    assert values["vericache:request_success_total", (("finished_reason", "stop"),)] == 1
    assert values["vericache:e2e_request_latency_seconds_sum", ()] == pytest.approx(1.2)


def test_link_store_memory_and_queue():
    metrics = ServeMetrics(MODEL)
    metrics.set_queue(num_running=3, num_waiting=2)
    metrics.link_used(1_000_000, 0.25)
    metrics.store_lookup(hit=True, num_bytes=5000)
    metrics.store_lookup(hit=False)
    metrics.set_device_memory(2 << 30)
    values = samples(metrics)
    assert values["vericache:num_requests_running", ()] == 3
    assert values["vericache:num_requests_waiting", ()] == 2
    assert values["vericache:link_bytes_total", ()] == 1_000_000
    assert values["vericache:link_seconds_total", ()] == 0.25
    assert values["vericache:store_lookups_total", (("result", "hit"),)] == 1
    assert values["vericache:store_lookups_total", (("result", "miss"),)] == 1
    assert values["vericache:store_bytes_total", ()] == 5000
    assert values["vericache:device_memory_bytes", ()] == 2 << 30


def test_two_servers_keep_their_own_metrics():
    first, second = ServeMetrics(MODEL), ServeMetrics(MODEL)
    first.round_verified(5, 5)
    assert samples(second)["vericache:spec_decode_num_drafts_total", ()] == 0


def test_metrics_served_over_http():
    metrics = ServeMetrics(MODEL)
    metrics.round_verified(6, 2)
    server, thread = metrics.start_http(port=0)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
    finally:
        server.shutdown()
        thread.join(timeout=10)
    assert 'vericache:spec_decode_num_accepted_tokens_total{model_name="smollm2-135m"} 2.0' in text


def test_summary_line_covers_the_time_since_the_last():
    metrics = ServeMetrics(MODEL)
    metrics.round_verified(10, 8)
    metrics.round_verified(10, 6)
    metrics.tokens_streamed(16, 1.0, is_first=True)
    metrics.set_queue(2, 0)
    line = metrics.summary_line()
    assert "7.0 accepted per round over 2 rounds" in line and "2 running" in line
    assert "- accepted per round over 0 rounds" in metrics.summary_line()  # nothing since


def _values(metrics: ServeMetrics) -> dict[tuple, float]:
    """(sample name, sorted labels) -> value."""
    values = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for sample in family.samples:
            values[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return values


def test_a_worker_reports_its_prefix_cache():
    metrics = ServeMetrics(MODEL)
    stats = PrefixCacheStats(4 << 30, 2, 300 << 20, (3, 0), 5, 1)
    metrics.prefix_cache_reported("verifier-0", stats)
    values = samples(metrics)
    worker = (("worker", "verifier-0"),)
    assert values["vericache:prefix_cache_budget_bytes", worker] == 4 << 30
    assert values["vericache:prefix_cache_resident_prefixes", worker] == 2
    assert values["vericache:prefix_cache_resident_bytes", worker] == 300 << 20
    assert values["vericache:prefix_cache_sessions", worker] == 3
    assert values["vericache:prefix_cache_max_sessions_per_prefix", worker] == 3
    assert values["vericache:prefix_cache_loads", worker] == 5
    assert values["vericache:prefix_cache_unshared_loads", worker] == 1


def test_a_served_request_is_metered(tiny_chat_checkpoint, tmp_path):
    from tests.serve_fixtures import CONTEXT, start_server
    from vericache.client import Client

    with start_server(tiny_chat_checkpoint, tmp_path / "store") as server:
        with Client(server.target, timeout=120) as client:
            prefix_id = client.put_prefix(CONTEXT, compressor="streamingllm", ratio=4)
            result = client.generate(
                "Go on.", prefix_id=prefix_id, mode="vericache", max_tokens=12, draft_len=4
            )
        metrics = server.coordinator.metrics
        loads = "vericache:prefix_cache_loads"
        deadline = time.monotonic() + 10
        sessions = "vericache:prefix_cache_sessions"
        while time.monotonic() < deadline:  # until a probe after the request's sessions closed
            values = _values(metrics)
            reported = {dict(k[1]).get("worker"): v for k, v in values.items() if k[0] == loads}
            reading = [v for k, v in values.items() if k[0] == sessions]
            if reported.get("verifier-0") and sum(reported.values()) == 2 and not any(reading):
                break
            time.sleep(0.1)
    # The verifier and the drafter that served the request each loaded the prefix once and hold
    # one copy, which no session reads now.
    assert reported.get("verifier-0") == 1 and sum(reported.values()) == 2, reported
    for (name, labels), value in values.items():
        worker = dict(labels).get("worker")
        if name == "vericache:prefix_cache_resident_prefixes":
            assert value == reported[worker], labels
        if name == "vericache:prefix_cache_sessions":
            assert value == 0, labels
    label = (("model_name", str(tiny_chat_checkpoint)),)
    assert values["vericache:request_link_bytes_sum", label] == result.stats["link_bytes"]
    assert values["vericache:request_store_bytes_count", label] == 1
    assert values["vericache:generation_tokens_total", label] == len(result.token_ids)
    assert values["vericache:spec_decode_num_drafts_total", label] == result.stats["rounds"]
    accepted = values["vericache:spec_decode_num_accepted_tokens_total", label]
    assert accepted == sum(result.stats["accepted_per_round"])
    assert values["vericache:time_to_first_token_seconds_count", label] == 1
    assert values["vericache:link_bytes_total", label] == result.stats["link_bytes"]
    assert values["vericache:num_requests_running", label] == 0
    finished = (("finished_reason", result.finish_reason), *label)
    assert values["vericache:request_success_total", tuple(sorted(finished))] == 1
