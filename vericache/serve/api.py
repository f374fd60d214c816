"""The vericache.v1 gRPC API over a `Coordinator`, with health checking and server reflection.

Each typed error becomes its status code; anything else is logged and reported as INTERNAL. A bad
request never takes the server down. A cancelled RPC (the client went away, or its deadline
passed) cancels the handler, and the coordinator closes the request's sessions on the workers.
"""

from __future__ import annotations

import contextlib
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from vericache.errors import (
    InvalidRequestError,
    PrefixNotFoundError,
    QueueFullError,
    UnsupportedModelError,
    WorkerUnavailableError,
)
from vericache.serve.coordinator import Coordinator
from vericache.v1 import vericache_pb2, vericache_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = vericache_pb2.DESCRIPTOR.services_by_name["VeriCache"].full_name
_STATUS = [
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (UnsupportedModelError, grpc.StatusCode.INVALID_ARGUMENT),
    (PrefixNotFoundError, grpc.StatusCode.NOT_FOUND),
    (QueueFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (WorkerUnavailableError, grpc.StatusCode.UNAVAILABLE),
]


@contextlib.asynccontextmanager
async def _statuses(context: grpc.aio.ServicerContext, method: str):
    """Aborts the RPC with the status code of a typed error."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - every error becomes a status, the server goes on
        if isinstance(exc, grpc.aio.AbortError):
            raise
        for error_type, code in _STATUS:
            if isinstance(exc, error_type):
                await context.abort(code, str(exc))
        log.exception("%s failed", method)
        await context.abort(grpc.StatusCode.INTERNAL, f"{method} failed: {exc}")


class VeriCacheService(vericache_pb2_grpc.VeriCacheServicer):
    def __init__(self, coordinator: Coordinator):
        self.coordinator = coordinator

    async def PutPrefix(self, request, context):  # noqa: N802 - gRPC method names
        async with _statuses(context, "PutPrefix"):
            async for progress in self.coordinator.put_prefix(request):
                yield progress

    async def GetPrefix(self, request, context):  # noqa: N802
        async with _statuses(context, "GetPrefix"):
            return await self.coordinator.get_prefix(request.prefix_id)

    async def ListPrefixes(self, request, context):  # noqa: N802
        async with _statuses(context, "ListPrefixes"):
            return await self.coordinator.list_prefixes()

    async def DeletePrefix(self, request, context):  # noqa: N802
        async with _statuses(context, "DeletePrefix"):
            return await self.coordinator.delete_prefix(request.prefix_id)

    async def Generate(self, request, context):  # noqa: N802
        async with _statuses(context, "Generate"):
            async for message in self.coordinator.generate(request):
                yield message


async def start_server(
    coordinator: Coordinator, address: str = "127.0.0.1:0"
) -> tuple[grpc.aio.Server, int]:
    """Starts the API on `address` ("host:port", port 0 picks a free one); returns the server
    and its port. Health reports SERVING for the whole server and for vericache.v1.VeriCache."""
    server = grpc.aio.server()
    vericache_pb2_grpc.add_VeriCacheServicer_to_server(VeriCacheService(coordinator), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    port = server.add_insecure_port(address)
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port
