"""The coordinator: the serving front every backend shares.

It takes the API's calls as internal records (api_types.py; the servicer converts the wire), checks
them, raises the typed errors of vericache.errors for bad input, and hands checked requests to its
`ServingBackend` (backend.py): workers across nodes (distributed.py) or one long-context engine
(long_context.py). It owns what a caller sees the same way whichever backend serves: tenants and
their limits, admission (admission.py: resident prefixes first; RESOURCE_EXHAUSTED past
max_running + max_waiting), prompts, the streamed text deltas and the metrics.

Every call runs for a `Tenant` (auth.py; the anonymous one without API keys): a tenant sees and uses
only its own prefixes (another's answers NOT_FOUND, as an unknown one does) within its limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import uuid
from collections import Counter
from collections.abc import AsyncIterator

from vericache.compress import Compressor, build_compressor
from vericache.compress.steering import kept_quantizer
from vericache.engine.constraint import grammar_of
from vericache.engine.request import DecodeMode, Request, SamplingParams
from vericache.engine.sequence import Sequence
from vericache.errors import (
    DataLossError,
    InvalidRequestError,
    PrefixNotFoundError,
    WorkerUnavailableError,
)
from vericache.serve.api_types import (
    CompressorChoice,
    GenerateCall,
    GenerateEvent,
    PutPrefixCall,
    RegistrationProgress,
    ServeMode,
)
from vericache.serve.backends.auto_path import AutoPaths, PathChoice, served_as
from vericache.serve.backends.backend import ServingBackend
from vericache.serve.backends.metrics import ServeMetrics, metered
from vericache.serve.backends.path_costs import RequestShape, path_costs
from vericache.serve.backends.rounds import RequestPlan, ServedRequest
from vericache.serve.config import CoordinatorConfig
from vericache.serve.front.admission import Admission
from vericache.serve.front.auth import ANONYMOUS, PrefixQuotaError, Tenant, TenantLimitError
from vericache.serve.front.auto_prefix import AutoPrefixCache, PrefixWish
from vericache.serve.front.prompts import Prompts
from vericache.serve.front.streaming import stream_events
from vericache.serve.store.catalog import (
    PrefixKey,
    PrefixRecord,
    check_prefix_id,
    compressor_of,
    is_owned_by,
)
from vericache.serve.workers.worker_api import ModelInfo


class Coordinator:
    def __init__(
        self,
        backend: ServingBackend,
        tokenizer,
        model_name: str,
        config: CoordinatorConfig | None = None,
    ):
        self.backend = backend
        self.tokenizer = tokenizer
        self.config = config = config or CoordinatorConfig()
        self.metrics = ServeMetrics(model_name)
        self._auto: AutoPaths | None = None  # prices the paths of `mode: auto`, once started
        self.info: ModelInfo | None = None  # known once started
        self.prompts: Prompts | None = None  # ...with it
        self.auto_prefixes: AutoPrefixCache | None = None  # ...with it
        self._admission = Admission(
            config.max_running, config.max_waiting, config.resident_first_max_skip_s
        )
        self._registering: dict[str, asyncio.Lock] = {}
        self._num_active = Counter()  # tenant name -> its Generate and PutPrefix calls running

    async def start(self) -> Coordinator:
        self.info = await self.backend.start(self.metrics)
        self._auto = AutoPaths(path_costs(self.info, self.config.cost_profile))
        self.prompts = Prompts(self.tokenizer, self.info)
        self.auto_prefixes = AutoPrefixCache(
            self.config, self.metrics, self.info.fingerprint, self._register_text,
            self.delete_prefix,
        )  # fmt: skip
        self.auto_prefixes.restore(await self.backend.records())
        return self

    async def close(self) -> None:
        if self.auto_prefixes is not None:
            await self.auto_prefixes.close()
        if self.prompts is not None:
            self.prompts.close()
        await self.backend.close()

    # --- Prefixes ---------------------------------------------------------------------------------

    async def put_prefix(
        self, call: PutPrefixCall, tenant: Tenant = ANONYMOUS
    ) -> AsyncIterator[RegistrationProgress]:
        """A client's registration: one of the tenant's concurrent calls while it runs."""
        with self._active(tenant):
            async for progress in self._registration(call, tenant, automatic=False):
                yield progress

    async def _registration(
        self, call: PutPrefixCall, tenant: Tenant, automatic: bool
    ) -> AsyncIterator[RegistrationProgress]:
        limit = tenant.max_prompt_tokens
        token_ids, chat = await self.prompts.prefix_tokens(call.text, call.token_ids, limit)
        tenant.check_tokens(len(token_ids))
        compressor = _compressor(call.compressor)
        key = PrefixKey(token_ids, chat, compressor, tenant.name, automatic=automatic)
        prefix_id = key.prefix_id(self.info.fingerprint)

        def progress(stage: str, existed: bool = False) -> RegistrationProgress:
            return RegistrationProgress(prefix_id, stage, len(token_ids), existed)

        yield progress("queued")
        lock = self._registering.setdefault(prefix_id, asyncio.Lock())
        try:
            async with lock:  # one registration per prefix at a time; the others find it
                if await self._is_registered(prefix_id):
                    yield progress("done", existed=True)
                    return
                full_kv_bytes = len(token_ids) * self.info.full_kv_bytes_per_token
                await self._check_prefix_bytes(tenant, adding_bytes=full_kv_bytes)
                async for stage in self.backend.register(prefix_id, key):
                    yield progress(stage)
                await self._check_prefix_bytes(tenant, new_prefix_id=prefix_id)
                self.auto_prefixes.index.add(await self.backend.record(prefix_id))
        finally:  # also when cancelled: no lock is kept per abandoned registration
            if self._registering.get(prefix_id) is lock:
                del self._registering[prefix_id]
        yield progress("done")

    async def get_prefix(self, prefix_id: str, tenant: Tenant = ANONYMOUS) -> PrefixRecord:
        return await self._owned_record(prefix_id, tenant)

    async def list_prefixes(self, tenant: Tenant = ANONYMOUS) -> list[PrefixRecord]:
        records = await self.backend.records()
        return [r for r in records if is_owned_by(r, self.info.fingerprint, tenant.name)]

    async def delete_prefix(self, prefix_id: str, tenant: Tenant = ANONYMOUS) -> bool:
        """Idempotent: deleting an unknown (or already deleted) prefix answers False."""
        try:
            await self._owned_record(prefix_id, tenant)
            await self.backend.remove(prefix_id)
        except PrefixNotFoundError:
            return False
        self.auto_prefixes.index.remove(prefix_id)
        return True

    async def _register_text(
        self, text: str, tenant: Tenant, compressor: CompressorChoice | None = None
    ) -> str:
        """Registers a system turn by automatic prefix caching, with `compressor` or the
        automatic prefixes' one; its prefix id. The server's own call: it takes none of the
        tenant's concurrent calls, but its prefix quota holds."""
        call = PutPrefixCall(compressor or self.config.auto_prefix_compressor, text=text)
        async for progress in self._registration(call, tenant, automatic=True):
            last = progress
        return last.prefix_id

    async def _owned_record(self, prefix_id: str, tenant: Tenant) -> PrefixRecord:
        check_prefix_id(prefix_id)
        record = await self.backend.record(prefix_id)
        if not is_owned_by(record, self.info.fingerprint, tenant.name):
            raise PrefixNotFoundError(f"no prefix {prefix_id!r} is registered")
        return record

    async def _is_registered(self, prefix_id: str) -> bool:
        try:
            await self.backend.record(prefix_id)
        except (PrefixNotFoundError, DataLossError):  # a damaged record is registered again
            return False
        return True

    async def _check_prefix_bytes(
        self, tenant: Tenant, adding_bytes: int = 0, new_prefix_id: str | None = None
    ) -> None:
        """Before a registration, from the token count alone (`adding_bytes`: the new prefix's
        full KV): would it go past the quota? After it (`new_prefix_id`), its compressed KV
        counted too: if it went past, it is removed again."""
        if tenant.max_prefix_bytes is None:
            return
        records = await self.list_prefixes(tenant)
        used = sum(r.full_kv_bytes + r.compressed_kv_bytes for r in records) + adding_bytes
        limit = tenant.max_prefix_bytes
        if used <= limit:
            return
        if new_prefix_id is not None:
            with contextlib.suppress(PrefixNotFoundError):
                await self.backend.remove(new_prefix_id)
        raise PrefixQuotaError(
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

    # --- Generation -------------------------------------------------------------------------------

    async def generate(
        self, call: GenerateCall, tenant: Tenant = ANONYMOUS, request_id: str | None = None
    ) -> AsyncIterator[GenerateEvent]:
        """`request_id` names the request in the logs, and its sessions on the workers."""
        plan = await self._plan(call, tenant, request_id or uuid.uuid4().hex)
        with self._active(tenant):
            await self._admission.admit(plan.prefix_id)
            self._meter_queue()
            placed = None
            try:
                plan, placed = self._resolved(plan)  # auto chooses at the loads of now
                served = self._served(plan)
                rounds = self.backend.serve(served)
                events = metered(self.metrics, served, stream_events(served, rounds))
                async with contextlib.aclosing(events):
                    async for event in events:
                        yield event
                if placed is not None and served.seq.finish_reason is not None:
                    summary = served.summary()
                    self._auto.observe(placed, summary, served.worker_load, served.co_runners)
            finally:
                if placed is not None:
                    self._auto.finished(placed)
                self._admission.release(plan.prefix_id)
                self._meter_queue()

    def _resolved(self, plan: RequestPlan) -> tuple[RequestPlan, PathChoice | None]:
        """The plan of an AUTO request with the path chosen for it (auto_path.py); any other
        plan as it is. And the option it takes, which its measurements correct auto's prices of
        (None: no prefix, or a mode auto never takes)."""
        if plan.prefix_id is None:
            return plan, None
        request = plan.request
        after_prefix = request.prompt_ids[request.num_prefix_tokens :]
        options, shape = self.backend.path_options(plan.prefix_id, after_prefix), _shape(plan)
        if plan.mode is not ServeMode.AUTO:
            named = [o for o in options if served_as(o.path) is plan.mode]
            return plan, PathChoice(named[0], shape) if named else None
        choice = self._auto.choose(options, shape)
        self.metrics.auto_path_chosen(choice.path.value)
        mode = served_as(choice.path)
        if mode.decode_mode is DecodeMode.FULL:
            request = dataclasses.replace(
                request, mode=DecodeMode.FULL, compressor=None, steer_every=0
            )
        return dataclasses.replace(plan, mode=mode, request=request), choice

    @property
    def num_running(self) -> int:
        """Requests decoding now."""
        return self._admission.num_running

    def _meter_queue(self) -> None:
        admission = self._admission
        self.metrics.set_queue(admission.num_running, admission.num_waiting)

    def _served(self, plan: RequestPlan) -> ServedRequest:
        info = self.info
        seq = Sequence.start(plan.request, info.eos_token_ids, info.max_positions, self.tokenizer)
        return ServedRequest(plan, seq)

    async def _plan(self, call: GenerateCall, tenant: Tenant, session_id: str) -> RequestPlan:
        config = self.config
        draft_len = config.default_draft_len if call.draft_len is None else call.draft_len
        if not 1 <= draft_len <= config.max_draft_len:
            raise InvalidRequestError(f"draft_len must lie in [1, {config.max_draft_len}]")
        params = self._sampling_params(call, tenant)
        record, prompt_ids = await self._prompt(call, tenant)
        mode = call.mode or (ServeMode(config.default_mode) if record else ServeMode.FULL_LOCAL)
        if mode is ServeMode.AUTO and record is None:
            mode = ServeMode.FULL_LOCAL  # no prefix: the one path there is
        if record is None and mode is not ServeMode.FULL_LOCAL:
            raise InvalidRequestError(
                f"mode {mode.name} drafts over a registered prefix's compressed KV: give "
                "prefix_id, or use FULL_LOCAL"
            )
        try:
            self.backend.check_can_serve(mode)
        except WorkerUnavailableError:
            if call.mode is not None or call.prefix_id:
                raise
            mode = ServeMode.FULL_LOCAL  # a prefix found by itself: full KV serves it as well
            self.backend.check_can_serve(mode)
        tenant.check_tokens(len(prompt_ids), params.max_new_tokens)
        if call.constraint is not None:
            grammar_of(call.constraint)  # a grammar that does not compile is refused now
        request = Request(
            prompt_ids=prompt_ids,
            num_prefix_tokens=record.num_tokens if record else 0,
            params=params,
            mode=mode.decode_mode,
            compressor=compressor_of(record) if mode.decode_mode is not DecodeMode.FULL else None,
            draft_len=draft_len,
            request_id=session_id,
            constraint=call.constraint,
            steer_every=call.steer_every,
        )
        prefix_id = record.prefix_id if record else None
        share = record.compressed_kv_bytes / record.full_kv_bytes if record else 1.0
        return RequestPlan(
            session_id, mode, prefix_id, tenant.name, request, config.decode_chunk, share
        )

    def _sampling_params(self, call: GenerateCall, tenant: Tenant) -> SamplingParams:
        max_tokens = call.max_tokens
        if max_tokens is None:  # the default, within what the tenant may ask for
            max_tokens = self.config.default_max_tokens
            if tenant.max_output_tokens is not None:
                max_tokens = min(max_tokens, tenant.max_output_tokens)
        if not 1 <= max_tokens <= self.config.max_output_tokens:
            raise InvalidRequestError(
                f"max_tokens must lie in [1, {self.config.max_output_tokens}], got {max_tokens}"
            )
        self.prompts.check_token_ids(call.stop_token_ids, "stop token ids")
        params = SamplingParams(
            max_new_tokens=max_tokens, stop=call.stop, stop_token_ids=call.stop_token_ids,
            **call.sampling.given(),
        )  # fmt: skip
        if params.is_sampled and params.seed is None:  # one seed for every worker and the summary
            params = dataclasses.replace(params, seed=secrets.randbits(63))
        return params

    async def _prompt(
        self, call: GenerateCall, tenant: Tenant
    ) -> tuple[PrefixRecord | None, tuple[int, ...]]:
        """The request's prefix (the one it names, else the tenant's longest that leads its
        prompt: automatic prefix caching) and its prompt's token ids."""
        wanted = _compressor(call.compressor).spec() if call.compressor else None
        record = await self._owned_record(call.prefix_id, tenant) if call.prefix_id else None
        if record is not None and wanted is not None and record.compressor != wanted:
            raise InvalidRequestError(
                f"prefix {record.prefix_id!r} was registered with {_described(record.compressor)}"
                f", not {_described(wanted)}"
            )
        prompt = await self.prompts.prompt_ids(record, call, tenant.max_prompt_tokens)
        if record is None:
            system = None
            text = self.prompts.system_text(call) if prompt.num_prefix_tokens else None
            if text is not None:  # a conversation's system turn
                system = (text, prompt.token_ids[: prompt.num_prefix_tokens])
            wish = PrefixWish(prompt.token_ids, system, call.compressor, wanted)
            record = self.auto_prefixes.match(tenant, wish)
        return record, prompt.token_ids


def _compressor(choice: CompressorChoice) -> Compressor:
    if not choice.name:
        raise InvalidRequestError("a compressor needs a name (`vericache compressors`)")
    return build_compressor(choice.name, ratio=choice.ratio, bits=choice.bits, dtype=choice.dtype)


def _described(spec: dict) -> str:
    params = ", ".join(f"{k}={v}" for k, v in sorted(spec["params"].items()))
    return f"{spec['name']}({params})"


def _shape(plan: RequestPlan) -> RequestShape:
    """What auto prices of a request over a prefix (path_costs.py)."""
    request = plan.request
    return RequestShape(
        prefix_id=plan.prefix_id, prefix_tokens=request.num_prefix_tokens,
        after_prefix=len(request.prompt_ids) - request.num_prefix_tokens,
        num_tokens=request.params.max_new_tokens, draft_len=request.draft_len,
        compressed_share=plan.compressed_share, steer_every=request.steer_every,
        regrouped=kept_quantizer(request.compressor) is not None,
    )  # fmt: skip
