"""Servers for the serving tests: in-process workers on a tiny chat model, reached through gRPC."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from vericache.serve.config import CoordinatorConfig, DrafterConfig, VerifierConfig
from vericache.serve.front.auth import Access
from vericache.serve.launch.cluster import in_process_workers
from vericache.serve.launch.server import BackgroundServer, HttpSettings, distributed_server
from vericache.v1 import vericache_pb2_grpc

# About 300 tokens of code in the system turn: long enough that 4x compression drops most of it.
CONTEXT = "".join(
    f"def scale_{i}(values, factor={i}):\n    return [v * factor for v in values]\n\n"
    for i in range(12)
)

# The model id the HTTP API answers to in the tests (--served-model-name).
SERVED_MODEL = "tiny-chat"


def start_server(
    model: Path,
    root: Path,
    num_drafters: int = 2,
    config: CoordinatorConfig | None = None,
    access: Access | None = None,
    http: HttpSettings | None = None,
    drafter_options: dict | None = None,
    **verifier_options,
) -> BackgroundServer:
    """`access` None: no API keys and no TLS, as `--insecure-no-auth` serves; `http`: the
    OpenAI-compatible HTTP API too."""
    verifier = VerifierConfig(model=str(model), root=root, transfer_host="127.0.0.1")
    if verifier_options:
        verifier = dataclasses.replace(verifier, **verifier_options)
    drafter = DrafterConfig(model=str(model), **(drafter_options or {}))
    return distributed_server(
        lambda: in_process_workers(verifier, drafter, num_drafters),
        str(model),
        config=config,
        access=access or Access(),
        http=http,
    )


@contextlib.contextmanager
def serving_one_prefix(model: Path, root: Path, compressor: str, ratio: float = 4):
    """A server with one drafter, a client of it and CONTEXT registered with `compressor` at
    `ratio`: (server, client, prefix id)."""
    from vericache.client import Client

    with start_server(model, root, num_drafters=1) as server:
        with Client(server.target, timeout=120) as client:
            yield server, client, client.put_prefix(CONTEXT, compressor=compressor, ratio=ratio)


def start_openai_server(model: Path, root: Path, **options) -> BackgroundServer:
    """`start_server` with the OpenAI-compatible HTTP API too, on a free port, answering to
    SERVED_MODEL."""
    return start_server(model, root, http=HttpSettings(0, SERVED_MODEL), **options)


def openai_server_fixture(name: str):
    """A module's fixture `server`: a server with the OpenAI API (`start_openai_server`) over the
    tiny chat model, for the module's tests alone."""

    @pytest.fixture(scope="module")
    def server(tiny_chat_checkpoint, tmp_path_factory):
        with start_openai_server(tiny_chat_checkpoint, tmp_path_factory.mktemp(name)) as running:
            yield running

    return server


def http_url(server) -> str:
    """The root of a running server's HTTP API (`/v1/...`, `/health`, `/metrics` under it)."""
    return f"http://{server.host}:{server.http_port}"


def wait_for(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def a_tenth_of_its_time(request) -> float:
    """A deadline that falls inside `request` on a fast machine as on a loaded one: a tenth of
    what it takes without one (a fixed deadline can fall after a fast machine's whole request)."""
    started = time.monotonic()
    request()
    return (time.monotonic() - started) / 10


def open_sessions(server: BackgroundServer) -> int:
    """Sessions the server's in-process workers still hold."""
    backend = server.coordinator.backend
    workers = [*backend.verifiers, *backend.drafters]
    return sum(handle.worker.num_sessions for handle in workers)


def counts(server: BackgroundServer, counter: str, label: str) -> dict[str, float]:
    """A counter of the server's metrics (`vericache:NAME`), by the value of one label."""
    exposition = server.coordinator.metrics.exposition().decode()
    return {
        sample.labels[label]: sample.value
        for family in text_string_to_metric_families(exposition)
        if family.name == f"vericache:{counter}"
        for sample in family.samples
        if sample.name.endswith("_total")
    }


@contextlib.contextmanager
def raw_stub(server: BackgroundServer):
    """The API's generated stub on a plaintext channel: messages no SDK call would send."""
    with grpc.insecure_channel(server.target) as channel:
        yield vericache_pb2_grpc.VeriCacheStub(channel)
