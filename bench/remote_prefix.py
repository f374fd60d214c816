"""Remote prefix caching (the paper's Pipeline 2): sustained tokens/s of a stream of requests over
registered prefixes, VeriCache against the best full-KV configuration on the same workers.

Every configuration serves the same stream (request i asks CONTEXT_PROMPTS[i // P % 3] about
prefix i % P, C at a time, greedy) through the client SDK, on freshly started Ray workers (one
thread each: a worker stands for one GPU; a cold drafter LRU):
- VERICACHE: drafters fetch each prefix's compressed KV once over the slow link and draft; the
  verifier beside the store verifies with the full KV. Swept over the draft length x, the number of
  drafters and the scheduling (per-request, staggered).
- FULL_LOCAL: the verifier decodes alone, loading full KV from its store; the drafters idle.
- FULL_REMOTE: the drafters fetch full KV over the slow link and decode alone. Their LRU
  (`--drafter-kv` full prefixes) holds every compressed KV but not every full KV, so a stream
  cycling over the prefixes fetches again, as a remote GPU with bounded memory would.
- FULL_BOTH: full-KV serving on every worker at once: a router sends each request to the verifier
  (FULL_LOCAL) or the drafters (FULL_REMOTE), whichever would finish it first given the
  throughput each measured alone and, where the drafters do not hold its prefix, the time its
  full KV takes to cross the link (bench/serving.py, `Router`: a cache-aware router).
- AUTO: the server chooses each request's path (serve/backends/auto_path.py) among the above.
A second stream (`--many-prefixes`, 8 of 3k+ tokens, a few sessions each) is served past the
drafters' device budget (`--many-drafter-kv`: 2 full prefixes), every drafter with a host tier
that holds them all: FULL_REMOTE keeps what it fetched there (a full-KV server with a host-memory
tier), and VERICACHE's drafter nodes turn warm and verify their own rounds
(serve/workers/warm_node.py). Its cells: FULL_LOCAL, FULL_REMOTE, FULL_BOTH, VERICACHE and AUTO, on
the same workers and budgets. The link's bandwidth makes moving one prefix's full KV take `--ratio`
times FULL_LOCAL's seconds per reply (its stream's wall time / requests). Each cell is served
`--repeats` times, on fresh workers each time: its median tokens/s, with the smallest and largest.
AUTO is served in turn, sample by sample, with FULL_BOTH (and, in the second stream, VERICACHE), so
that they share the machine's minutes.
Each time the stream's first `concurrency` requests are served once, untimed, before the stream:
tokens/s are the workers' steady state (buffers of closed sessions reused, the drafters' LRU holding
what it can).

Summary:
- vericache_over_best_full: VERICACHE over the best of FULL_LOCAL, FULL_REMOTE and FULL_BOTH on
  the same drafters, per cell; the headline is the server's defaults (x=30, one drafter,
  per-request rounds), chosen before the run;
- rpcs_per_round: worker calls of a round per request, the most of any cell (target <= 2): a
  draft call and a verifier call, which in scheduled rounds also carries the round's full-KV load
  (rpcs_per_round_by_scheduling splits them by scheduling);
- rtt20_over_rtt0: VERICACHE tokens/s with `--rtt-latency-ms` (20) of one-way latency on the link
  over none, at x=30 with one drafter, the lower of the two schedulings (target >= 0.85). The two
  cells are served in turn, sample by sample, and each sample with latency is set against the
  one without it served just before: the median of those ratios, the machine's speed cancelled;
- verifier_overhead: the verifier process's CPU seconds per output token over what the full-KV
  half of the same requests costs the in-process engine per output token: their verifications
  and the prefill of each prompt after its prefix (bench/remote_prefix_reference.py; target
  <= 1.3), the most of any cell. The reference is measured in parts beside each VERICACHE cell's
  samples (after the i-th sample, the i-th slice of the stream), at its draft length, so that it
  spans the same minutes as the samples; the summary shows how far the machine's speed moved
  (reference_cpu_s_pertoken_range);
- verifier_serving_overhead: the verifier's CPU over its own forward loop's plus the suffix
  prefills', in the same stream: serving's share alone;
- auto_over_best_full_many_prefixes: AUTO over the best full-KV cell of the many-prefix stream,
  at the headline draft length and one drafter (target >= 1.5);
- auto_over_best_everywhere: the least, over every AUTO cell, of AUTO over the better of VERICACHE
  (same stream, draft length and drafters) and that stream's best full-KV cell (target >= 0.95);
- identical: every sample's exact outputs equal FULL_LOCAL's, and the in-process engine's too.
Run with OMP_NUM_THREADS=1 on a machine with a core per worker and nothing else busy; each sample
keeps the CPU seconds of the drafters, the verifier and everything else during its stream.
"""

from __future__ import annotations

import statistics
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vericache.bench.common import (
    environment,
    int_list,
    str_list,
    token_range,
)
from vericache.bench.remote_prefix_cells import (
    FEW,
    MANY,
    Cell,
    StreamSpec,
    auto_groups,
    cell_record,
    many_prefix_full_cells,
    request_stream,
    vericache_cells,
)
from vericache.bench.remote_prefix_plot import plot  # noqa: F401 - the CLI's plot(result, path)
from vericache.bench.remote_prefix_reference import (
    EngineReference,
    ReferenceRun,
)
from vericache.bench.remote_prefix_registration import register_prefixes
from vericache.bench.remote_prefix_summary import DEFINITIONS, summarize
from vericache.bench.serving import (
    RoutedPool,
    Router,
    metric,
    ray_server,
    ray_session,
    serve_stream,
    stream_record,
)
from vericache.bench.workloads import code_contexts
from vericache.client import Client
from vericache.engine.link import LinkSpec
from vericache.errors import InvalidRequestError
from vericache.model.loader import DEFAULT_MODEL, load_tokenizer, resolve_model_dir
from vericache.serve.config import CoordinatorConfig, DrafterConfig, VerifierConfig


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--compressor", default="snapkv-4x-bf16", help="label, e.g. kivi-4bit")
    parser.add_argument("--draft-lens", type=int_list, help="x values (8,16,30; quick 8,30)")
    parser.add_argument("--drafters", type=int_list, help="drafter counts (1,2; quick 1)")
    parser.add_argument("--schedulings", type=str_list, help="per-request,staggered (quick: both)")
    parser.add_argument("--prefixes", type=int, help="distinct prefixes P (3; quick 2)")
    parser.add_argument(
        "--prefix-tokens", type=token_range, help="MIN,MAX tokens per prefix (2000,3000)"
    )
    parser.add_argument("--requests", type=int, help="requests in the stream (12; quick 4)")
    parser.add_argument("--max-tokens", type=int, help="output tokens per request (96; quick 32)")
    parser.add_argument("--concurrency", type=int, help="requests in flight (6; quick 2)")
    parser.add_argument("--repeats", type=int, help="serves per cell (3; quick 1)")
    parser.add_argument(
        "--ratio", type=float, default=1.0, help="full-KV transfer time / reply decode time"
    )
    parser.add_argument("--drafter-kv", type=float, default=1.5, help="drafter LRU, full prefixes")
    parser.add_argument("--rtt-latency-ms", type=float, default=20.0, help="one-way, for rtt20")
    parser.add_argument("--many-prefixes", type=int, help="many-prefix stream (8; 0: none)")
    parser.add_argument(
        "--many-prefix-tokens", type=token_range, help="its MIN,MAX tokens (3000,3500)"
    )
    parser.add_argument("--many-requests", type=int, help="its requests (24; quick 8)")
    parser.add_argument(
        "--many-drafter-kv", type=float, default=2.0, help="its drafters' budget, full prefixes"
    )
    parser.add_argument(
        "--steer-every", type=int, default=0,
        help="also serve the headline cell with its kept set steered every K rounds (0: not)",
    )  # fmt: skip


def stream_spec(args) -> StreamSpec:
    def pick(value, full, quick):
        return value if value is not None else (quick if args.quick else full)

    return StreamSpec(
        compressor=args.compressor,
        draft_lens=tuple(pick(args.draft_lens, (8, 16, 30), (8, 30))),
        drafter_counts=tuple(pick(args.drafters, (1, 2), (1,))),
        schedulings=tuple(pick(args.schedulings, ("per-request", "staggered"), ("per-request",))),
        num_prefixes=pick(args.prefixes, 3, 2),
        prefix_tokens=pick(args.prefix_tokens, (2000, 3000), (1000, 1500)),
        num_requests=pick(args.requests, 12, 4),
        max_tokens=pick(args.max_tokens, 96, 32),
        concurrency=pick(args.concurrency, 6, 2),
        repeats=pick(args.repeats, 3, 1),
        ratio=args.ratio,
        drafter_kv_prefixes=args.drafter_kv,
        rtt_latency_s=args.rtt_latency_ms / 1e3,
        many_prefixes=pick(args.many_prefixes, 8, 8),
        many_prefix_tokens=pick(args.many_prefix_tokens, (3000, 3500), (1600, 2000)),
        many_requests=pick(args.many_requests, 24, 8),
        many_drafter_kv_prefixes=args.many_drafter_kv,
        steer_every=args.steer_every,
    )


def bandwidth_for(ratio: float, full_wire_bytes: float, seconds_per_reply: float) -> float:
    """Bytes/s at which one prefix's full KV crosses the link in `ratio` x seconds_per_reply."""
    if full_wire_bytes <= 0 or seconds_per_reply <= 0:
        raise InvalidRequestError("calibration measured no full-KV bytes or no decode time")
    return full_wire_bytes / (ratio * seconds_per_reply)


# --- Serving -------------------------------------------------------------------------------------


@dataclass
class Stream:
    """One stream of requests over its prefixes, and the drafters' budgets it is served with."""

    prefixes: list[dict]
    jobs: list[tuple[str, str]]
    drafter_kv_bytes: int
    host_tier_bytes: int = 0
    expected: list[list[int]] | None = None  # FULL_LOCAL's outputs, once served


@dataclass
class Bench:
    """What every cell is served with: the model, the store, the streams and the link."""

    model: str
    root: Path
    spec: StreamSpec
    streams: dict[str, Stream]
    bandwidth: float | None = None  # None: an open link (registration, calibration)
    rates: dict[str, float] = field(default_factory=dict)  # by cell: the FULL_BOTH router's
    reference: EngineReference | None = None  # measured beside VERICACHE cells, if set

    def serve(self, *cells: Cell) -> list[tuple[dict, list[list[list[int]]]]]:
        """Each cell's samples (one per repeat, each on fresh workers) and each sample's
        outputs. Several cells are served in turn, sample by sample, so that they see the same
        machine. After a VERICACHE cell's i-th sample (one without latency), the i-th part of its
        in-process reference (referenced)."""
        repeats = self.spec.repeats
        samples = {cell: [] for cell in cells}
        outputs = {cell: [] for cell in cells}
        parts = {cell: [] for cell in cells}
        for repeat in range(repeats):
            for cell in cells:
                sample, sample_outputs = self._serve_once(cell)
                print(f"[remote-prefix] {cell.name}: {sample['tokens_per_s']:.2f} tokens/s")
                samples[cell].append(sample)
                outputs[cell].append(sample_outputs)
                if self._is_referenced(cell):
                    parts[cell].append(self.reference.measure(cell.draft_len, repeat, repeats))
        return [
            (self._record(cell, samples[cell], outputs[cell], parts[cell]), outputs[cell])
            for cell in cells
        ]

    def _is_referenced(self, cell: Cell) -> bool:
        return (
            self.reference is not None
            and cell.mode == "vericache"
            and cell.workload == FEW
            and not cell.latency_s
            and not cell.steer_every
        )

    @staticmethod
    def _record(cell: Cell, samples, outputs, parts: list[ReferenceRun]) -> dict:
        record = cell_record(cell, samples)
        if parts:
            run = ReferenceRun.combined(parts)
            expected = run.stream_outputs()
            record["reference"] = run.record(parts)
            record["reference_outputs_match"] = [got == expected for got in outputs]
        return record

    def _serve_once(self, cell: Cell) -> tuple[dict, list[list[int]]]:
        stream = self.streams[cell.workload]
        verifier = VerifierConfig(
            model=self.model, root=self.root, link=LinkSpec(self.bandwidth, cell.latency_s)
        )
        drafter = DrafterConfig(
            model=self.model, kv_cache_bytes=stream.drafter_kv_bytes,
            host_tier_bytes=stream.host_tier_bytes,
        )  # fmt: skip
        config = CoordinatorConfig(
            default_draft_len=cell.draft_len or 30, scheduling=cell.scheduling
        )
        mode = self._router(cell) if cell.mode == "full_both" else cell.mode
        spec = self.spec
        draft_len = cell.draft_len or 30
        with ray_server(verifier, drafter, cell.num_drafters, config) as server:
            # The stream's first wave, untimed: the workers reach their steady state (KV buffers
            # of closed sessions to reuse, prefixes in the drafters' LRU as far as it holds them,
            # AUTO's first measurement of each path).
            warm = stream.jobs[: spec.concurrency]
            serve_stream(
                server.target, warm, mode, spec.max_tokens, draft_len, spec.concurrency,
                cell.steer_every,
            )  # fmt: skip
            before = _server_counts(server)
            wall_s, results, cpu_s, routed = serve_stream(
                server.target, stream.jobs, mode, spec.max_tokens, draft_len, spec.concurrency,
                cell.steer_every,
            )  # fmt: skip
            sample = stream_record(wall_s, results, cpu_s)
            sample |= {k: v - before[k] for k, v in _server_counts(server).items()}
        if cell.mode == "full_both":
            sample["routed"] = dict(Counter(routed))
        if cell.mode == "auto":
            sample["paths"] = dict(Counter(result.stats["path"] for result in results))
        return sample, [result.token_ids for result in results]

    def _router(self, cell: Cell) -> Router:
        """FULL_BOTH's router over the two pools' measured throughputs, knowing what crossing the
        link costs each prefix and how many prefixes the drafters' device budgets hold."""

        def rate(mode: str, num_drafters: int) -> float:
            return self.rates[Cell(mode, num_drafters, workload=cell.workload).name]

        stream = self.streams[cell.workload]
        largest = max(p["full_kv_bytes"] for p in stream.prefixes)
        per_drafter = stream.drafter_kv_bytes // largest
        pools = [
            RoutedPool("full_local", rate("full_local", 1)),
            RoutedPool("full_remote", rate("full_remote", cell.num_drafters),
                       per_drafter * cell.num_drafters),
        ]  # fmt: skip
        fetch_s = {
            p["prefix_id"]: cell.latency_s + p["full_wire_bytes"] / self.bandwidth
            for p in stream.prefixes
        }
        return Router(pools, fetch_s, self.spec.max_tokens)


def _server_counts(server) -> dict[str, float]:
    """Counts that a stream adds to: round calls, rounds, the rounds verified on warm drafter
    nodes; per role, its workers' forwards, the jobs those held (over the forwards: the mean
    batch) and their CPU seconds, which sim-validate sets beside the simulated ones."""
    counts = {
        "round_calls": metric(server, "round_worker_calls_total"),
        "verified_rounds": metric(server, "spec_decode_num_drafts_total"),
        "local_rounds": metric(server, "local_rounds_total"),
    }
    backend = server.coordinator.backend
    for role, workers in (("verifiers", backend.verifiers), ("drafters", backend.drafters)):
        stats = [server.run(worker.batching()) for worker in workers]
        counts[f"{role}_forwards"] = sum(s.steps for s in stats)
        counts[f"{role}_forward_rows"] = sum(s.rows for s in stats)
        counts[f"{role}_forward_cpu_s"] = sum(s.cpu_s for s in stats)
    return counts


# --- The benchmark -------------------------------------------------------------------------------


def run(args) -> dict:
    spec = stream_spec(args)
    tokenizer = load_tokenizer(resolve_model_dir(args.model))
    contexts = {
        FEW: code_contexts(tokenizer, *spec.prefix_tokens, spec.num_prefixes, truncate=True)
    }
    if spec.many_prefixes:
        contexts[MANY] = code_contexts(
            tokenizer, *spec.many_prefix_tokens, spec.many_prefixes, truncate=True
        )
    with ray_session(max(spec.drafter_counts)), tempfile.TemporaryDirectory() as directory:
        bench = Bench(args.model, Path(directory), spec, {})
        with ray_server(VerifierConfig(model=args.model, root=bench.root), DrafterConfig(
            model=args.model
        ), 1) as server, Client(server.target) as client:  # fmt: skip
            prefixes = {
                name: register_prefixes(client, c, spec.compressor) for name, c in contexts.items()
            }
        _check_disjoint(prefixes)
        bench.streams = {name: _stream(name, found, spec) for name, found in prefixes.items()}
        cells = _serve_all(bench)
    return {
        "benchmark": "remote-prefix",
        "summary": summarize(cells, spec),
        "definitions": DEFINITIONS,
        "config": {**asdict(spec), "model": args.model, "quick": args.quick},
        "environment": environment(),
        "prefixes": [_without_text(p) for p in prefixes[FEW]],
        "many_prefixes": [_without_text(p) for p in prefixes.get(MANY, [])],
        "bandwidth_bytes_per_s": bench.bandwidth,
        "drafter_kv_cache_bytes": bench.streams[FEW].drafter_kv_bytes,
        "many_prefix_budgets": _budgets(bench.streams.get(MANY)),
        "cells": cells,
    }


def _stream(name: str, prefixes: list[dict], spec: StreamSpec) -> Stream:
    """The stream over `prefixes`, with its drafters' device budget (and, for the many-prefix
    stream, a host tier that holds every prefix)."""
    ids = [p["prefix_id"] for p in prefixes]
    max_full = max(p["full_kv_bytes"] for p in prefixes)
    if name == FEW:
        num_requests, budget_prefixes, tier = spec.num_requests, spec.drafter_kv_prefixes, 0
    else:
        num_requests, budget_prefixes = spec.many_requests, spec.many_drafter_kv_prefixes
        tier = int(1.25 * sum(p["full_kv_bytes"] for p in prefixes))
    jobs = request_stream(ids, num_requests)
    return Stream(prefixes, jobs, int(budget_prefixes * max_full), tier)


def _check_disjoint(prefixes: dict[str, list[dict]]) -> None:
    """The streams' prefixes are distinct: a text registered twice is one prefix, whose second
    registration fetches nothing and measures no full-KV bytes."""
    ids = [p["prefix_id"] for found in prefixes.values() for p in found]
    if len(set(ids)) != len(ids):
        raise InvalidRequestError(
            "the two streams share a prefix: give --many-prefix-tokens a range apart from "
            "--prefix-tokens"
        )


def _without_text(prefix: dict) -> dict:
    return {k: v for k, v in prefix.items() if k != "text"}


def _budgets(stream: Stream | None) -> dict | None:
    if stream is None:
        return None
    return {"drafter_kv_bytes": stream.drafter_kv_bytes, "host_tier_bytes": stream.host_tier_bytes}


def _serve_all(bench: Bench) -> list[dict]:
    """FULL_LOCAL first (it calibrates the link), then every other cell at that bandwidth, each
    VERICACHE cell followed by its in-process reference and AUTO in turn with what it is held to
    (`auto_groups`); then the many-prefix stream's cells, likewise."""
    spec, few = bench.spec, bench.streams[FEW]
    (full_local,) = _served(bench, (Cell("full_local", 1),))
    seconds_per_reply = statistics.median(s["wall_s"] for s in full_local["samples"]) / len(
        few.jobs
    )
    full_wire = statistics.mean(p["full_wire_bytes"] for p in few.prefixes)
    bench.bandwidth = bandwidth_for(spec.ratio, full_wire, seconds_per_reply)
    print(f"[remote-prefix] link: {bench.bandwidth / 1e6:.2f} MB/s")
    cells = [full_local]
    for cell in [Cell("full_remote", n) for n in spec.drafter_counts]:
        cells += _served(bench, (cell,))
    bench.reference = EngineReference(bench.model, few.prefixes, few.jobs, spec)
    bench.reference.measure(max(spec.draft_lens))  # untimed: prefills the prefixes' full KV
    for group in vericache_cells(spec) + auto_groups(spec):
        cells += _served(bench, group)
    if MANY in bench.streams:
        full = [(cell,) for cell in many_prefix_full_cells(spec)]
        for group in full + auto_groups(spec, MANY):
            cells += _served(bench, group)
    return cells


def _served(bench: Bench, group: tuple[Cell, ...]) -> list[dict]:
    """The group's records, each checked against its stream's FULL_LOCAL outputs (a FULL_LOCAL
    cell's first sample sets them)."""
    records = []
    for record, outputs in bench.serve(*group):
        stream = bench.streams[record["workload"]]
        if stream.expected is None:
            stream.expected = outputs[0]
        record["outputs_match"] = all(sample == stream.expected for sample in outputs)
        bench.rates[record["name"]] = record["tokens_per_s"]
        records.append(record)
    return records
