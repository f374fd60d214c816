"""Long-context decoding on one machine (the paper's Pipeline 1).

The compressed KV of every running request stays on the device; its full KV lives in host memory
(`HostKV`) and is loaded for each verification, asynchronously (`KVLoader`), started S iterations
ahead so that the load overlaps drafting. A `StaggeredScheduler` (or the lock-step baseline, with
`LongContextConfig.lockstep_draft_len`) plans every iteration within a device-memory budget, and
a `DeviceMemory` accountant enforces that budget on what is really held: the weights, the resident
compressed KV and the full KV being loaded or verified. Requests whose mode is `FULL` run the
baseline under the same accountant: each keeps its full KV on the device while it runs, so
floor((budget - weights) / full KV) run at once and the rest queue.

One iteration of VeriCache requests:
    plan = scheduler.schedule()
    start plan.loads (host -> device, in the background)
    one forward: a draft step over plan.draft_ids (compressed KV, fast attention) and the
        verification of plan.verifies over their full KV with the batch-invariant kernels,
        through the engine's `SequenceForward`: greedy output equals full decoding (where a load of
        plan.verifies is late, the draft step runs alone first, then the verification waits)
    append the committed tokens' exact KV to the host copy (and, by default, the compressed KV);
        free the loaded full KV; report each verification; end the iteration with its time, less
        any wait for a late load

Rounds follow the scheduler's convention, as the engine's do: a round of d draft tokens takes d + 1
iterations, the verification in its own iteration. The scheduler picks d: the request's draft_len
first, never under S. A round drafts fewer when the token budget, the context or an end token says
so (`Sequence.begin_round`), and verifies when planned.

A request is prefilled on the device when its full KV fits (for VeriCache, with the compressed KV
made from it, at its bound `compressed_prefill_bound`); the full KV then moves to host memory and
the compressed KV is parked in host memory until the scheduler first admits the request, since the
scheduler counts a compressed KV from its admission on.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

from vericache.engine.calibration import calibrated_costs
from vericache.engine.device_memory import (
    DeviceMemory,
    compressed_element_size,
    compressed_kv_bound,
    compressed_token_bytes,
    device_memory_bytes,
    full_kv_bytes,
    full_kv_capacity,
)
from vericache.engine.engine_config import EngineConfig
from vericache.engine.host_kv import (
    HostKV,
    KVLoader,
    LoadedKV,
    PendingLoad,
    move_compressed,
)
from vericache.engine.long_context_config import LongContextConfig, LongContextStats
from vericache.engine.long_context_fit import check_fits, prefill_bytes
from vericache.engine.prefill import Prefiller, SequenceStarter
from vericache.engine.prefix_caches import OwnPrefixes
from vericache.engine.request import DecodeMode, Request, RequestOutput, TokenLogprob
from vericache.engine.sequence import Sequence
from vericache.engine.sequence_forward import SequenceForward
from vericache.errors import InvalidRequestError
from vericache.kv.compressed import CompressedKV
from vericache.kv.exact import ExactKV
from vericache.model.loader import DEFAULT_MODEL, load_model
from vericache.model.runner import ModelRunner
from vericache.scheduler import (
    BaseScheduler,
    IterationPlan,
    LoadStart,
    LockstepScheduler,
    RequestState,
    SchedulerRequest,
    SchedulerStateError,
    StaggeredScheduler,
    Verify,
)
from vericache.scheduler.adaptive import bounded_adaptive_draft_len


class LongContextEngine:
    """Decodes many long-context requests within a device-memory budget.

    `generate(requests)` runs them all; `add_request` and `run_iteration` drive the engine one
    iteration at a time (for a server). One mode at a time: VERICACHE requests (long-context
    mode) or FULL requests (the full-KV baseline under the same budget). `close()` stops the
    loader thread.

    It starts and steps its sequences with the engine's parts (`SequenceStarter`,
    `SequenceForward`); what it adds is where their KV lives and when each round begins.
    """

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer=None,
        config: EngineConfig = EngineConfig(),
        long_context: LongContextConfig | None = None,
    ):
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config
        self.model_config = runner.config
        prefiller = Prefiller(runner, tokenizer, config)
        # Not the prefix store: its shared KV would sit on the device outside the budget.
        self.starter = SequenceStarter(prefiller, OwnPrefixes(prefiller))
        self.forward = SequenceForward(runner, config)
        long_context = long_context or LongContextConfig()
        self.long_context = long_context
        budget = long_context.memory_budget_bytes or device_memory_bytes(runner.device)
        self.memory = DeviceMemory(budget, runner.weights.nbytes)
        self.loader = KVLoader(runner.device, long_context.link_bytes_per_s)
        self.scheduler = self._new_scheduler()
        self.stats = LongContextStats()
        self._is_cuda = runner.device.type == "cuda"
        self._pending: deque[tuple[str, Request]] = deque()  # not prefilled yet
        self._running: dict[str, Sequence] = {}  # prefilled, unfinished
        self._host: dict[str, HostKV] = {}
        self._loads: dict[str, PendingLoad] = {}
        self._parked: set[str] = set()  # compressed KV in host memory until first admitted
        self._num_added = 0
        self._num_idle = 0

    @classmethod
    def from_pretrained(
        cls,
        model: str = DEFAULT_MODEL,
        dtype="float32",
        device="cpu",
        config=EngineConfig(),
        long_context: LongContextConfig | None = None,
    ) -> LongContextEngine:
        loaded = load_model(model, dtype=dtype, device=device)
        runner = ModelRunner(loaded.config, loaded.weights, device, config.static_shapes)
        return cls(runner, loaded.tokenizer, config, long_context)

    def close(self) -> None:
        self.loader.close()

    def __enter__(self) -> LongContextEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- requests -------------------------------------------------------------------------------

    def generate(
        self,
        requests: Iterable[Request],
        on_finished: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Decodes every request; `on_finished` hears of each one as it finishes."""
        keys = [self.add_request(request) for request in requests]
        outputs: dict[str, RequestOutput] = {}
        while self.has_unfinished:
            finished = self.run_iteration()
            if on_finished is not None:
                for output in finished.values():
                    on_finished(output)
            outputs |= finished
        return [outputs[key] for key in keys]

    def add_request(self, request: Request) -> str:
        """Queues a request; returns the key its output will come under."""
        if request.mode is DecodeMode.LOSSY:
            raise InvalidRequestError("long-context decoding runs vericache or full requests")
        modes = {r.mode for _, r in self._pending} | {s.mode for s in self._running.values()}
        if modes - {request.mode}:
            raise InvalidRequestError("long-context decoding runs one mode at a time")
        element_size = self.runner.dtype.itemsize
        check_fits(request, self.memory, self.scheduler, self.model_config, element_size)
        key = f"lc{self._num_added}"
        self._num_added += 1
        self._pending.append((key, request))
        return key

    def abort(self, key: str) -> None:
        """Forgets an unfinished request and frees what it holds; call between iterations."""
        pending = next((item for item in self._pending if item[0] == key), None)
        if pending is not None:
            self._pending.remove(pending)
            return
        if key not in self._running:
            raise KeyError(f"no unfinished request {key!r}")
        load = self._loads.pop(key, None)
        if load is not None:
            load.wait()  # the loader thread is still writing into its buffers
        if self._running[key].mode is DecodeMode.VERICACHE:
            self.scheduler.abort(key)
        self._forget(key)

    def output_ids(self, key: str) -> list[int]:
        """The output tokens an unfinished request has committed so far (drafts excluded; []
        before its prefill)."""
        seq = self._unfinished(key)
        return [] if seq is None else list(seq.output_ids)

    def output_logprobs(self, key: str) -> list[TokenLogprob]:
        """Their log-probabilities, where the request asks for them ([] where not)."""
        seq = self._unfinished(key)
        return [] if seq is None else list(seq.logprobs)

    def _unfinished(self, key: str) -> Sequence | None:
        """An unfinished request's sequence; None before its prefill."""
        if any(item[0] == key for item in self._pending):
            return None
        if key not in self._running:
            raise KeyError(f"no unfinished request {key!r}")
        return self._running[key]

    @property
    def has_unfinished(self) -> bool:
        return bool(self._pending or self._running)

    def run_iteration(self) -> dict[str, RequestOutput]:
        """Prefills what fits, then runs one iteration; returns the requests that finished."""
        start = time.perf_counter()
        finished = self._admit_pending()
        prefilled = time.perf_counter()
        if any(seq.mode is DecodeMode.FULL for seq in self._running.values()):
            finished |= self._full_iteration()
        elif self.scheduler.has_requests:
            finished |= self._vericache_iteration()
        self.stats.prefill_s += prefilled - start
        self.stats.decode_s += time.perf_counter() - prefilled
        self.stats.num_iterations += 1
        self.stats.peak_device_bytes = self.memory.peak_bytes
        self.stats.peak_full_kv_bytes = self.memory.kind_peak_bytes.get("full", 0)
        self.stats.peak_compressed_kv_bytes = self.memory.kind_peak_bytes.get("compressed", 0)
        return finished

    # -- admission and prefill ------------------------------------------------------------------

    def _admit_pending(self) -> dict[str, RequestOutput]:
        finished = {}
        while self._pending:
            key, request = self._pending[0]
            is_vericache = request.mode is DecodeMode.VERICACHE
            if is_vericache and len(self._parked) >= self.long_context.max_parked:
                break
            needed = prefill_bytes(request, self.model_config, self.runner.dtype.itemsize)
            if not self.memory.fits(needed):
                break  # FIFO: later requests wait too
            self._pending.popleft()
            seq = self._start_request(key, request)
            if seq.is_finished:
                finished[key] = self._finish(key, seq)
        return finished

    def _start_request(self, key: str, request: Request) -> Sequence:
        """Prefills on the device; a VeriCache request's full KV then moves to host memory and its
        compressed KV is parked until the scheduler admits it."""
        full_bytes = full_kv_bytes(request, self.model_config, self.runner.dtype.itemsize)
        self.memory.hold(("full", key), full_bytes)
        try:
            seq = self.starter.start(request)
        except Exception:
            self.memory.release(("full", key))
            raise
        self._running[key] = seq
        if seq.is_finished or seq.mode is DecodeMode.FULL:
            return seq
        resident_bytes = seq.compressed_cache.resident_bytes
        self.memory.hold(("compressed", key), resident_bytes)
        # Its host copy holds the prefix too (prefilled into its own full KV, `OwnPrefixes`).
        max_positions = self.model_config.max_position_embeddings
        capacity = full_kv_capacity(request, max_positions, shares_prefix=False)
        self._host[key] = HostKV.from_cache(seq.full_cache, capacity, pin=self._is_cuda)
        seq.full_cache = None
        self.memory.release(("full", key))
        if self._is_cuda:
            seq.compressed_cache = move_compressed(seq.compressed_cache, "cpu")
        self.memory.release(("compressed", key))
        self._parked.add(key)
        element_size = self.runner.dtype.itemsize
        bound = compressed_kv_bound(resident_bytes, request, self.model_config, element_size)
        try:
            self.scheduler.add_request(
                SchedulerRequest(key, full_bytes, bound, self._preferred_draft_len(seq))
            )
        except Exception:
            self._forget(key)
            raise
        return seq

    def _unpark(self, key: str) -> None:
        if key not in self._parked:
            return
        seq = self._running[key]
        if self._is_cuda:
            seq.compressed_cache = move_compressed(
                seq.compressed_cache, self.runner.device, self.runner.rope
            )
        self._parked.discard(key)
        self._hold_compressed(key, seq.compressed_cache)

    def _hold_compressed(self, key: str, cache: CompressedKV, num_tentative: int = 0) -> None:
        """Holds a compressed KV's bytes, and room for `num_tentative` draft tokens to come (so
        that drafting needs no accounting per token)."""
        element_size = compressed_element_size(
            self._running[key].request, self.runner.dtype.itemsize
        )
        tentative = num_tentative * compressed_token_bytes(self.model_config, element_size)
        self.memory.hold(("compressed", key), cache.resident_bytes + tentative)

    @staticmethod
    def _preferred_draft_len(seq: Sequence) -> int:
        return max(1, seq.drafts_wanted(seq.request.draft_len))

    def _choose_draft_len(self, state: RequestState) -> int:
        """The scheduler's draft-length policy: the request's own length, or for an adaptive
        request the one its acceptance and the scheduler's costs favour (at most that length,
        which is its upper bound)."""
        seq = self._running[state.request_id]
        if not seq.request.adaptive_draft_len:
            return state.draft_len
        return self._adaptive(state)

    # -- iterations -----------------------------------------------------------------------------

    def _full_iteration(self) -> dict[str, RequestOutput]:
        self.stats.max_running = max(self.stats.max_running, len(self._running))
        self.forward.run([], list(self._running.values()))  # one batched full decode step
        done = [(key, seq) for key, seq in self._running.items() if seq.is_finished]
        return {key: self._finish(key, seq) for key, seq in done}

    def _vericache_iteration(self) -> dict[str, RequestOutput]:
        plan = self.scheduler.schedule()
        for key in (*plan.draft_ids, *(load.request_id for load in plan.loads)):
            self._unpark(key)
        for load in plan.loads:
            self._start_load(load)
        num_resident = len(self._running) - len(self._parked)
        self.stats.max_running = max(self.stats.max_running, num_resident)
        start = time.perf_counter()
        drafts = self._draft_batch(plan.draft_ids)
        # The draft step shares the verification's forward (one read of the weights) unless a
        # late load would hold it up; then it runs alone while the load ends.
        shares_forward = bool(plan.verifies) and all(
            self._loads[verify.request_id].done() for verify in plan.verifies
        )
        if drafts and not shares_forward:
            self.forward.run(drafts, [])  # appends one draft token to each
        stall_s, finished = self._verify(plan.verifies, drafts if shares_forward else [])
        has_drafted = bool(drafts)
        # A wait for a late load is link time, not compute, and an iteration whose requests all
        # wait for their verification says nothing of compute time either.
        elapsed = time.perf_counter() - start - stall_s
        is_timed = (has_drafted or plan.verifies) and elapsed > 0
        self.scheduler.end_iteration(elapsed if is_timed else None)
        self._check_progress(plan)
        return finished

    def _start_load(self, load: LoadStart) -> None:
        key = load.request_id
        self.memory.hold(("full", key), load.num_bytes)
        self._loads[key] = self.loader.start(self._host[key])
        self.stats.num_loads += 1

    def _draft_batch(self, keys: tuple[str, ...]) -> list[Sequence]:
        """The requests that take a draft step this iteration (a round begins where none runs)."""
        drafting = [(key, self._running[key]) for key in keys]
        for key, seq in drafting:
            if seq.num_drafts is None:  # a round begins, of the scheduler's draft length
                reservation = self.scheduler.request_state(key).reservation
                num_drafts = seq.begin_round(reservation.num_drafts)
                self._hold_compressed(key, seq.compressed_cache, num_drafts)
        return [seq for _, seq in drafting if seq.needs_compressed_forward]

    def _verify(
        self, verifies: tuple[Verify, ...], drafts: list[Sequence]
    ) -> tuple[float, dict[str, RequestOutput]]:
        """One batched verification, in one forward with the draft step of `drafts`; returns the
        time spent waiting for loads, and the requests that finished."""
        if not verifies:
            return 0.0, {}
        batch, stall_s = [], 0.0
        for verify in verifies:
            key = verify.request_id
            seq = self._running[key]
            loaded = self._loads.pop(key).wait()
            self._record_load(loaded)
            stall_s += loaded.stall_s
            seq.full_cache = loaded.cache
            batch.append((key, seq, loaded.cache.num_tokens))
        # Drafts get one token each; verifications finish their rounds.
        self.forward.run(drafts, [seq for _, seq, _ in batch])
        finished = {}
        for key, seq, num_verified_before in batch:
            num_accepted = seq.stats.accepted_per_round[-1]
            if seq.is_finished:
                self.scheduler.on_verified(key, num_accepted, is_finished=True)
                finished[key] = self._finish(key, seq)
                continue
            full = seq.full_cache
            self._host[key].append(ExactKV.of(full, num_verified_before, full.num_tokens, False))
            seq.full_cache = None
            self.memory.release(("full", key))
            self._hold_compressed(key, seq.compressed_cache)
            self.scheduler.on_verified(key, num_accepted, is_finished=False)
            self.scheduler.set_draft_len(key, self._preferred_draft_len(seq))
        return stall_s, finished

    def _record_load(self, loaded: LoadedKV) -> None:
        self.stats.load_bytes += loaded.num_bytes
        self.stats.num_late_loads += not loaded.was_ready
        self.stats.stall_s += loaded.stall_s
        if loaded.num_bytes and loaded.load_s > 0:
            self.scheduler.costs.observe_load(loaded.num_bytes, loaded.load_s)

    def _check_progress(self, plan: IterationPlan) -> None:
        self._num_idle = self._num_idle + 1 if plan.is_idle and not self._loads else 0
        if self._num_idle > 4 * self.scheduler.config.window:
            raise SchedulerStateError(
                f"no request ran for {self._num_idle} iterations: "
                f"{self.scheduler.num_waiting} waiting for admission"
            )

    def _finish(self, key: str, seq: Sequence) -> RequestOutput:
        self._forget(key)
        out = seq.output()
        self.stats.num_finished += 1
        self.stats.num_output_tokens += len(out.token_ids)
        return out

    def _forget(self, key: str) -> None:
        del self._running[key]
        for kind in ("full", "compressed"):
            self.memory.release((kind, key))
        self._host.pop(key, None)
        self._parked.discard(key)
        self._loads.pop(key, None)

    # -- start-up -------------------------------------------------------------------------------

    def _new_scheduler(self) -> BaseScheduler:
        lc = self.long_context
        costs = calibrated_costs(self.runner, self.memory, lc)
        if lc.lockstep_draft_len is not None:
            return LockstepScheduler(costs, lc.lockstep_draft_len, lc.scheduler)
        scheduler = StaggeredScheduler(costs, lc.scheduler)
        self._adaptive = bounded_adaptive_draft_len(scheduler)
        scheduler.choose_draft_len = self._choose_draft_len
        return scheduler
