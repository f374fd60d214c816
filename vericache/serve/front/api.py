"""The vericache.v1 gRPC API over a `Coordinator`, with health checking and server reflection.

Messages become the coordinator's records and back through wire.py; the coordinator never sees a
message.

Each typed error becomes its status code, with the error's one line; anything else is logged and
reported as INTERNAL with no detail of its own: no status detail carries a traceback, address, PID
or path. Every failure's detail ends with a request id, which the server's log line of the failure
carries too (a Generate's id is also its `request finished` log's), and is counted by its code
(`vericache:request_failure_total{code}`). A bad request never takes the server down. A cancelled
RPC (the client went away, or its deadline passed) cancels the handler, and the coordinator
closes the request's sessions on the workers.

Each RPC first maps the caller's API key to its tenant (auth.py): UNAUTHENTICATED without a valid
one; then a request whose bytes did not decode (malformed.py) is INVALID_ARGUMENT. Refusals are
logged with the tenant. grpc.health.v1 and reflection need no key (kubelet's probes send none).
With TLS, health is also served in plaintext on `Access.health_port`, alone: kubelet's gRPC probes
cannot speak TLS. Health follows the workers at once as the backend announces their deaths and
returns (backend.py `AnnouncesServing`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from vericache.errors import (
    DataLossError,
    DeadlineExceededError,
    InvalidRequestError,
    PrefixNotFoundError,
    QueueFullError,
    UnsupportedModelError,
    WorkerUnavailableError,
)
from vericache.serve.backends.backend import AnnouncesServing, ServingBackend
from vericache.serve.backends.metrics import ServeMetrics
from vericache.serve.front import wire
from vericache.serve.front.auth import Access, Tenant, UnauthenticatedError
from vericache.serve.front.coordinator import Coordinator
from vericache.serve.front.malformed import TolerantDecoding, check_decoded
from vericache.v1 import vericache_pb2, vericache_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = vericache_pb2.DESCRIPTOR.services_by_name["VeriCache"].full_name
HEALTH_INTERVAL_S = 0.25  # how often health polls a backend that announces no changes
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_STATUS = [
    (UnauthenticatedError, grpc.StatusCode.UNAUTHENTICATED),
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (UnsupportedModelError, grpc.StatusCode.INVALID_ARGUMENT),
    (PrefixNotFoundError, grpc.StatusCode.NOT_FOUND),
    (QueueFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (WorkerUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (DataLossError, grpc.StatusCode.DATA_LOSS),
    (DeadlineExceededError, grpc.StatusCode.DEADLINE_EXCEEDED),
]


def _code_of(exc: Exception) -> grpc.StatusCode:
    for error_type, code in _STATUS:
        if isinstance(exc, error_type):
            return code
    return grpc.StatusCode.INTERNAL


@dataclass
class _Rpc:
    request_id: str  # ends the detail of its failure, and is in the log lines of the RPC
    tenant: Tenant | None = None  # the caller's, once its API key is known


@contextlib.asynccontextmanager
async def _statuses(
    context: grpc.aio.ServicerContext,
    method: str,
    request,
    access: Access,
    metrics: ServeMetrics,
):
    """Yields the RPC's request id and tenant: the caller's key is checked first, then that the
    request decoded (malformed.py); aborts the RPC with the status code of a typed error."""
    rpc = _Rpc(uuid.uuid4().hex)
    try:
        rpc.tenant = access.tenant_for(context.invocation_metadata())
        check_decoded(request, method)
        yield rpc
    except Exception as exc:  # noqa: BLE001 - every error becomes a status, the server goes on
        if isinstance(exc, grpc.aio.AbortError):
            raise
        code = _code_of(exc)
        metrics.request_failed(code.name)
        tenant = rpc.tenant.name if rpc.tenant is not None else None
        extra = {"request_id": rpc.request_id, "code": code.name, "tenant": tenant}
        if code is grpc.StatusCode.INTERNAL:
            log.exception("%s failed for tenant %r", method, tenant, extra=extra)
            detail = f"{method} failed on the server"
        else:
            log.info("%s refused for tenant %r: %s", method, tenant, exc, extra=extra)
            detail = str(exc)
        await context.abort(code, f"{detail} (request id {rpc.request_id})")


class VeriCacheService(vericache_pb2_grpc.VeriCacheServicer):
    def __init__(self, coordinator: Coordinator, access: Access):
        self.coordinator = coordinator
        self.access = access

    def _statuses(self, context: grpc.aio.ServicerContext, method: str, request):
        return _statuses(context, method, request, self.access, self.coordinator.metrics)

    async def PutPrefix(self, request, context):  # noqa: N802 - gRPC method names
        async with self._statuses(context, "PutPrefix", request) as rpc:
            call = wire.put_prefix_call(request)
            # Closed at once when the RPC ends early: the registration's cleanup (stopping its
            # prefill, then freeing the tenant's slot) runs before the handler returns.
            registration = self.coordinator.put_prefix(call, rpc.tenant)
            async with contextlib.aclosing(registration):
                async for progress in registration:
                    yield wire.progress_message(progress)

    async def GetPrefix(self, request, context):  # noqa: N802
        async with self._statuses(context, "GetPrefix", request) as rpc:
            record = await self.coordinator.get_prefix(request.prefix_id, rpc.tenant)
            return wire.prefix_info(record)

    async def ListPrefixes(self, request, context):  # noqa: N802
        async with self._statuses(context, "ListPrefixes", request) as rpc:
            return wire.prefix_list(await self.coordinator.list_prefixes(rpc.tenant))

    async def DeletePrefix(self, request, context):  # noqa: N802
        async with self._statuses(context, "DeletePrefix", request) as rpc:
            deleted = await self.coordinator.delete_prefix(request.prefix_id, rpc.tenant)
            return vericache_pb2.DeletePrefixResponse(deleted=deleted)

    async def Generate(self, request, context):  # noqa: N802
        async with self._statuses(context, "Generate", request) as rpc:
            call = wire.generate_call(request)
            async for event in self.coordinator.generate(call, rpc.tenant, rpc.request_id):
                yield wire.generate_response(event)


@dataclass(frozen=True)
class ApiServers:
    servers: list[grpc.aio.Server]  # the API's, then the health-only one if any
    port: int  # the API's
    health_port: int | None  # the plaintext health-only port
    health: asyncio.Task  # keeps health in step with the workers; cancel it to stop

    async def stop(self, grace_s: float) -> None:
        self.health.cancel()
        await asyncio.gather(*(server.stop(grace_s) for server in self.servers))


async def start_server(
    coordinator: Coordinator, address: str = "127.0.0.1:0", access: Access | None = None
) -> ApiServers:
    """Starts the API on `address` ("host:port", port 0 picks a free one), and a health-only
    server on `access.health_port` (0 picks one) if set. Health reports SERVING for the whole
    server and for vericache.v1.VeriCache. `access` None: no API keys and no TLS."""
    access = access or Access()
    server = grpc.aio.server(interceptors=[TolerantDecoding(SERVICE_NAME)])
    service = VeriCacheService(coordinator, access)
    vericache_pb2_grpc.add_VeriCacheServicer_to_server(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    if access.tls is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, grpc.ssl_server_credentials([access.tls.read()]))
    servers, health_port = [server], None
    if access.health_port is not None:
        health_only = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_only)
        host = address.rsplit(":", 1)[0]
        health_port = health_only.add_insecure_port(f"{host}:{access.health_port}")
        servers.append(health_only)
    for running in servers:
        await running.start()
    health_task = asyncio.create_task(_follow_workers(coordinator.backend, health_servicer))
    return ApiServers(servers, port, health_port, health_task)


async def _follow_workers(backend: ServingBackend, health_servicer) -> None:
    """SERVING while some worker of every kind is up, NOT_SERVING while one kind has none: at once
    when the backend announces a change (a call found a worker gone: health says so before the
    next request is placed or refused), within HEALTH_INTERVAL_S of one it does not announce."""
    changed = asyncio.Event()
    if isinstance(backend, AnnouncesServing):
        backend.watch_serving(changed.set)
    shown = None
    while True:
        changed.clear()  # before the read: a change after it wakes the wait below
        serving = backend.is_serving()
        if serving != shown:
            status = health_pb2.HealthCheckResponse.SERVING if serving else _NOT_SERVING
            for name in ("", SERVICE_NAME):
                await health_servicer.set(name, status)
            if shown is not None:
                log.warning("health: %s", health_pb2.HealthCheckResponse.ServingStatus.Name(status))
            shown = serving
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(changed.wait(), HEALTH_INTERVAL_S)
