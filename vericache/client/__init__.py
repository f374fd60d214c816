"""The client SDK of the VeriCache gRPC API (vericache.v1): `Client`, and `AsyncClient` for asyncio.

    from vericache.client import Client

    with Client("localhost:50051", timeout=60) as client:
        prefix_id = client.put_prefix(open("manual.txt").read(), compressor="snapkv", ratio=8)
        result = client.generate("How do I reset it?", prefix_id=prefix_id, max_tokens=128)
        print(result.text, result.stats["mean_accepted_per_round"])

        with client.stream("And then?", prefix_id=prefix_id) as stream:
            for delta in stream:  # text as the server accepts tokens
                print(delta, end="", flush=True)
        print(stream.result().stats["tokens_per_s"])

        # Sampled: the same tokens as full-KV sampling with this seed, whatever the mode.
        sampled = client.generate("Once more?", prefix_id=prefix_id, temperature=0.7, seed=1)

The same with `AsyncClient`: `await client.generate(...)`, `async for delta in client.stream(...)`,
`await stream.result()`. A server that needs an API key gets it from `Client(target, api_key=...)`
or $VERICACHE_API_KEY; `root_certificates=open("ca.crt", "rb").read()` (or `tls=True` for the
system's CAs) connects over TLS. Importing this package loads grpc and the stubs only, never torch
or Ray.
"""

from vericache.client.aio import AsyncClient, AsyncStream
from vericache.client.errors import (
    AuthenticationError,
    DataLossError,
    DeadlineExceededError,
    InvalidRequestError,
    PrefixNotFoundError,
    RequestCancelledError,
    ServerBusyError,
    ServerError,
    ServerUnavailableError,
)
from vericache.client.sync import Client, Stream
from vericache.client.types import (
    Compressor,
    GenerateOptions,
    ModeName,
    PrefixInfo,
    Progress,
    Result,
    Sampling,
)

__all__ = [
    "AsyncClient",
    "AsyncStream",
    "AuthenticationError",
    "Client",
    "Compressor",
    "DataLossError",
    "DeadlineExceededError",
    "GenerateOptions",
    "InvalidRequestError",
    "ModeName",
    "PrefixInfo",
    "PrefixNotFoundError",
    "Progress",
    "RequestCancelledError",
    "Result",
    "Sampling",
    "ServerBusyError",
    "ServerError",
    "ServerUnavailableError",
    "Stream",
]
