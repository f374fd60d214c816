"""The remote-prefix benchmark's table (bench/remote_prefix.py): the stream it serves, its
configurations, which of them are served together, and a cell's record of its serves."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, replace

from vericache.bench.workloads import CONTEXT_PROMPTS
from vericache.errors import InvalidRequestError

HEADLINE = {"draft_len": 30, "num_drafters": 1, "scheduling": "per-request"}
FULL_MODES = ("full_local", "full_remote", "full_both")
# The two streams: a few prefixes every drafter holds in full (the paper's Pipeline 2 at this
# machine's scale), and many prefixes past a drafter's device budget, behind a host tier.
FEW, MANY = "few-prefixes", "many-prefixes"


@dataclass(frozen=True)
class StreamSpec:
    """The request stream and how it is served (resolved from the arguments)."""

    compressor: str
    draft_lens: tuple[int, ...]
    drafter_counts: tuple[int, ...]
    schedulings: tuple[str, ...]
    num_prefixes: int
    prefix_tokens: tuple[int, int]
    num_requests: int
    max_tokens: int
    concurrency: int
    repeats: int
    ratio: float
    drafter_kv_prefixes: float
    rtt_latency_s: float
    # The many-prefix stream (0 prefixes: none): its prefixes, their sizes, its requests (a few
    # sessions per prefix), and the drafters' device budget in its largest prefix's full KV.
    many_prefixes: int = 0
    many_prefix_tokens: tuple[int, int] = (3000, 3500)
    many_requests: int = 24
    many_drafter_kv_prefixes: float = 2.0
    # The headline VERICACHE cell served again with its drafter's kept set steered every this
    # many rounds (compress/steering.py), its refreshes on the link; 0: not served.
    steer_every: int = 0

    def __post_init__(self):
        counts = (*self.draft_lens, *self.drafter_counts, self.num_prefixes, self.num_requests)
        if min(*counts, self.max_tokens, self.concurrency, self.repeats) < 1:
            raise InvalidRequestError(f"counts must be >= 1: {self}")
        if not self.ratio > 0 or not self.drafter_kv_prefixes > 0 or self.rtt_latency_s < 0:
            raise InvalidRequestError(f"--ratio and --drafter-kv must be > 0: {self}")
        if self.many_prefixes < 0 or min(self.many_requests, self.many_drafter_kv_prefixes) <= 0:
            raise InvalidRequestError(f"the many-prefix stream's counts must be > 0: {self}")
        if set(self.schedulings) - {"per-request", "staggered", "lockstep"}:
            raise InvalidRequestError(f"unknown scheduling in {self.schedulings}")


@dataclass(frozen=True)
class Cell:
    """One configuration of the table."""

    mode: str  # vericache, auto, full_local, full_remote or full_both
    num_drafters: int
    draft_len: int | None = None  # VERICACHE and AUTO only
    scheduling: str = "per-request"
    latency_s: float = 0.0  # one way, on the link toward the drafters
    workload: str = FEW
    steer_every: int = 0  # VERICACHE: rounds between refreshes of the drafter's kept set

    @property
    def name(self) -> str:
        stream = f"{MANY}: " if self.workload == MANY else ""
        if self.mode == "auto":
            return f"{stream}auto x={self.draft_len} d={self.num_drafters}"
        if self.mode != "vericache":
            return f"{stream}{self.mode} d={self.num_drafters}"
        latency = f" rtt={2e3 * self.latency_s:g}ms" if self.latency_s else ""
        steered = f" steer={self.steer_every}" if self.steer_every else ""
        drafters = f"d={self.num_drafters} {self.scheduling}{latency}{steered}"
        return f"{stream}vericache x={self.draft_len} {drafters}"


def request_stream(prefix_ids: list[str], num_requests: int) -> list[tuple[str, str]]:
    """(prefix id, prompt) of each request: the prefixes in turn, then the next prompt."""
    num_prefixes = len(prefix_ids)
    return [
        (prefix_ids[i % num_prefixes], CONTEXT_PROMPTS[i // num_prefixes % len(CONTEXT_PROMPTS)])
        for i in range(num_requests)
    ]


def vericache_cells(spec: StreamSpec) -> list[tuple[Cell, ...]]:
    """The VERICACHE cells, each alone or (with latency on) the cell of the latency comparison
    with its twin over a link with latency, served in turn; with `steer_every`, the headline
    cell's steered twin too, in turn with it."""
    groups = []
    for drafters in spec.drafter_counts:
        for scheduling in spec.schedulings:
            for draft_len in spec.draft_lens:
                cell = Cell("vericache", drafters, draft_len, scheduling)
                if _is_rtt_pair(cell, spec):
                    groups.append((cell, replace(cell, latency_s=spec.rtt_latency_s)))
                else:
                    groups.append((cell,))
    if spec.steer_every:  # the headline cell's group, and its steered twin in turn with it
        headline = Cell("vericache", **HEADLINE)
        steered = replace(headline, steer_every=spec.steer_every)
        groups = [(*g, steered) if headline in g else g for g in groups]
    return groups


def auto_groups(spec: StreamSpec, workload: str = FEW) -> list[tuple[Cell, ...]]:
    """Per drafter count, `mode: auto` at each draft length served in turn, sample by sample,
    with what it is held to that is served once the pools' rates are known: FULL_BOTH (routed by
    them) and, in the many-prefix stream, VERICACHE on warm nodes at the same draft lengths (the
    few-prefix stream's VERICACHE cells are served with their in-process references). In turn:
    a shared machine's speed moves by 5-25% from one minute to the next (bench/README.md,
    remote-prefix), and cells served minutes apart would compare those minutes."""
    groups = []
    for drafters in spec.drafter_counts:
        group = [Cell("full_both", drafters, workload=workload)]
        if workload == MANY:
            group += [Cell("vericache", drafters, x, workload=MANY) for x in spec.draft_lens]
        group += [Cell("auto", drafters, x, workload=workload) for x in spec.draft_lens]
        groups.append(tuple(group))
    return groups


def many_prefix_full_cells(spec: StreamSpec) -> list[Cell]:
    """The many-prefix stream's FULL_LOCAL and FULL_REMOTE cells, each alone and first: FULL_BOTH
    routes by their rates (its VERICACHE and AUTO cells: `auto_groups`)."""
    full = [Cell("full_local", 1, workload=MANY)]
    return full + [Cell("full_remote", n, workload=MANY) for n in spec.drafter_counts]


def _is_rtt_pair(cell: Cell, spec: StreamSpec) -> bool:
    """x = the largest, one drafter: the cell whose latency is measured."""
    return (
        spec.rtt_latency_s > 0 and cell.num_drafters == 1 and cell.draft_len == max(spec.draft_lens)
    )


def cell_record(cell: Cell, samples: list[dict]) -> dict:
    rates = [s["tokens_per_s"] for s in samples]
    return {
        **asdict(cell),
        "name": cell.name,
        "tokens_per_s": statistics.median(rates),
        "tokens_per_s_min": min(rates),
        "tokens_per_s_max": max(rates),
        "samples": samples,
    }
