"""KV from the store side to drafters: a gRPC stream through the slow link, and their copies of it.

The store side (`KVTransferService`) serves only callers that prove, with the server's secret,
that they are its workers and that the coordinator granted this fetch (cluster_secret.py); it
encodes a prefix's KV with the KV codec and sends it in pieces
of at most PIECE_BYTES, each paced by the `ThrottledLink`, so the link's bandwidth and latency apply
to the bytes really sent. The drafter side (`KVFetcher`) decodes as pieces arrive and keeps one copy
of each prefix it fetched (kv/shared_prefix.py: pinned while a session reads it, unpinned ones
evicted least recently used within the drafter's bytes): a second request on the same prefix pays
no transfer. A stream that fails the codec's checks on arrival is fetched once more, then raises
DataLossError: no damaged KV is kept.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from vericache.compress import cache_from_state
from vericache.engine.link import ThrottledLink
from vericache.errors import DataLossError, PrefixNotFoundError, WorkerUnavailableError
from vericache.kv.cache import KVCache
from vericache.kv.codec import decode_iter, iter_encode
from vericache.kv.codec_errors import CodecError
from vericache.kv.shared_prefix import HeldPrefix, SharedPrefixes
from vericache.kv.state import CacheState
from vericache.serve.cluster_secret import ClusterSecret, FetchDeniedError
from vericache.serve.workers.worker_api import DraftRole
from vericache.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

PIECE_BYTES = 1 << 20  # under gRPC's default 4 MiB message limit
KVKind = kv_transfer_pb2.KVKind
_UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED

# (prefix id, KVKind) -> the state to send; raises PrefixNotFoundError for an unknown prefix.
KVSource = Callable[[str, int], CacheState]
# Whether a prefix is still registered: a background stream (a warm node's host tier) ends when
# its prefix is deleted; a session's fetch goes on, as the sessions using a deleted prefix do.
Registered = Callable[[str], bool]


def fetch_kind(role: DraftRole) -> int:
    """The KV a drafter session of `role` fetches: full KV for FULL_REMOTE, else compressed."""
    return KVKind.FULL if role is DraftRole.FULL else KVKind.COMPRESSED


class KVTransferService(kv_transfer_pb2_grpc.KVTransferServicer):
    def __init__(
        self,
        source: KVSource,
        fingerprint: str,
        link: ThrottledLink,
        secret: ClusterSecret,
        is_registered: Registered = lambda prefix_id: True,
    ):
        self.source = source
        self.fingerprint = fingerprint
        self.link = link
        self.secret = secret
        self.is_registered = is_registered

    def Fetch(self, request, context):  # noqa: N802 - the gRPC method name
        try:
            self.secret.check_fetch(context.invocation_metadata(), request.prefix_id, request.kind)
        except FetchDeniedError as exc:
            code = grpc.StatusCode.PERMISSION_DENIED if exc.authenticated else _UNAUTHENTICATED
            context.abort(code, str(exc))
        try:
            state = self.source(request.prefix_id, request.kind)
        except PrefixNotFoundError as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except DataLossError as exc:
            context.abort(grpc.StatusCode.DATA_LOSS, str(exc))
        first = True
        for chunk in iter_encode(state, self.fingerprint):
            for start in range(0, len(chunk), PIECE_BYTES):
                piece = chunk[start : start + PIECE_BYTES]
                self.link.send_blocking(len(piece), first, background=request.background)
                first = False
                if not context.is_active():  # the drafter went away
                    return
                if request.background and not self.is_registered(request.prefix_id):
                    context.abort(grpc.StatusCode.NOT_FOUND, "the prefix was deleted")
                yield kv_transfer_pb2.KVPiece(data=piece)


class TransferServer:
    """A KVTransfer gRPC server on threads of its own: workers (plain classes, or Ray actors
    running one call at a time) keep serving KV while they compute. Not asyncio: gRPC's asyncio
    runtime allows one event loop per process, which the API server may hold."""

    def __init__(
        self, service: KVTransferService, host: str = "127.0.0.1", port: int = 0, threads: int = 8
    ):
        self.host = host
        self._server = grpc.server(ThreadPoolExecutor(threads, thread_name_prefix="kv-transfer"))
        kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(service, self._server)
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        self._server.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self, grace_s: float | None = None) -> None:
        self._server.stop(grace_s).wait(30)


@dataclass
class FetchResult:
    held: HeldPrefix[KVCache]  # pinned for the caller: read it in place, then release it
    link_bytes: int  # 0 where the drafter held it already
    seconds: float

    @property
    def cache(self) -> KVCache:
        return self.held.cache


class KVFetcher:
    """Drafter side of KVTransfer, over the drafter's copies of the prefixes it fetched (`held`,
    shared by its sessions and with its other fetchers); `rope` rebuilds caches that store keys
    before RoPE."""

    def __init__(self, target: str, fingerprint: str, held: SharedPrefixes[KVCache], rope=None):
        self.fingerprint = fingerprint
        self.rope = rope
        self.held = held
        self._channel = grpc.insecure_channel(target)
        self._stub = kv_transfer_pb2_grpc.KVTransferStub(self._channel)

    def fetch(
        self,
        prefix_id: str,
        kind: int = KVKind.COMPRESSED,
        metadata: tuple = (),
        background: bool = False,
        nbytes: int | None = None,
        timeout_s: float | None = None,
    ) -> FetchResult:
        """The prefix's KV, pinned until `release`: the copy held already, or one fetched once
        however many sessions ask at the same time. `metadata`: the proofs the service asks for
        (`ClusterSecret.fetch_metadata`); `background`: the link carries it only while no other
        transfer waits (a warm node's host tier); `nbytes`: its size where known, refused before
        it moves if the copies' budget cannot hold it; `timeout_s`: the stream's deadline."""
        start = time.perf_counter()
        received = [0]  # bytes, over every attempt
        request = kv_transfer_pb2.FetchRequest(
            prefix_id=prefix_id, kind=kind, background=background
        )

        def transfer() -> KVCache:
            try:
                return self._receive(request, metadata, received, timeout_s)
            except CodecError:  # damaged on the way: once more
                try:
                    return self._receive(request, metadata, received, timeout_s)
                except CodecError:
                    message = f"prefix {prefix_id}: its KV arrived damaged twice"
                    raise DataLossError(message) from None

        held = self.held.acquire((prefix_id, kind), transfer, nbytes)
        return FetchResult(held, received[0], time.perf_counter() - start)

    def _receive(
        self, request, metadata: tuple, received: list[int], timeout_s: float | None
    ) -> KVCache:
        def pieces():
            for piece in self._stub.Fetch(request, metadata=metadata, timeout=timeout_s):
                received[0] += len(piece.data)
                yield piece.data

        try:
            return cache_from_state(decode_iter(pieces(), self.fingerprint), self.rope)
        except grpc.RpcError as exc:
            if exc.code() is grpc.StatusCode.NOT_FOUND:
                raise PrefixNotFoundError(exc.details()) from None
            if exc.code() is grpc.StatusCode.DATA_LOSS:
                raise DataLossError(exc.details()) from None
            if exc.code() is grpc.StatusCode.UNAVAILABLE:  # the verifier restarted elsewhere
                raise WorkerUnavailableError("the verifier's KV transfer service is gone") from None
            raise

    def close(self) -> None:
        self._channel.close()
