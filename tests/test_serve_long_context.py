"""The long-context server (one process, no Ray) through gRPC on loopback: VERICACHE equals
FULL_LOCAL, requests of both modes at once, every refusal with its status code and the server
serving on, cancellation, a full queue, and `vericache serve --long-context`."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import urllib.request

import grpc
import pytest

from tests.serve_fixtures import CONTEXT, wait_for
from tests.test_serve_errors import LONG_PROMPT, _code
from vericache.client import Client
from vericache.client.errors import ServerBusyError
from vericache.engine.long_context_config import LongContextConfig
from vericache.errors import InvalidRequestError
from vericache.model.loader import load_model
from vericache.serve.config import CoordinatorConfig, WorkerConfig
from vericache.serve.launch.long_context import long_context_server
from vericache.serve.launch.server import BackgroundServer
from vericache.v1 import vericache_pb2 as pb
from vericache.v1 import vericache_pb2_grpc

PROMPT = "Which function multiplies by three?"
FAST_LINK = LongContextConfig(link_bytes_per_s=1e10, iteration_s=1e-3)


def start(model, config: CoordinatorConfig | None = None, **long_context) -> BackgroundServer:
    settings = LongContextConfig(**{**vars(FAST_LINK), **long_context})
    return long_context_server(WorkerConfig(model=str(model)), settings, config=config)


@pytest.fixture(scope="module")
def server(tiny_chat_checkpoint):
    with start(tiny_chat_checkpoint) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with Client(server.target, timeout=120) as connected:
        yield connected


def engine_requests(server: BackgroundServer) -> int:
    return server.coordinator.backend.engine_loop.num_requests


@pytest.mark.parametrize(
    ("name", "strength"), [("streamingllm", {"ratio": 4}), ("kivi", {"bits": 2})]
)
def test_vericache_equals_full_local(client, name, strength):
    prefix_id = client.put_prefix(CONTEXT, compressor=name, **strength)
    full = client.generate(PROMPT, prefix_id=prefix_id, mode="full_local", max_tokens=40)
    with client.stream(
        PROMPT, prefix_id=prefix_id, mode="vericache", max_tokens=40, draft_len=4
    ) as stream:
        deltas = list(stream)
        vericache = stream.result()
    assert len(full.token_ids) == 40 and full.finish_reason == "length"
    assert vericache.token_ids == full.token_ids and vericache.text == full.text
    assert len(deltas) > 1 and "".join(deltas) == vericache.text  # streamed as it is verified
    stats = vericache.stats
    assert 1 <= stats["rounds"] < 40 and len(stats["accepted_per_round"]) == stats["rounds"]
    assert stats["ttft_s"] > 0 and stats["link_bytes"] == 0


def test_sampled_vericache_equals_sampled_full_local(client):
    """One seed for the coordinator and the engine: the reported seed is the one sampled with,
    and a seed drawn by the server repeats its output when passed back."""
    prefix_id = client.put_prefix(CONTEXT, compressor="streamingllm", ratio=4)
    sampling = {"temperature": 0.8, "top_p": 0.9, "max_tokens": 32}
    full = client.generate(PROMPT, prefix_id=prefix_id, mode="full_local", seed=4, **sampling)
    vericache = client.generate(
        PROMPT, prefix_id=prefix_id, mode="vericache", draft_len=4, seed=4, **sampling
    )
    assert vericache.token_ids == full.token_ids and vericache.stats["seed"] == 4
    drawn = client.generate(PROMPT, prefix_id=prefix_id, mode="vericache", draft_len=4, **sampling)
    seed = drawn.stats["seed"]
    again = client.generate(PROMPT, prefix_id=prefix_id, mode="full_local", seed=seed, **sampling)
    assert again.token_ids == drawn.token_ids


def test_stop_strings_end_both_modes_at_the_same_place(client):
    prefix_id = client.put_prefix(CONTEXT, compressor="streamingllm", ratio=4)
    reference = client.generate(PROMPT, prefix_id=prefix_id, mode="full_local", max_tokens=40)
    stop = reference.text[10:14]
    assert stop.strip(), reference.text
    ends = [
        client.generate(PROMPT, prefix_id=prefix_id, mode=mode, max_tokens=40, stop=[stop])
        for mode in ("full_local", "vericache")
    ]
    for result in ends:
        assert result.finish_reason == "stop" and stop not in result.text
    assert ends[0].token_ids == ends[1].token_ids and ends[0].text == ends[1].text


def test_prefixes_are_records_in_memory(client):
    stages = []
    prefix_id = client.put_prefix(
        CONTEXT + "# v2\n", compressor="snapkv", ratio=4, on_progress=stages.append
    )
    assert [p.stage for p in stages] == ["queued", "done"] and not stages[-1].existed
    assert client.put_prefix(CONTEXT + "# v2\n", compressor="snapkv", ratio=4) == prefix_id
    info = client.get_prefix(prefix_id)
    assert info.compressor.name == "snapkv" and info.num_tokens > 100
    assert info.full_kv_bytes > 0 and info.compressed_kv_bytes == 0  # made per request
    assert prefix_id in {p.prefix_id for p in client.list_prefixes()}
    assert client.delete_prefix(prefix_id) and not client.delete_prefix(prefix_id)
    assert prefix_id not in {p.prefix_id for p in client.list_prefixes()}


def test_concurrent_requests_of_both_modes_all_finish_exact(client, server):
    prefixes = [
        client.put_prefix(CONTEXT, compressor="streamingllm", ratio=4),
        client.put_prefix(CONTEXT + "# other\n", compressor="kivi", bits=4),
    ]
    jobs = [(p, prompt) for p in prefixes for prompt in (PROMPT, "Explain scale_3.")]
    # The modes alternate: each full_local request waits for the vericache ones before it.
    runs = [(job, mode) for job in jobs for mode in ("vericache", "full_local")]

    def run(job_mode):
        (prefix_id, prompt), mode = job_mode
        return client.generate(prompt, prefix_id=prefix_id, mode=mode, max_tokens=24).token_ids

    with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
        together = list(pool.map(run, runs))
    alone = [run((job, "full_local")) for job, _ in runs]
    assert together == alone
    assert wait_for(lambda: engine_requests(server) == 0)


def test_bad_requests_are_refused_and_the_server_serves_on(client, server):
    prefix_id = client.put_prefix(CONTEXT, compressor="streamingllm", ratio=4)
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    with grpc.insecure_channel(server.target) as channel:
        stub = vericache_pb2_grpc.VeriCacheStub(channel)

        def generate(**fields):
            message = pb.GenerateRequest(max_tokens=4, **{"prompt": "hi", **fields})
            return lambda: stub.Generate(message, timeout=30)

        for mode in (pb.LOSSY, pb.FULL_REMOTE):  # they need drafters
            assert _code(generate(prefix_id=prefix_id, mode=mode)) == invalid
        assert _code(generate(mode=pb.VERICACHE)) == invalid  # no prefix, no compressor
        assert _code(generate(prefix_id=prefix_id, draft_len=0)) == invalid
        assert _code(generate(prompt=LONG_PROMPT, mode=pb.FULL_LOCAL)) == invalid
        assert _code(generate(prefix_id="pfx-" + "0" * 32)) == grpc.StatusCode.NOT_FOUND
    for draft_len in (3, 128):  # 128: the longest allowed, past the scheduler's window
        result = client.generate(
            PROMPT, prefix_id=prefix_id, mode="vericache", max_tokens=6, draft_len=draft_len
        )
        assert len(result.token_ids) == 6


def test_a_cancelled_stream_leaves_the_engine(client, server):
    prefix_id = client.put_prefix(CONTEXT, compressor="streamingllm", ratio=4)
    stream = client.stream(
        "Go on.", prefix_id=prefix_id, mode="vericache", max_tokens=300, draft_len=2
    )
    next(iter(stream))
    assert engine_requests(server) == 1
    stream.close()
    # Aborted in the engine between iterations, long before its 300 tokens.
    assert wait_for(lambda: engine_requests(server) == 0, timeout_s=10)
    result = client.generate("hi", prefix_id=prefix_id, mode="vericache", max_tokens=6)
    assert len(result.token_ids) == 6


def test_a_budget_too_small_is_an_invalid_argument(tiny_chat_checkpoint):
    weights_bytes = load_model(str(tiny_chat_checkpoint)).weights.nbytes
    with start(tiny_chat_checkpoint, memory_budget_bytes=weights_bytes + 4096) as server:
        with Client(server.target, timeout=60) as client:
            prefix_id = client.put_prefix(CONTEXT, compressor="streamingllm", ratio=4)
            for mode in ("vericache", "full_local"):
                with pytest.raises(InvalidRequestError, match="device memory"):
                    client.generate(PROMPT, prefix_id=prefix_id, mode=mode, max_tokens=4)
            assert [p.prefix_id for p in client.list_prefixes()] == [prefix_id]


def test_a_full_server_refuses_with_resource_exhausted(tiny_chat_checkpoint):
    config = CoordinatorConfig(max_running=1, max_waiting=0)
    with start(tiny_chat_checkpoint, config) as server:
        with Client(server.target, timeout=60) as client:
            with client.stream("Count.", mode="full_local", max_tokens=300) as busy:
                next(iter(busy))  # running: the only slot is taken
                with pytest.raises(ServerBusyError):
                    client.generate("hi", mode="full_local", max_tokens=4)
            assert wait_for(lambda: engine_requests(server) == 0, timeout_s=120)
            assert len(client.generate("hi", mode="full_local", max_tokens=4).token_ids) == 4


def test_vericache_serve_long_context(tiny_chat_checkpoint):
    argv = [sys.executable, "-m", "vericache.cli.main", "serve", "--long-context"]
    argv += ["--model", str(tiny_chat_checkpoint), "--port", "0", "--pcie-bandwidth", "10GB/s"]
    argv += ["--insecure-no-auth", "--metrics-port", "0", "--http-port", "0"]
    argv += ["--served-model-name", "tiny", "--auto-prefix-min-tokens", "20"]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        lines = iter(process.stdout.readline, "")
        serving = next(line for line in lines if line.startswith("VeriCache serving on"))
        target = serving.split()[-1]
        api_url = next(line for line in lines if line.startswith("OpenAI API on")).split()[-1]
        metrics_url = next(line for line in lines if line.startswith("Metrics on")).split()[-1]
        with Client(target, timeout=60) as client:
            prefix_id = client.put_prefix(CONTEXT, compressor="streamingllm", ratio=4)
            full = client.generate(PROMPT, prefix_id=prefix_id, mode="full_local", max_tokens=12)
            exact = client.generate(
                PROMPT, prefix_id=prefix_id, mode="vericache", max_tokens=12, draft_len=3
            )
            _a_system_turn_sent_twice_registers_itself(api_url, client)
        assert exact.token_ids == full.token_ids
        with urllib.request.urlopen(metrics_url, timeout=10) as response:
            scraped = response.read().decode()
        assert 'vericache:request_success_total{finished_reason="length"' in scraped
        drafts = next(
            line
            for line in scraped.splitlines()
            if line.startswith("vericache:spec_decode_num_drafts_total")
        )
        assert float(drafts.split()[-1]) > 0  # the vericache request's rounds
        memory = next(
            line
            for line in scraped.splitlines()
            if line.startswith("vericache:device_memory_bytes")
        )
        assert float(memory.split()[-1]) > 0  # the weights at least
        verify_batches = next(
            line
            for line in scraped.splitlines()
            if line.startswith("vericache:scheduler_verify_batch_size_sum")
        )
        assert float(verify_batches.split()[-1]) > 0  # the scheduler's iterations, metered
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0


def _a_system_turn_sent_twice_registers_itself(api_url: str, client: Client) -> None:
    """--http-port serves the chat API, and --auto-prefix-min-tokens registers a system turn
    that long the second time it is sent."""
    import httpx

    system = CONTEXT.replace("values", "items")  # matches no registered prefix
    body = {
        "model": "tiny", "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": PROMPT}],
    }  # fmt: skip
    for _ in range(2):
        reply = httpx.post(f"{api_url}/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
    assert wait_for(lambda: any(info.automatic for info in client.list_prefixes()), 60)


def test_the_openai_http_api_serves_a_long_context_server(tiny_chat_checkpoint):
    import httpx

    from vericache.serve.launch.server import HttpSettings

    settings = LongContextConfig(**vars(FAST_LINK))
    worker = WorkerConfig(model=str(tiny_chat_checkpoint))
    with long_context_server(worker, settings, http=HttpSettings(0, "tiny")) as server:
        with Client(server.target, timeout=120) as client:
            prefix_id = client.put_prefix(CONTEXT, compressor="streamingllm", ratio=4)
            reference = client.generate(
                PROMPT, prefix_id=prefix_id, mode="full_local", max_tokens=12
            )
        messages = [
            {"role": "system", "content": CONTEXT}, {"role": "user", "content": PROMPT}
        ]  # fmt: skip
        body = {
            "model": "tiny", "max_tokens": 12, "temperature": 0, "messages": messages,
            "vericache": {"prefix_id": prefix_id, "draft_len": 4},
        }  # fmt: skip
        url = f"http://{server.host}:{server.http_port}"
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
        assert reply["choices"][0]["message"]["content"] == reference.text
        assert reply["vericache"]["rounds"] >= 1
        assert httpx.get(f"{url}/health").status_code == 200
        # An engine that could not restart: unhealthy, and requests refused without saying why.
        engine_loop = server.coordinator.backend.engine_loop
        engine_loop._broken = RuntimeError("CUDA error at /dev/nvidia0")
        try:
            assert httpx.get(f"{url}/health").status_code == 503
            refused = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
            assert refused.status_code == 503 and "nvidia" not in refused.text
        finally:
            engine_loop._broken = None
