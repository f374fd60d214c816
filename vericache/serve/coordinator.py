"""The coordinator: owns prefixes and requests, places them on workers, streams the output.

It speaks vericache.v1 messages (api.py maps them onto gRPC) and raises the typed errors of
vericache.errors for bad input; workers are `WorkerHandle`s, so the same coordinator runs over
in-process workers (tests, benchmarks) and Ray actors (`vericache serve`).

Every call runs for a `Tenant` (auth.py; the anonymous one without API keys): a tenant sees and uses
only its own prefixes (another's answers NOT_FOUND, as an unknown one does) within its limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import Counter
from collections.abc import AsyncIterator

from vericache.compress import build_compressor
from vericache.engine.prompt import build_chat_prompt
from vericache.engine.request import SamplingParams
from vericache.engine.stops import StopChecker
from vericache.errors import (
    InvalidRequestError,
    PrefixNotFoundError,
    QueueFullError,
    UnsupportedModelError,
    WorkerUnavailableError,
)
from vericache.serve.auth import ANONYMOUS, Tenant, TenantLimitError
from vericache.serve.catalog import (
    PrefixRecord,
    check_prefix_id,
    is_owned_by,
    owned_spec,
    prefix_id_for,
)
from vericache.serve.config import CoordinatorConfig
from vericache.serve.handles import WorkerHandle
from vericache.serve.metrics import ServeMetrics, metered
from vericache.serve.rounds import Mode, RequestPlan, ServedRequest, run_request
from vericache.serve.scheduled import ScheduledRounds, new_scheduled_rounds
from vericache.serve.worker import ModelInfo
from vericache.v1 import vericache_pb2 as pb

log = logging.getLogger(__name__)

_DRAFTER_MODES = (Mode.VERICACHE, Mode.FULL_REMOTE, Mode.LOSSY)


class Coordinator:
    def __init__(
        self,
        verifiers: list[WorkerHandle],
        drafters: list[WorkerHandle],
        tokenizer,
        config: CoordinatorConfig | None = None,
    ):
        self.verifiers = verifiers
        self.drafters = drafters
        self.tokenizer = tokenizer
        self.config = config = config or CoordinatorConfig()
        self.info: ModelInfo | None = None
        self._addresses: dict[str, str] = {}  # verifier name -> its KVTransfer address
        self._running = asyncio.Semaphore(config.max_running)
        self._num_waiting = 0
        self._registering: dict[str, asyncio.Lock] = {}
        self._num_active = Counter()  # tenant name -> its Generate and PutPrefix calls running
        self.metrics: ServeMetrics | None = None  # made at start, once the model is known
        self._num_running_requests = 0
        # Verifier name -> the schedule of its VERICACHE rounds; empty: each request on its own.
        self.schedules: dict[str, ScheduledRounds] = {}

    async def start(self) -> Coordinator:
        if not self.verifiers:
            raise WorkerUnavailableError("a coordinator needs at least one verifier")
        described = await asyncio.gather(*(v.call("describe") for v in self.verifiers))
        for verifier, about in zip(self.verifiers, described):
            self._addresses[verifier.name] = about["transfer_address"]
        drafters = await asyncio.gather(*(d.call("describe") for d in self.drafters))
        infos = {about["info"] for about in [*described, *drafters]}
        if len({info.fingerprint for info in infos}) != 1:
            raise UnsupportedModelError(f"workers serve different models: {sorted(infos)}")
        self.info = described[0]["info"]
        self.metrics = ServeMetrics(self.info.model)
        if self.config.scheduling != "per-request" and self.drafters:
            await self._start_schedules(described)
        return self

    async def _start_schedules(self, described: list[dict]) -> None:
        """One schedule per verifier, from first estimates of a draft step and of each verifier's
        load bandwidth (measured only here: per-request rounds need neither)."""
        steps = await asyncio.gather(*(d.call("time_draft_step") for d in self.drafters))
        bandwidths = await asyncio.gather(
            *(v.call("measure_load_bandwidth") for v in self.verifiers)
        )
        self.schedules = {
            verifier.name: new_scheduled_rounds(
                verifier, about, bandwidth, max(steps), self.config, self.metrics
            )
            for verifier, about, bandwidth in zip(self.verifiers, described, bandwidths)
        }

    async def close(self) -> None:
        await asyncio.gather(*(w.close() for w in [*self.drafters, *self.verifiers]))

    # --- Prefixes ---------------------------------------------------------------------------------

    async def put_prefix(
        self, request: pb.PutPrefixRequest, tenant: Tenant = ANONYMOUS
    ) -> AsyncIterator[pb.PutPrefixProgress]:
        token_ids, chat = self._prefix_tokens(request)
        tenant.check_tokens(len(token_ids))
        spec = owned_spec(_compressor_spec(request.compressor), tenant.name)
        prefix_id = prefix_id_for(self.info.fingerprint, token_ids, chat, spec)

        def progress(stage: str, existed: bool = False) -> pb.PutPrefixProgress:
            done = stage == "done"
            return pb.PutPrefixProgress(
                prefix_id=prefix_id, stage=stage, num_tokens=len(token_ids), done=done,
                existed=existed,
            )  # fmt: skip

        with self._active(tenant):
            yield progress("queued")
            lock = self._registering.setdefault(prefix_id, asyncio.Lock())
            try:
                async with lock:  # one registration per prefix at a time; the others find it
                    if await self._is_registered(prefix_id):
                        yield progress("done", existed=True)
                        return
                    await self._check_prefix_bytes(tenant)
                    async for stage in self._register(prefix_id, token_ids, chat, spec):
                        yield progress(stage)
                    await self._check_prefix_bytes(tenant, new_prefix_id=prefix_id)
            finally:  # also when cancelled: no lock is kept per abandoned registration
                if self._registering.get(prefix_id) is lock:
                    del self._registering[prefix_id]
            yield progress("done")

    async def get_prefix(self, prefix_id: str, tenant: Tenant = ANONYMOUS) -> pb.PrefixInfo:
        return _prefix_info(await self._owned_record(prefix_id, tenant))

    async def list_prefixes(self, tenant: Tenant = ANONYMOUS) -> pb.ListPrefixesResponse:
        records = await self._owned_records(tenant)
        return pb.ListPrefixesResponse(prefixes=[_prefix_info(r) for r in records])

    async def delete_prefix(
        self, prefix_id: str, tenant: Tenant = ANONYMOUS
    ) -> pb.DeletePrefixResponse:
        """Idempotent: deleting an unknown (or already deleted) prefix answers deleted=False."""
        try:
            await self._owned_record(prefix_id, tenant)
            await self._remove(prefix_id)
        except PrefixNotFoundError:
            return pb.DeletePrefixResponse(deleted=False)
        return pb.DeletePrefixResponse(deleted=True)

    # Tenants: their prefixes and limits.

    async def _owned_record(self, prefix_id: str, tenant: Tenant) -> PrefixRecord:
        record = await self._record(prefix_id)
        if not is_owned_by(record, self.info.fingerprint, tenant.name):
            raise PrefixNotFoundError(f"no prefix {prefix_id!r} is registered")
        return record

    async def _owned_records(self, tenant: Tenant) -> list[PrefixRecord]:
        records = await self._records()
        return [r for r in records if is_owned_by(r, self.info.fingerprint, tenant.name)]

    async def _check_prefix_bytes(self, tenant: Tenant, new_prefix_id: str | None = None) -> None:
        """Before a registration: is any quota left? After it (`new_prefix_id`): if the new
        prefix went past the quota, it is removed again."""
        if tenant.max_prefix_bytes is None:
            return
        records = await self._owned_records(tenant)
        used = sum(r.full_kv_bytes + r.compressed_kv_bytes for r in records)
        limit = tenant.max_prefix_bytes
        if (used <= limit) if new_prefix_id else (used < limit):
            return
        if new_prefix_id is not None:
            with contextlib.suppress(PrefixNotFoundError):
                await self._remove(new_prefix_id)
        raise TenantLimitError(
            f"registered prefixes would hold {used} bytes of KV, past this API key's limit of "
            f"{tenant.max_prefix_bytes}: delete prefixes first"
        )

    @contextlib.contextmanager
    def _active(self, tenant: Tenant):
        limit = tenant.max_concurrent_requests
        if limit is not None and self._num_active[tenant.name] >= limit:
            raise TenantLimitError(
                f"{limit} requests of this API key are running, its limit: retry later"
            )
        self._num_active[tenant.name] += 1
        try:
            yield
        finally:
            self._num_active[tenant.name] -= 1
            if not self._num_active[tenant.name]:
                del self._num_active[tenant.name]

    # Where prefixes live: the verifiers' catalog here; a subclass may keep them elsewhere.

    async def _register(
        self, prefix_id: str, token_ids: list[int], chat: bool, spec: dict
    ) -> AsyncIterator[str]:
        """Makes a new prefix's full and compressed KV; yields each stage as it begins."""
        verifier = self.verifiers[0]
        is_registered = False
        try:
            for stage, method in (("prefill", "prefill_prefix"), ("store", "store_prefix")):
                yield stage
                await verifier.call(method, token_ids)
            yield "compress"
            await verifier.call("compress_prefix", token_ids, chat, spec)
            is_registered = True
        finally:
            if not is_registered:
                # Cancelled, past its deadline or failed between stages: free the staged full KV
                # now (the verifier also expires it, for a stage still running on its thread).
                discard = verifier.call("discard_staged", token_ids)
                await asyncio.shield(asyncio.gather(discard, return_exceptions=True))

    async def _record(self, prefix_id: str) -> PrefixRecord:
        check_prefix_id(prefix_id)
        return await self.verifiers[0].call("get_prefix", prefix_id)

    async def _records(self) -> list[PrefixRecord]:
        return await self.verifiers[0].call("list_prefixes")

    async def _remove(self, prefix_id: str) -> None:
        await self.verifiers[0].call("delete_prefix", prefix_id)

    async def _is_registered(self, prefix_id: str) -> bool:
        try:
            await self._record(prefix_id)
        except PrefixNotFoundError:
            return False
        return True

    def _prefix_tokens(self, request: pb.PutPrefixRequest) -> tuple[list[int], bool]:
        if request.WhichOneof("content") == "token_ids":
            token_ids = list(request.token_ids.ids)
            chat = False
        elif request.WhichOneof("content") == "text":
            if not request.text:
                raise InvalidRequestError("the prefix text is empty")
            prompt = build_chat_prompt(self._need_tokenizer(), request.text, "?")
            token_ids, chat = list(prompt.token_ids[: prompt.num_prefix_tokens]), True
        else:
            raise InvalidRequestError("PutPrefix needs text or token_ids")
        self._check_length(token_ids, "the prefix")
        if not all(0 <= t < self.info.vocab_size for t in token_ids):
            raise InvalidRequestError(f"token ids must lie in [0, {self.info.vocab_size})")
        return token_ids, chat

    # --- Generation -------------------------------------------------------------------------------

    async def generate(
        self, request: pb.GenerateRequest, tenant: Tenant = ANONYMOUS
    ) -> AsyncIterator[pb.GenerateResponse]:
        plan = await self._plan(request, tenant)
        with self._active(tenant):
            if self._num_waiting >= self.config.max_waiting and self._running.locked():
                raise QueueFullError(
                    f"{self.config.max_running} requests are running and "
                    f"{self._num_waiting} waiting: retry later"
                )
            self._num_waiting += 1
            self._meter_queue(running_delta=0)
            try:
                await self._running.acquire()
            finally:
                self._num_waiting -= 1
            self._meter_queue(running_delta=1)
            try:
                async for message in self._serve(plan):
                    yield message
            finally:
                self._running.release()
                self._meter_queue(running_delta=-1)

    def _meter_queue(self, running_delta: int) -> None:
        self._num_running_requests += running_delta
        self.metrics.set_queue(self._num_running_requests, self._num_waiting)

    def _served(self, plan: RequestPlan) -> ServedRequest:
        checker = StopChecker(
            plan.params, self.info.eos_token_ids, self.info.max_positions, self.tokenizer
        )
        return ServedRequest(plan, checker)

    async def _serve(self, plan: RequestPlan) -> AsyncIterator[pb.GenerateResponse]:
        served = self._served(plan)
        verifier = _least_busy(self.verifiers, "verifier")
        drafter = _least_busy(self.drafters, "drafter") if plan.mode in _DRAFTER_MODES else None
        workers = [w for w in (verifier, drafter) if w is not None]
        for worker in workers:
            worker.active += 1
        try:
            address = self._addresses[verifier.name]
            schedule = self.schedules.get(verifier.name)
            rounds = run_request(served, verifier, drafter, address, schedule)
            async for message in metered(self.metrics, served, stream_responses(served, rounds)):
                yield message
        finally:
            for worker in workers:
                worker.active -= 1
            # Cancelled or not, the workers drop the request's caches.
            closing = [w.call("close", plan.session_id) for w in workers]
            await asyncio.shield(asyncio.gather(*closing, return_exceptions=True))

    async def _plan(self, request: pb.GenerateRequest, tenant: Tenant) -> RequestPlan:
        config = self.config
        mode = request.mode or (Mode.VERICACHE if request.prefix_id else Mode.FULL_LOCAL)
        if mode not in Mode.values() or mode == Mode.MODE_UNSPECIFIED:
            raise InvalidRequestError(f"unknown mode {request.mode}")
        if not request.prefix_id and mode != Mode.FULL_LOCAL:
            raise InvalidRequestError(
                f"mode {Mode.Name(mode)} drafts over a registered prefix's compressed KV: "
                "give prefix_id, or use FULL_LOCAL"
            )
        self._check_can_serve(mode)
        draft_len = request.draft_len if request.HasField("draft_len") else None
        draft_len = config.default_draft_len if draft_len is None else draft_len
        if not 1 <= draft_len <= config.max_draft_len:
            raise InvalidRequestError(f"draft_len must lie in [1, {config.max_draft_len}]")
        if request.max_tokens < 0:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {request.max_tokens}")
        params = SamplingParams(
            max_new_tokens=request.max_tokens or config.default_max_tokens,
            stop=tuple(request.stop),
        )
        record = None
        if request.prefix_id:
            record = await self._owned_record(request.prefix_id, tenant)
        prompt_ids = self._prompt_ids(record, request.prompt)
        self._check_length(prompt_ids, "the prompt")
        tenant.check_tokens(len(prompt_ids), params.max_new_tokens)
        return RequestPlan(
            session_id=uuid.uuid4().hex,
            mode=mode,
            prompt_ids=prompt_ids,
            num_prefix_tokens=record.num_tokens if record else 0,
            prefix_id=record.prefix_id if record else None,
            params=params,
            draft_len=draft_len,
            decode_chunk=config.decode_chunk,
        )

    def _check_can_serve(self, mode: int) -> None:
        if mode in _DRAFTER_MODES and not self.drafters:
            raise WorkerUnavailableError(f"no drafter is running to serve {Mode.Name(mode)}")

    def _prompt_ids(self, record: PrefixRecord | None, prompt: str) -> list[int]:
        """Chat prefixes are a system turn: the prompt is the user turn after it. Token prefixes
        are continued by the prompt's tokens as they are."""
        if not prompt:
            raise InvalidRequestError("the prompt is empty")
        tokenizer = self._need_tokenizer()
        if record is None:
            return list(build_chat_prompt(tokenizer, None, prompt).token_ids)
        if record.chat:
            turn = build_chat_prompt(tokenizer, "?", prompt)
            return [*record.token_ids, *turn.token_ids[turn.num_prefix_tokens :]]
        return [*record.token_ids, *tokenizer.encode(prompt, add_special_tokens=False)]

    def _check_length(self, token_ids: list[int], what: str) -> None:
        if not token_ids:
            raise InvalidRequestError(f"{what} has no tokens")
        if len(token_ids) >= self.info.max_positions:
            raise InvalidRequestError(
                f"{what} has {len(token_ids)} tokens; the model's context is "
                f"{self.info.max_positions}, and at least one must remain for output"
            )

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise InvalidRequestError(f"model {self.info.model} has no tokenizer: text needs one")
        return self.tokenizer


async def stream_responses(
    served: ServedRequest, rounds: AsyncIterator[list[int]]
) -> AsyncIterator[pb.GenerateResponse]:
    """The Generate stream of a request: a chunk per batch of committed tokens (with the text they
    add), the text held back until the end, then the statistics."""
    text = _TextDeltas(served.checker)
    async for tokens in rounds:
        if tokens:
            chunk = pb.TokenChunk(text=text.delta(served.output_ids), token_ids=tokens)
            yield pb.GenerateResponse(chunk=chunk)
    tail = text.delta(served.output_ids, final=True)
    if tail:
        yield pb.GenerateResponse(chunk=pb.TokenChunk(text=tail))
    yield pb.GenerateResponse(stats=served.stats())


class _TextDeltas:
    """The text each chunk adds. Held back until certain: a token that ends inside a multi-byte
    character decodes to U+FFFD until the next one completes it, and text that may begin a stop
    string is cut if the stop string completes (as vLLM holds back len(stop) - 1 characters)."""

    def __init__(self, checker: StopChecker):
        self.checker = checker
        self.hold_back = max((len(stop) - 1 for stop in checker.params.stop), default=0)
        self.sent = 0

    def delta(self, output_ids: list[int], final: bool = False) -> str:
        text = self.checker.output_text(output_ids) or ""
        if not final:
            text = text.rstrip("\ufffd")
            text = text[: len(text) - self.hold_back]
        new, self.sent = text[self.sent :], max(self.sent, len(text))
        return new


def _least_busy(workers: list[WorkerHandle], kind: str) -> WorkerHandle:
    if not workers:
        raise WorkerUnavailableError(f"no {kind} is running")
    return min(workers, key=lambda w: w.active)


def _compressor_spec(message: pb.Compressor) -> dict:
    if not message.name:
        raise InvalidRequestError("PutPrefix needs a compressor name (`vericache compressors`)")
    ratio = message.ratio if message.HasField("ratio") else None
    bits = message.bits if message.HasField("bits") else None
    dtype = message.dtype if message.HasField("dtype") else None
    return build_compressor(message.name, ratio=ratio, bits=bits, dtype=dtype).spec()


def _prefix_info(record: PrefixRecord) -> pb.PrefixInfo:
    params = record.compressor["params"]
    compressor = pb.Compressor(
        name=record.compressor["name"],
        ratio=params.get("ratio"),
        bits=params.get("bits"),
        dtype=params.get("dtype"),
    )
    return pb.PrefixInfo(
        prefix_id=record.prefix_id,
        num_tokens=record.num_tokens,
        compressor=compressor,
        full_kv_bytes=record.full_kv_bytes,
        compressed_kv_bytes=record.compressed_kv_bytes,
    )
