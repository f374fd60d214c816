"""Soak: bounded clients stream for bounded seconds over registered prefixes, in mixed modes, with
random cancels and workers killed (SIGKILL) on the way: the drafter a third of the way in and the
verifier two thirds (`--kill both`), or one of them midway. Nothing may be lost, repeated or
wrong: every completed request equals full-KV decoding of its prompt, and every cancelled one
streamed a prefix of it.

Summary: `lost_tokens` and `duplicated_tokens` (completed requests against their reference) and
`wrong` (requests whose tokens or text differ from it), all 0; `identical`; `failed_mid_stream`
(streams that failed after their first token: a migration that did not happen, 0) apart from
`refused` (calls answered UNAVAILABLE before any token, while no worker of a kind they need was
up, as health said); latency p50 and p99 of completed requests; `restarts`, each kill's seconds
until the worker answered again (from the kill, and from the server's
`worker_restart_seconds`, which starts when the server found it gone); and `metrics_match`: the
server's request counters equal what the clients saw (success of every reason = completed +
cancelled, failures = failed).
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from vericache.bench.common import environment
from vericache.bench.serving import ray_server, ray_session
from vericache.client import Client
from vericache.errors import VeriCacheError
from vericache.serve.config import CoordinatorConfig, DrafterConfig, VerifierConfig

MODES = ("vericache", "full_local", "full_remote")
REFUSED_BACKOFF_S = 0.5
PROMPTS = (
    "Which function here is the most useful? Say why.",
    "Write a short example that calls two of these functions.",
    "Explain the first function in one paragraph.",
)


def add_arguments(parser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--seconds", type=float, default=60.0, help="how long clients submit")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--cancel-share", type=float, default=0.2)
    parser.add_argument(
        "--kill", choices=["both", "drafter", "verifier", "none"], default="both",
        help="both: the drafter a third of the way in, the verifier at two thirds",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--context-chars", type=int, default=4000, help="of each prefix's text")


@dataclass
class Outcome:
    mode: str
    prefix: int  # index of the prefix
    prompt: int  # index of the prompt
    status: str  # "completed", "cancelled" or the failure's class
    text: str
    token_ids: list[int]
    latency_s: float
    started_s: float = 0.0  # after the soak began
    num_deltas: int = 0  # text deltas streamed before it completed, was cancelled or failed


def run(args) -> dict:
    seconds = min(args.seconds, 20.0) if args.quick else args.seconds
    contexts = _contexts(args.context_chars)
    with ray_session(num_drafters=1), tempfile.TemporaryDirectory() as root:
        verifier = VerifierConfig(model=args.model, root=Path(root))
        config = CoordinatorConfig(max_output_tokens=max(args.max_tokens, 256))
        with ray_server(verifier, DrafterConfig(model=args.model), 1, config) as server:
            with Client(server.target, timeout=300) as client:
                prefix_ids = [
                    client.put_prefix(text, compressor="streamingllm", ratio=4) for text in contexts
                ]
                references = _references(client, prefix_ids, args.max_tokens)
            before = _request_counts(server)
            outcomes, restarts = _soak(server, prefix_ids, args, seconds)
            after = _settled_counts(server)
            restarts = _with_server_timings(server, restarts)
    summary = _summary(outcomes, references, before, after)
    summary["killed"] = args.kill
    summary["restarts"] = restarts
    return {
        "benchmark": "soak",
        "summary": summary,
        "config": {**vars(args), "json": None, "plot": None, "seconds": seconds},
        "environment": environment(),
        "outcomes": [asdict(outcome) for outcome in outcomes],
    }


def _contexts(num_chars: int) -> list[str]:
    """Two prefixes from standard-library sources (a module's start, cut at a line)."""
    import json as json_module
    import textwrap

    texts = []
    for module in (json_module, textwrap):
        source = Path(module.__file__).read_text()[:num_chars]
        texts.append(source[: source.rfind("\n") + 1])
    return texts


def _references(client: Client, prefix_ids: list[str], max_tokens: int) -> dict:
    """Full-KV decoding of every (prefix, prompt): what each request must stream."""
    return {
        (p, q): client.generate(
            prompt, prefix_id=prefix_id, mode="full_local", max_tokens=max_tokens
        )
        for p, prefix_id in enumerate(prefix_ids)
        for q, prompt in enumerate(PROMPTS)
    }


def _soak(server, prefix_ids: list[str], args, seconds: float) -> tuple[list[Outcome], list]:
    began = time.monotonic()
    deadline = began + seconds
    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def client_loop(seed: int) -> None:
        chooser = random.Random(seed)
        with Client(server.target, timeout=300, retries=0) as client:
            while time.monotonic() < deadline:
                outcome = _one_request(client, prefix_ids, args, chooser, began)
                with lock:
                    outcomes.append(outcome)
                if outcome.status not in ("completed", "cancelled") and outcome.num_deltas == 0:
                    # Refused (no worker of a kind up): back off as a client told so would,
                    # rather than count thousands of instant refusals.
                    time.sleep(REFUSED_BACKOFF_S)

    threads = [
        threading.Thread(target=client_loop, args=(args.seed + i,)) for i in range(args.clients)
    ]
    for thread in threads:
        thread.start()
    restarts = [_kill_and_time(server, kind, began + at_s) for kind, at_s in _kills(args, seconds)]
    for thread in threads:
        thread.join()
    return outcomes, restarts


def _kills(args, seconds: float) -> list[tuple[str, float]]:
    """(kind, seconds into the soak) of each kill."""
    if args.kill == "both":
        return [("drafter", seconds / 3), ("verifier", 2 * seconds / 3)]
    return [] if args.kill == "none" else [(args.kill, seconds / 2)]


def _kill_and_time(server, kind: str, at: float) -> dict:
    """SIGKILLs the first worker of `kind` at `at` (time.monotonic()); returns the seconds until
    the server found it gone and until it answered again."""
    time.sleep(max(at - time.monotonic(), 0.0))
    backend = server.coordinator.backend
    handle = (backend.drafters if kind == "drafter" else backend.verifiers)[0]
    import ray

    pid = ray.get(handle.worker.__ray_call__.remote(lambda self: os.getpid()), timeout=60)
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    found_gone_s = _seconds_until(lambda: not handle.is_alive, killed_at, timeout_s=30)
    back_s = None  # never found gone: it did not come back either
    if found_gone_s is not None:
        back_s = _seconds_until(lambda: handle.is_alive, killed_at, timeout_s=300)
    return {"kind": kind, "found_gone_s": found_gone_s, "back_after_kill_s": back_s}


def _seconds_until(condition, since: float, timeout_s: float) -> float | None:
    while not condition():
        if time.monotonic() - since > timeout_s:
            return None
        time.sleep(0.02)
    return round(time.monotonic() - since, 3)


def _with_server_timings(server, restarts: list[dict]) -> list[dict]:
    """Each kill with the server's own timing of its restart (`worker_restart_seconds`, from the
    worker found gone: one observation per kill of a kind)."""
    metrics = server.coordinator.metrics
    timed = []
    for kind in sorted({restart["kind"] for restart in restarts}):
        labels = {"model_name": metrics.model_name, "kind": kind}
        total = metrics.registry.get_sample_value("vericache:worker_restart_seconds_sum", labels)
        count = metrics.registry.get_sample_value("vericache:worker_restart_seconds_count", labels)
        for restart in restarts:
            if restart["kind"] == kind:
                mean = round(total / count, 3) if count else None
                timed.append({**restart, "server_restart_s": mean, "server_restarts": count})
    return timed


def _one_request(
    client: Client, prefix_ids: list[str], args, chooser: random.Random, began: float
) -> Outcome:
    mode = chooser.choice(MODES)
    p, q = chooser.randrange(len(prefix_ids)), chooser.randrange(len(PROMPTS))
    cancel_after = chooser.randint(1, 4) if chooser.random() < args.cancel_share else None
    started = time.perf_counter()
    started_s = time.monotonic() - began
    text, status, token_ids, num_deltas = "", "completed", [], 0
    try:
        with client.stream(
            PROMPTS[q], prefix_id=prefix_ids[p], mode=mode, max_tokens=args.max_tokens
        ) as stream:
            for delta in stream:
                text += delta
                num_deltas += 1
                if cancel_after is not None and num_deltas >= cancel_after:
                    status = "cancelled"
                    break
            if status == "completed":
                token_ids = list(stream.result().token_ids)
    except VeriCacheError as exc:
        status = type(exc).__name__
    latency_s = time.perf_counter() - started
    return Outcome(mode, p, q, status, text, token_ids, latency_s, round(started_s, 3), num_deltas)


def _request_counts(server) -> dict[str, float]:
    """The server's request counters, summed over their labels."""
    totals = {"success": 0.0, "failure": 0.0}
    for family in server.coordinator.metrics.registry.collect():
        for name in totals:
            if family.name == f"vericache:request_{name}":
                totals[name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return totals


def _settled_counts(server, timeout_s: float = 5.0) -> dict[str, float]:
    """The counters once the server has finished with every stream the clients left."""
    deadline = time.monotonic() + timeout_s
    counts = _request_counts(server)
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = _request_counts(server)
        if now == counts and server.coordinator.num_running == 0:
            return now
        counts = now
    return counts


def _summary(outcomes: list[Outcome], references: dict, before: dict, after: dict) -> dict:
    completed = [o for o in outcomes if o.status == "completed"]
    cancelled = [o for o in outcomes if o.status == "cancelled"]
    failed = [o for o in outcomes if o.status not in ("completed", "cancelled")]
    lost = duplicated = wrong = 0
    for outcome in completed:
        reference = references[(outcome.prefix, outcome.prompt)].token_ids
        lost += max(0, len(reference) - len(outcome.token_ids))
        duplicated += max(0, len(outcome.token_ids) - len(reference))
        wrong += outcome.token_ids != list(reference)
    for outcome in [*cancelled, *failed]:  # what they streamed is a start of the reference
        wrong += not references[(outcome.prefix, outcome.prompt)].text.startswith(outcome.text)
    latencies = sorted(o.latency_s for o in completed)
    counted = {name: after[name] - before[name] for name in after}
    return {
        "requests": len(outcomes),
        "completed": len(completed),
        "cancelled": len(cancelled),
        "failed": len(failed),
        "failures": sorted({o.status for o in failed}),
        "refused": sum(o.num_deltas == 0 for o in failed),
        "failed_mid_stream": sum(o.num_deltas > 0 for o in failed),
        "lost_tokens": lost,
        "duplicated_tokens": duplicated,
        "wrong": wrong,
        "identical": wrong == 0,
        "latency_p50_s": statistics.median(latencies) if latencies else None,
        "latency_p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
        if latencies
        else None,
        "metrics_match": counted
        == {"success": len(completed) + len(cancelled), "failure": len(failed)},
        "counted": counted,
    }


def plot(result: dict, path) -> None:
    """Each request's latency against when it started, with the kills marked."""
    from types import SimpleNamespace

    from vericache.bench.common import pyplot, save_figure

    plt = pyplot()
    figure, axis = plt.subplots(figsize=(9, 4))
    outcomes = result["outcomes"]
    groups = {
        "completed": [o for o in outcomes if o["status"] == "completed"],
        "cancelled": [o for o in outcomes if o["status"] == "cancelled"],
        "failed": [o for o in outcomes if o["status"] not in ("completed", "cancelled")],
    }
    for status, points in groups.items():
        xs = [o["started_s"] for o in points]
        axis.scatter(xs, [o["latency_s"] for o in points], label=status, s=14)
    config = SimpleNamespace(**result["config"])
    for kind, at_s in _kills(config, config.seconds):
        axis.axvline(at_s, color="grey", linestyle="--", linewidth=1)
        axis.annotate(f"{kind} killed", (at_s, axis.get_ylim()[1]), fontsize=8, va="top")
    axis.set_xlabel("request started, s into the soak")
    axis.set_ylabel("latency, s")
    axis.legend(loc="upper left")
    summary = result["summary"]
    title = (
        f"soak: {summary['requests']} requests, {summary['killed']} killed; lost "
        f"{summary['lost_tokens']}, repeated {summary['duplicated_tokens']}, wrong "
        f"{summary.get('wrong', 0)}"
    )
    save_figure(figure, path, title)
