"""openai-load: concurrent streaming clients on the OpenAI-compatible HTTP API, on one shared system
prompt, as a load generator would drive a vLLM server.

Each configuration is served on fresh Ray workers (one verifier and one drafter, one thread each,
as the other serving benchmarks), with automatic prefix registration on
(`--auto-prefix-min-tokens`). `--clients` asyncio clients each send `--requests` streamed chat
completions (greedy, `--max-tokens`), all with the same system turn (a standard-library module's
start) and their own user turns, and name no prefix:
- `vericache`: the server's default mode set to vericache (`--default-mode`): a request whose
  system turn is a registered prefix runs VERICACHE over it (automatic prefix caching); the first
  ones miss and run FULL_LOCAL until the turn, seen twice, has registered itself;
- `full_local`: the same requests with `vericache.mode` = full_local (the baseline).

Per configuration, over `--repeats` serves: p50 and p99 time to first token, inter-chunk latency
(a chunk holds what one round committed) and time per output token, output tokens/s over the
wave, and the automatic prefix caching hit rate (tokens found over tokens looked up, the server's
vericache:prefix_cache_* counters). Summary: `vericache_over_full_local` tokens/s (median and
range), and `identical`: every request's text equal in both configurations.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import textwrap
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from vericache.bench.common import environment
from vericache.bench.serving import ray_server, ray_session
from vericache.serve.config import CoordinatorConfig, DrafterConfig, VerifierConfig
from vericache.serve.launch.server import HttpSettings

CONFIGURATIONS = ("vericache", "full_local")
MODEL_ID = "bench"
USER_TURNS = (
    "Which function here is the most useful? Say why.",
    "Write a short example that calls two of these functions.",
    "Explain the first function in one paragraph.",
    "What could go wrong when calling these? Answer briefly.",
)


def add_arguments(parser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--clients", type=int, help="concurrent streaming clients (4; quick 2)")
    parser.add_argument("--requests", type=int, help="requests per client (3; quick 2)")
    parser.add_argument("--max-tokens", type=int, help="output tokens per request (64; quick 24)")
    parser.add_argument("--repeats", type=int, help="serves per configuration (3; quick 1)")
    parser.add_argument("--context-chars", type=int, default=6000, help="of the system turn")
    parser.add_argument("--auto-prefix-min-tokens", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")


@dataclass(frozen=True)
class Streamed:
    client: int
    request: int
    text: str
    num_tokens: int
    ttft_s: float
    chunk_gaps_s: tuple[float, ...]
    total_s: float


def run(args) -> dict:
    quick = args.quick
    clients = args.clients or (2 if quick else 4)
    requests = args.requests or (2 if quick else 3)
    max_tokens = args.max_tokens or (24 if quick else 64)
    repeats = args.repeats or (1 if quick else 3)
    system = _system_turn(args.context_chars)
    samples: dict[str, list[dict]] = {name: [] for name in CONFIGURATIONS}
    texts: dict[str, dict] = {}
    with ray_session(num_drafters=1):
        for repeat in range(repeats):
            for name in CONFIGURATIONS:
                streamed, wall_s, counts = _serve(args, name, system, clients, requests, max_tokens)
                sample = _sample(streamed, wall_s, counts)
                samples[name].append(sample)
                for one in streamed:
                    texts.setdefault(name, {})[repeat, one.client, one.request] = one.text
                rate = sample["tokens_per_s"]
                print(f"[openai-load] {name} #{repeat + 1}: {rate:.2f} tokens/s", flush=True)
    settings = {
        "clients": clients,
        "requests": requests,
        "max_tokens": max_tokens,
        "repeats": repeats,
    }
    return {
        "benchmark": "openai-load",
        "summary": _summary(samples, texts),
        "config": {**vars(args), **settings, "json": None, "plot": None},
        "environment": environment(),
        "samples": samples,
    }


def _system_turn(num_chars: int) -> str:
    source = Path(textwrap.__file__).read_text()[:num_chars]
    return source[: source.rfind("\n") + 1]


def _serve(args, name: str, system: str, clients: int, requests: int, max_tokens: int):
    config = CoordinatorConfig(
        auto_prefix_min_tokens=args.auto_prefix_min_tokens, default_mode="vericache"
    )
    with tempfile.TemporaryDirectory() as root:
        verifier = VerifierConfig(model=args.model, root=Path(root))
        drafter = DrafterConfig(model=args.model)
        http = HttpSettings(0, MODEL_ID)
        with ray_server(verifier, drafter, 1, config, http) as server:
            url = f"http://{server.host}:{server.http_port}/v1/chat/completions"
            mode = None if name == "vericache" else name
            started = time.perf_counter()
            streamed = asyncio.run(_wave(url, system, mode, clients, requests, max_tokens, args))
            wall_s = time.perf_counter() - started
            counts = _prefix_counts(server)
    return streamed, wall_s, counts


async def _wave(url, system, mode, clients, requests, max_tokens, args) -> list[Streamed]:
    import httpx

    async with httpx.AsyncClient(timeout=args.timeout) as http:

        async def client(index: int) -> list[Streamed]:
            done = []
            for request in range(requests):
                user = USER_TURNS[(index + request) % len(USER_TURNS)]
                body = {
                    "model": MODEL_ID, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True},
                    "messages": [
                        {"role": "system", "content": system}, {"role": "user", "content": user}
                    ],
                }  # fmt: skip
                if mode is not None:
                    body["vericache"] = {"mode": mode}
                done.append(await _stream(http, url, body, index, request))
            return done

        waves = await asyncio.gather(*(client(i) for i in range(clients)))
    return [streamed for wave in waves for streamed in wave]


async def _stream(http, url: str, body: dict, client: int, request: int) -> Streamed:
    started = time.perf_counter()
    arrivals, texts, num_tokens = [], [], 0
    async with http.stream("POST", url, json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"the server answered {reply.status_code}: {await reply.aread()}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                raise RuntimeError(f"the stream failed: {chunk['error']['message']}")
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                if choice["delta"].get("content"):
                    arrivals.append(time.perf_counter())
                    texts.append(choice["delta"]["content"])
    total_s = time.perf_counter() - started
    ttft_s = (arrivals[0] if arrivals else time.perf_counter()) - started
    gaps = tuple(b - a for a, b in zip(arrivals, arrivals[1:]))
    return Streamed(client, request, "".join(texts), num_tokens, ttft_s, gaps, total_s)


def _prefix_counts(server) -> dict[str, float]:
    metrics = server.coordinator.metrics
    labels = {"model_name": metrics.model_name}
    get = metrics.registry.get_sample_value
    return {
        "queries": get("vericache:prefix_cache_queries_total", labels) or 0.0,
        "hits": get("vericache:prefix_cache_hits_total", labels) or 0.0,
    }


def _percentile(values: list[float], share: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def _sample(streamed: list[Streamed], wall_s: float, counts: dict) -> dict:
    ttfts = [s.ttft_s for s in streamed]
    gaps = [gap for s in streamed for gap in s.chunk_gaps_s]
    per_token = [(s.total_s - s.ttft_s) / (s.num_tokens - 1) for s in streamed if s.num_tokens > 1]
    tokens = sum(s.num_tokens for s in streamed)
    return {
        "requests": len(streamed),
        "output_tokens": tokens,
        "tokens_per_s": tokens / wall_s,
        "ttft_p50_s": _percentile(ttfts, 0.5),
        "ttft_p99_s": _percentile(ttfts, 0.99),
        "inter_chunk_p50_s": _percentile(gaps, 0.5),
        "inter_chunk_p99_s": _percentile(gaps, 0.99),
        "time_per_token_p50_s": _percentile(per_token, 0.5),
        "time_per_token_p99_s": _percentile(per_token, 0.99),
        "prefix_hit_rate": counts["hits"] / counts["queries"] if counts["queries"] else 0.0,
        "streams": [asdict(s) for s in streamed],
    }


def _summary(samples: dict[str, list[dict]], texts: dict[str, dict]) -> dict:
    def spread(name: str, key: str) -> dict:
        values = [sample[key] for sample in samples[name]]
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    keys = ("tokens_per_s", "ttft_p50_s", "ttft_p99_s", "inter_chunk_p50_s", "inter_chunk_p99_s",
            "time_per_token_p50_s", "time_per_token_p99_s", "prefix_hit_rate")  # fmt: skip
    ratios = [
        v["tokens_per_s"] / f["tokens_per_s"]
        for v, f in zip(samples["vericache"], samples["full_local"])
    ]
    return {
        "by_configuration": {name: {key: spread(name, key) for key in keys} for name in samples},
        "vericache_over_full_local": {
            "median": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
        },  # fmt: skip
        "identical": texts["vericache"] == texts["full_local"],
    }


LATENCIES = ("ttft", "inter_chunk", "time_per_token")


def plot(result: dict, path) -> None:
    """Tokens/s of every serve, and each latency's p50 and p99 (median over serves, with their
    range), vericache beside full_local."""
    from vericache.bench.common import pyplot, save_figure

    plt = pyplot()
    figure, (rates, latencies) = plt.subplots(1, 2, figsize=(11, 4))
    by_configuration = result["summary"]["by_configuration"]
    for i, name in enumerate(CONFIGURATIONS):
        samples = [s["tokens_per_s"] for s in result["samples"][name]]
        rates.scatter([i] * len(samples), samples, s=18)
        rates.hlines(statistics.median(samples), i - 0.2, i + 0.2)
        for j, (latency, share) in enumerate((k, p) for k in LATENCIES for p in ("p50", "p99")):
            cell = by_configuration[name][f"{latency}_{share}_s"]
            error = [[cell["median"] - cell["min"]], [cell["max"] - cell["median"]]]
            x = j + (i - 0.5) * 0.35
            latencies.bar(x, cell["median"], 0.35, yerr=error, color=f"C{i}",
                          label=name if j == 0 else None)  # fmt: skip
    rates.set_xticks(range(len(CONFIGURATIONS)), CONFIGURATIONS)
    rates.set_ylabel("output tokens/s (each serve; line: median)")
    names = [f"{k.replace('_', ' ')} {p}" for k in LATENCIES for p in ("p50", "p99")]
    latencies.set_xticks(range(len(names)), names, rotation=30, ha="right")
    latencies.set_yscale("log")
    latencies.set_ylabel("seconds (median of serves, range)")
    latencies.legend()
    summary = result["summary"]
    ratio = summary["vericache_over_full_local"]
    title = (
        f"openai-load: vericache / full_local tokens/s {ratio['median']:.2f} "
        f"({ratio['min']:.2f}-{ratio['max']:.2f}), identical {summary['identical']}"
    )
    save_figure(figure, path, title)
