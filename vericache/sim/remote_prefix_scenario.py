"""A Pipeline 2 deployment to simulate: G_local verifiers beside the full-KV store and G_remote
drafters across a slow network, each worker a device or a tensor-parallel group of them.

Memory, stated: each worker keeps `activation_reserve` of its devices' memory from the KV, and the
rest beside the weights is its KV room, shared by its sessions' own KV and the prefixes they share,
one copy of each (kv_memory.WorkerMemory), within a prefix budget where one is set. With tensor
parallelism over g devices a worker holds 1/g of the weights and of every KV on each device, and
each device moves its share over its own link at once: the worker's links carry g times one
device's bandwidth.

What a well-run deployment adds, each a switch (off by default, as the CPU benchmarks' workers
run): a host-memory tier on every node (host_tier.py), recomputing a prefix where that beats
fetching it, shared-prefix (cascade) attention, and VeriCache's warm drafter nodes, which verify
their own sessions once a prefix's full KV has reached their host tier (remote_prefix.py).
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass

from vericache.errors import InvalidRequestError
from vericache.kv.slots import own_full_kv_slots, reserved_full_kv_bytes
from vericache.sim.cost import ForwardCost, Row, forward_cost
from vericache.sim.profiles import DeviceProfile, ModelProfile
from vericache.sim.steering_link import refresh_bytes, refresh_bytes_per_round
from vericache.sim.workload import AcceptanceTrace, OutputLengths


@dataclass(frozen=True)
class RemotePrefixScenario:
    model: ModelProfile
    device: DeviceProfile  # every verifier and drafter
    num_verifiers: int
    num_drafters: int
    prefix_tokens: int
    num_prefixes: int  # each request's prefix is drawn uniformly (seeded), or in turn
    suffix_tokens: int  # the prompt after its prefix
    compressed_ratio: float  # compressed KV bytes / full KV bytes (KIVI 4-bit: about 0.27)
    store_bytes_per_s: float  # the store to each verifier
    network_bytes_per_s: float  # the store side to each drafter
    network_latency_s: float
    draft_len: int
    arrivals: tuple[float, ...]  # one per request (ignored but for their count with concurrency)
    output_lengths: OutputLengths
    acceptance: AcceptanceTrace
    seed: int = 0
    # Where set, session i's rounds accept these drafts in turn (no more than each drafts), as a
    # benchmark's greedy requests accept the same in every serve; past them, `acceptance` draws.
    accepted_by_session: tuple[tuple[int, ...], ...] = ()
    tensor_parallel: int = 1  # devices per worker
    # True: a worker keeps a prefix's KV for every session over it, and after them (a paged
    # server's prefix caching); False: every session fetches its own copy (the paper's accounting)
    prefix_caching: bool = True
    concurrency: int | None = None  # a closed loop of this many requests in flight
    # A closed loop's first this many sessions, served to their end before the others start: a
    # benchmark's untimed first wave, which leaves the workers' caches warm and its pipeline
    # empty (the report's `timed_from_s` and `untimed_tokens` say where the rest began).
    warmup_sessions: int = 0
    element_size: int = 2  # bytes per weight, activation and KV element (bf16; float32: 4)
    # The prefix's tokens the compressed KV keeps: all (1.0) where it quantizes, 1/ratio where it
    # drops tokens; drafts attend over these, at compressed_ratio of the full bytes in all.
    compressed_token_share: float = 1.0
    activation_reserve: float = 0.1  # share of each device's memory kept from the KV
    # Where set, a role's workers hold the prefixes they share within this many bytes, apart
    # from their sessions' own KV (kv_memory.WorkerMemory.prefix_budget_bytes), as VeriCache's
    # do: VerifierConfig.prefix_cache_bytes, DrafterConfig.kv_cache_bytes. None: within the KV
    # room alone, as the served workers' default (what the device has left) does.
    verifier_prefix_cache_bytes: int | None = None
    drafter_prefix_cache_bytes: int | None = None
    prefixes_in_turn: bool = False  # request i asks prefix i % num_prefixes (bench remote-prefix)
    # How fast a drafter's host takes in a prefix fetched over the network (decoding its wire
    # format, checking it), one at a time beside the device's forwards, in bytes/s; None: at once.
    network_receive_bytes_per_s: float | None = None
    # Where set, a verifier keeps sessions' own full KV as VeriCache's does (VerifierConfig.
    # resident_bytes, sim/residency.py): at most this many bytes between calls, the least
    # recently used dropped when another needs room and rebuilt over the shared prefix by its
    # next call. None: a per-request session holds its KV from open to end (WorkerMemory), and
    # scheduled rounds load the prefix's full KV for every verification.
    verifier_resident_bytes: int | None = None
    # Where set, every node keeps prefixes' KV in this many bytes of host memory (host_tier.py):
    # what its device evicts and what arrives over its links, brought back over its host link
    # (the device profile's host_to_device_bytes_per_s). None: no host tier.
    host_tier_bytes: int | None = None
    # A worker prefills a full prefix it lacks where the cost model makes that sooner than the
    # fetch over its link.
    recompute_prefixes: bool = False
    # A forward reads a shared prefix's KV once for all its rows over that copy (cascade
    # attention, as the served CUDA kernels do), for every kind of row.
    shared_prefix_attention: bool = False
    # VeriCache's drafter nodes stream a prefix's full KV into their host tier in the background
    # once they draft over it, and then verify their sessions over it themselves.
    warm_nodes: bool = False
    # Sequential turns: a session is this many requests (turns), each arriving when the one before
    # it ends, its prompt the one before with that turn's output and a new suffix appended.
    turns_per_session: int = 1
    prefill_chunk_tokens: int = 2048  # a prefill's tokens per forward (chunked prefill)
    # Every worker on one machine's memory system (a CPU's workers, as the benchmarks serve them):
    # a forward runs the device's measured co-runner slowdown beyond 1 slower for each other
    # worker computing as it starts, as `mode: auto` prices it (serve/backends/path_costs.py).
    # False: each worker has its device's memory to itself (a GPU's).
    workers_share_memory: bool = False
    # Where the workers share one machine's cores (a CPU's): how many, and the serving work outside
    # forwards per forward, CPU seconds (the workers' RPCs and job handling, the coordinator, the
    # client). It runs on a core no forward needs, and while every core runs a worker's forwards
    # it takes its time from them: each forward then lasts that much longer. None: a device of
    # its own per worker, and a host that keeps up.
    machine_cores: int | None = None
    host_cpu_s_per_forward: float = 0.0
    # VERICACHE: every this many rounds a central verifier refreshes the drafter's kept set over
    # the link (sim/steering_link.py); a warm node refreshes in place. 0: never.
    steer_every: int = 0
    # The kept tokens are a composition's quantized groups (snapkv+kivi): a refresh resends them.
    compressed_groups: bool = False

    def __post_init__(self):
        counts = (self.num_verifiers, self.num_drafters, self.prefix_tokens, self.num_prefixes)
        if min(*counts, self.suffix_tokens, self.draft_len) < 1 or not self.arrivals:
            raise InvalidRequestError("a scenario needs workers, prefixes, a suffix and requests")
        if not 0 < self.compressed_ratio <= 1 or self.network_latency_s < 0:
            raise InvalidRequestError("compressed_ratio lies in (0, 1], latency >= 0")
        if not 0 < self.compressed_token_share <= 1:
            raise InvalidRequestError("compressed_token_share lies in (0, 1]")
        if self.concurrency is not None and self.concurrency < 1:
            raise InvalidRequestError("concurrency must be >= 1")
        if self.warmup_sessions and (
            self.concurrency is None or not 0 < self.warmup_sessions < len(self.arrivals)
        ):
            raise InvalidRequestError(
                "warmup_sessions needs a concurrency and leaves some of the arrivals after it"
            )
        receive = self.network_receive_bytes_per_s
        if receive is not None and not receive > 0:
            raise InvalidRequestError("network_receive_bytes_per_s must be > 0")
        resident = self.verifier_resident_bytes
        room = self.kv_room_bytes - self.prefix_bytes(compressed=False)
        if resident is not None and not 0 < resident <= room:
            raise InvalidRequestError(
                "verifier_resident_bytes must be > 0 and leave a prefix's full KV room beside it "
                "in kv_room_bytes"
            )
        budgets = (self.verifier_prefix_cache_bytes, self.drafter_prefix_cache_bytes)
        if any(size is not None and size < 1 for size in budgets):
            raise InvalidRequestError("a prefix cache's bytes must be >= 1")
        if self.tensor_parallel < 1 or not 0 <= self.activation_reserve < 1:
            raise InvalidRequestError("tensor_parallel >= 1, activation_reserve in [0, 1)")
        if self.kv_room_bytes <= 0:
            raise InvalidRequestError(
                f"{self.model.name}'s weights leave no KV room on {self.tensor_parallel} x "
                f"{self.device.name}: raise tensor_parallel"
            )
        self._check_turns_and_tiers()

    def _check_turns_and_tiers(self) -> None:
        if self.turns_per_session < 1 or self.prefill_chunk_tokens < 1:
            raise InvalidRequestError("turns_per_session and prefill_chunk_tokens must be >= 1")
        if self.steer_every < 0:
            raise InvalidRequestError("steer_every must be >= 0")
        longest = self.prefix_tokens + self.turns_per_session * self.suffix_tokens
        longest += (self.turns_per_session - 1) * max(self.output_lengths.lengths)
        if longest >= self.model.max_positions:
            raise InvalidRequestError(
                f"a prompt of {longest} tokens leaves no room in {self.model.name}'s context of "
                f"{self.model.max_positions}"
            )
        if self.host_tier_bytes is not None and self.host_tier_bytes < 1:
            raise InvalidRequestError("host_tier_bytes must be >= 1")
        if self.warm_nodes and (self.host_tier_bytes is None or not self.prefix_caching):
            raise InvalidRequestError("warm nodes need a host tier and prefix caching")

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token(self.element_size)

    def prefix_bytes(self, compressed: bool) -> int:
        ratio = self.compressed_ratio if compressed else 1.0
        return int(self.prefix_tokens * self.kv_bytes_per_token * ratio)

    def refresh_bytes_due(self, rounds_verified: int) -> float:
        """The kept-set refresh a central verifier sends with a session's next draft call after
        its `rounds_verified`-th round (0 bytes where none is due)."""
        due = self.steer_every and rounds_verified and rounds_verified % self.steer_every == 0
        if not due:
            return 0.0
        compressed, head_dim = self.prefix_bytes(compressed=True), self.model.head_dim
        return refresh_bytes(compressed, head_dim, self.compressed_groups, self.steer_every)

    def refresh_bytes_per_round(self) -> float:
        """Those refreshes' bytes a round, on average."""
        compressed, head_dim = self.prefix_bytes(compressed=True), self.model.head_dim
        return refresh_bytes_per_round(
            compressed, self.steer_every, head_dim, self.compressed_groups
        )

    def row(
        self,
        num_new: int,
        num_after_prefix: int,
        compressed: bool,
        prefix_key: Hashable | None = None,
    ) -> Row:
        """A row over the prefix (the tokens its compressed KV keeps, or all of them) and
        `num_after_prefix` exact tokens; read once per forward with the other rows over the
        worker's copy `prefix_key`, where the deployment has shared-prefix attention."""
        share = self.compressed_token_share if compressed else 1.0
        context = math.ceil(self.prefix_tokens * share) + num_after_prefix
        prefix_bytes = self.prefix_bytes(compressed)
        kv_bytes = prefix_bytes + num_after_prefix * self.kv_bytes_per_token
        if not self.shared_prefix_attention or prefix_key is None:
            return Row(num_new, context, kv_bytes / context, is_full_kv=not compressed)
        return Row(
            num_new, context, kv_bytes / context, is_full_kv=not compressed,
            shared_prefix=prefix_key, shared_kv_bytes=prefix_bytes,
        )  # fmt: skip

    def prefill_rows(
        self, num_new: int, num_after_prefix: int, prefix_key: Hashable | None = None
    ) -> list[Row]:
        """A prefill over the full KV of `num_new` tokens that follow `num_after_prefix` exact ones
        past the prefix, one row per chunk."""
        chunk = self.prefill_chunk_tokens
        return [
            self.row(min(chunk, num_new - start), num_after_prefix + start, False, prefix_key)
            for start in range(0, num_new, chunk)
        ]

    def prefix_prefill_rows(self) -> list[Row]:
        """A prefix's prefill on a worker that recomputes it, one row per chunk."""
        chunk = self.prefill_chunk_tokens
        starts = range(0, self.prefix_tokens, chunk)
        size = self.kv_bytes_per_token
        return [Row(min(chunk, self.prefix_tokens - start), start, size, True) for start in starts]

    def prompt_tokens(self, history_tokens: int) -> int:
        """A turn's prompt: the prefix, and what earlier turns added and its suffix after it."""
        return self.prefix_tokens + self.tokens_after_prefix(history_tokens)

    def tokens_after_prefix(self, history_tokens: int, num_output_tokens: int = 0) -> int:
        """A turn's tokens past its prefix, each with exact KV of its own: what its session's
        earlier turns added, its suffix, and its output so far."""
        return history_tokens + self.suffix_tokens + num_output_tokens

    @property
    def kv_room_bytes(self) -> int:
        """A worker's memory for KV once its weights are loaded, over its devices."""
        memory = self.tensor_parallel * self.device.memory_bytes * (1 - self.activation_reserve)
        return int(memory) - self.weights_bytes

    @property
    def memory_budget_bytes(self) -> int:
        """What a scheduler plans within on a worker: its memory less the reserve."""
        return self.kv_room_bytes + self.weights_bytes

    @property
    def weights_bytes(self) -> int:
        """A worker's weights, over its devices."""
        return self.model.weights_bytes(self.element_size)

    def reserved_full_kv_bytes(self, max_output_tokens: int) -> int:
        """A session's full KV on a verifier as the verifier allocates it (kv/slots.py): whole
        blocks of slots for the prompt, every output token and one round's drafts."""
        return reserved_full_kv_bytes(
            self.prefix_tokens + self.suffix_tokens,
            max_output_tokens,
            self.draft_len,
            self.model.max_positions,
            self.model.slot_bytes(self.element_size),
        )

    def reserved_own_full_kv_bytes(self, max_output_tokens: int) -> int:
        """What the verifier's residency counts of a session: its reservation past its prefix,
        which it reads in place from the shared copy (kv/prefixed.py)."""
        own_slots = own_full_kv_slots(
            self.prefix_tokens + self.suffix_tokens,
            max_output_tokens,
            self.draft_len,
            self.model.max_positions,
            self.prefix_tokens,
        )
        return own_slots * self.model.slot_bytes(self.element_size)

    def forward_cost(self, rows: list[Row]) -> ForwardCost:
        size = self.element_size
        return forward_cost(self.model, self.device, rows, size, size, self.tensor_parallel)

    def forward_s(self, rows: list[Row]) -> float:
        return self.forward_cost(rows).seconds

    def host_work_s(self, num_computing: int) -> float:
        """What each forward waits for the serving work outside forwards while `num_computing`
        workers compute on the machine: `host_cpu_s_per_forward` once they fill its cores, else
        none (a free core runs it)."""
        if self.machine_cores is None or num_computing < self.machine_cores:
            return 0.0
        return self.host_cpu_s_per_forward
