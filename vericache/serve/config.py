"""Settings of the serving pieces: plain frozen dataclasses, cheap to import (no Ray, no LMCache),
checked when made, passed to workers and actors as they are."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from vericache.engine.link import LinkSpec
from vericache.errors import InvalidRequestError
from vericache.model.loader import DEFAULT_MODEL, DTYPES
from vericache.scheduler import SchedulerConfig
from vericache.serve.api_types import CompressorChoice
from vericache.serve.cluster_secret import ClusterSecret
from vericache.sim.profiles import device_profile


@dataclass(frozen=True)
class WorkerConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "float32"
    device: str = "cpu"  # or "auto": CUDA where the worker finds it, else the CPU
    # torch threads of this worker's process; None keeps torch's default.
    num_threads: int | None = None
    # The server's secret (cluster_secret.py), set by whatever starts the workers; never shown.
    secret: ClusterSecret | None = field(default=None, repr=False)
    # Finished turns' full KV after their prefix, for a later request that repeats them to reuse
    # (turn_cache.py: an agent's next call, a chat's next turn): a verifier's sessions', a
    # drafter's FULL_REMOTE ones'; 0: none.
    turn_cache_bytes: int = 1 << 30
    # Host memory for the kept turns the device's budget pushes out (pinned on CUDA); 0: none.
    turn_host_bytes: int = 0

    @property
    def kept_turn_bytes(self) -> int:
        """All it may keep of finished turns, on its device and in host memory."""
        return self.turn_cache_bytes + self.turn_host_bytes

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise InvalidRequestError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise InvalidRequestError(f"num_threads must be >= 1, got {self.num_threads}")
        if min(self.turn_cache_bytes, self.turn_host_bytes) < 0:
            raise InvalidRequestError(
                f"turn_cache_bytes and turn_host_bytes must be >= 0, got {self.turn_cache_bytes} "
                f"and {self.turn_host_bytes}"
            )


@dataclass(frozen=True)
class VerifierConfig(WorkerConfig):
    root: Path = Path("vericache-store")  # the store's fs:// tier and the prefix catalog
    store_cpu_bytes: int = 1 << 30  # LMCache's CPU tier
    resident_bytes: int = 4 << 30  # full KV kept between rounds, over all sessions
    # One copy per prefix, shared by its sessions; None: what the GPU has left after the weights,
    # `resident_bytes` and `turn_cache_bytes`, a quarter of the RAM on CPU (device_memory.py
    # `prefix_budget_left`).
    prefix_cache_bytes: int | None = None
    link: LinkSpec = LinkSpec()  # toward the drafters
    # Host-to-device path of full-KV loads from the store (PCIe): None, as fast as the copy goes;
    # bytes/s to hold them to (emulates PCIe on CPU, as the long-context mode's loads).
    load_bandwidth: float | None = None
    # Where the KVTransfer service listens (None: loopback here, the node's address on Ray).
    transfer_host: str | None = None
    transfer_port: int = 0
    prefill_chunk: int = 512
    # Prefilled full KV of prefixes being registered (see staging.py): a registration abandoned
    # between its calls leaves its entry, dropped after this long unused or past this count.
    staged_ttl_s: float = 300.0
    max_staged_prefixes: int = 4
    # A scheduled round's verification waits this long at most for its drafts to come.
    draft_wait_s: float = 120.0

    def __post_init__(self):
        super().__post_init__()
        if self.load_bandwidth is not None and not self.load_bandwidth > 0:
            raise InvalidRequestError(f"load_bandwidth must be > 0, got {self.load_bandwidth}")
        if not self.draft_wait_s > 0:
            raise InvalidRequestError(f"draft_wait_s must be > 0, got {self.draft_wait_s}")
        if self.prefix_cache_bytes is not None and self.prefix_cache_bytes < 1:
            raise InvalidRequestError(
                f"prefix_cache_bytes must be 1 byte or more, got {self.prefix_cache_bytes}"
            )
        if not self.staged_ttl_s > 0 or self.max_staged_prefixes < 1:
            raise InvalidRequestError(
                f"staged_ttl_s must be > 0 and max_staged_prefixes >= 1, got {self.staged_ttl_s} "
                f"and {self.max_staged_prefixes}"
            )


@dataclass(frozen=True)
class DrafterConfig(WorkerConfig):
    # Its copies of the prefixes it fetched, shared by its sessions; None: what the GPU has left
    # after the weights, a quarter of the RAM on CPU (device_memory.py `prefix_budget_left`).
    kv_cache_bytes: int | None = None
    prefill_chunk: int = 512
    # Its host-memory tier (warm_node.py): the full KV of the prefixes it drafts on, streamed
    # over the link in the background, over which it then verifies its own sessions. 0: none,
    # every verification stays on a verifier beside the store.
    host_tier_bytes: int = 0
    # A prefix's stream into the host tier ends past this (the node stays cold for it).
    host_tier_timeout_s: float = 600.0

    def __post_init__(self):
        super().__post_init__()
        if self.host_tier_bytes < 0 or not self.host_tier_timeout_s > 0:
            raise InvalidRequestError(
                f"host_tier_bytes must be >= 0 and host_tier_timeout_s > 0, got "
                f"{self.host_tier_bytes} and {self.host_tier_timeout_s}"
            )


SCHEDULING_POLICIES = ("per-request", "staggered", "lockstep")
DEFAULT_MODES = ("auto", "vericache")


@dataclass(frozen=True)
class CoordinatorConfig:
    default_draft_len: int = 30
    max_draft_len: int = 128
    default_max_tokens: int = 256
    max_output_tokens: int = 4096  # a request asking for more is INVALID_ARGUMENT
    max_running: int = 16  # requests decoding at once
    max_n: int = 16  # choices one OpenAI-API request may ask for (`n`), each a request
    max_waiting: int = 64  # requests queued beyond those; more are refused (RESOURCE_EXHAUSTED)
    # Waiting requests on a prefix resident on the workers go first (admission.py), but none
    # waits longer than this for requests that came after it.
    resident_first_max_skip_s: float = 2.0
    decode_chunk: int = 8  # tokens per call when one worker decodes alone (streaming granularity)
    # How VERICACHE rounds are driven (scheduled.py): "per-request" runs each request's rounds on
    # its own, batched only inside the workers; "staggered" plans every draft step, verification
    # and full-KV load across requests with the staggering scheduler; "lockstep" with the paper's
    # baseline (everyone drafts x, then everyone verifies).
    scheduling: str = "per-request"
    scheduler: SchedulerConfig = SchedulerConfig()
    # A request whose worker dies goes on elsewhere (distributed.py) this many times at most.
    max_migrations: int = 2
    # How long a migrating request waits for a worker of the kind it needs to be back.
    worker_wait_s: float = 60.0
    # Automatic prefix caching (auto_prefix.py): requests that name no prefix use their
    # tenant's longest matching one. A system turn of this many tokens or more, seen twice, is
    # registered by itself with `auto_prefix_compressor` (None: never), at most
    # `auto_prefix_max_per_tenant` per tenant, least recently used deleted first.
    auto_prefix_min_tokens: int | None = None
    auto_prefix_compressor: CompressorChoice = CompressorChoice("snapkv", ratio=4.0)
    auto_prefix_max_per_tenant: int = 8
    # The device profile `mode: auto` prices its paths with (path_costs.py): a bundled name or
    # the JSON `vericache calibrate` writes. "": the workers' GPU's datasheet, or a CPU's prior.
    cost_profile: str = ""
    # The mode of a request over a prefix that names none: "auto" (the fastest lossless path) or
    # "vericache". A request without a prefix is FULL_LOCAL either way.
    default_mode: str = "auto"

    def __post_init__(self):
        if self.scheduling not in SCHEDULING_POLICIES:
            raise InvalidRequestError(
                f"scheduling must be one of {SCHEDULING_POLICIES}, got {self.scheduling!r}"
            )
        counts = (self.default_draft_len, self.max_draft_len, self.default_max_tokens)
        if (
            min(*counts, self.max_running, self.max_n, self.decode_chunk) < 1
            or self.max_waiting < 0
        ):
            raise InvalidRequestError(f"coordinator settings out of range: {self}")
        if self.resident_first_max_skip_s < 0:
            raise InvalidRequestError(f"coordinator settings out of range: {self}")
        if self.default_draft_len > self.max_draft_len:
            raise InvalidRequestError("default_draft_len must not exceed max_draft_len")
        if self.default_mode not in DEFAULT_MODES:
            raise InvalidRequestError(
                f"default_mode must be one of {DEFAULT_MODES}, got {self.default_mode!r}"
            )
        if self.cost_profile:
            device_profile(self.cost_profile)  # read and checked now, not at the first request
        if self.auto_prefix_min_tokens is not None and self.auto_prefix_min_tokens < 1:
            raise InvalidRequestError("auto_prefix_min_tokens must be >= 1")
        if self.auto_prefix_max_per_tenant < 1:
            raise InvalidRequestError("auto_prefix_max_per_tenant must be >= 1")
        if self.default_max_tokens > self.max_output_tokens:
            raise InvalidRequestError("default_max_tokens must not exceed max_output_tokens")
        if self.max_migrations < 0 or not self.worker_wait_s >= 0:
            raise InvalidRequestError("max_migrations and worker_wait_s must be >= 0")
