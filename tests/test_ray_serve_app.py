"""`vericache serve` as a Ray Serve application (cli/ray_serve.py), the form a KubeRay RayService
deploys: its args checked as the command line checks them, and the application itself deployed on
the session's Ray cluster, answering the OpenAI client through Serve's proxy and gRPC on its port
with the same tokens, then shut down with its workers."""

from __future__ import annotations

import socket

import pytest

from vericache.cli.ray_serve import SERVE_DECIDES, build, parse_options, serve_argv
from vericache.errors import InvalidRequestError

MODEL = "tiny-chat"
PROMPT = "Which function multiplies by seven?"


def test_args_become_the_serve_command_line():
    argv = serve_argv({"verifiers": 2, "draft-len": 16, "insecure-no-auth": True, "root": None})
    assert argv == ["serve", "--verifiers", "2", "--draft-len", "16", "--insecure-no-auth"]
    args = parse_options({"verifiers": 2, "draft-len": 16, "scheduling": "staggered"})
    assert (args.verifiers, args.draft_len, args.scheduling) == (2, 16, "staggered")


@pytest.mark.parametrize("name", sorted(SERVE_DECIDES))
def test_options_serve_decides_are_refused_with_the_reason(name):
    with pytest.raises(InvalidRequestError, match=f"no '{name}': {SERVE_DECIDES[name][:20]}"):
        parse_options({name: True})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"draft-lenght": 8}, "unrecognized arguments: --draft-lenght 8"),
        ({"draft-len": "many"}, "--draft-len: invalid int value: 'many'"),
        ({"scheduling": "fifo"}, "--scheduling: invalid choice: 'fifo'"),
        ({"resident-bytes": "lots"}, "lots"),
        ({"memory-budget": "2GiB"}, "need --long-context"),
    ],
)
def test_bad_args_fail_the_build_with_a_clear_reason(options, message):
    with pytest.raises(InvalidRequestError, match=message.replace("-", "\\-")) as raised:
        build(options)
    assert "Traceback" not in str(raised.value)


def _vericache_actors() -> set[str]:
    """The live named actors of VeriCache workers, in any namespace."""
    import ray

    names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
    return {name for name in names if name.startswith("vericache-")}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def deployed(ray_cluster, tiny_chat_checkpoint, tmp_path_factory):
    """The application on the session's cluster: Serve's proxy on one free port, the gRPC API on
    another; (HTTP base URL, gRPC target, the worker actors it placed)."""
    from ray import serve

    http_port, grpc_port = _free_port(), _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    options = {
        "model": str(tiny_chat_checkpoint), "root": str(tmp_path_factory.mktemp("serve-store")),
        "verifiers": 1, "drafters": 1, "host": "127.0.0.1", "port": grpc_port,
        "draft-len": 4, "insecure-no-auth": True, "served-model-name": MODEL,
        "threads-per-worker": 1, "placement-timeout": 120, "log-interval": 0,
    }  # fmt: skip
    try:
        before = _vericache_actors()
        serve.run(build(options), name="vericache", route_prefix="/")
        placed = _vericache_actors() - before
        yield f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", placed
    finally:
        serve.shutdown()


@pytest.mark.ray
@pytest.mark.slow
def test_the_application_serves_http_and_grpc_then_ends_its_workers(deployed):
    import openai
    from ray import serve

    from vericache.client import Client, ServerUnavailableError

    base_url, target, workers = deployed
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0) as oai:
        assert [m.id for m in oai.models.list().data] == [MODEL]
        sampling = dict(max_tokens=12, temperature=0.7, seed=5)
        messages = [{"role": "user", "content": PROMPT}]
        stream = oai.chat.completions.create(
            model=MODEL, messages=messages, stream=True, **sampling
        )
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream)
    with Client(target, timeout=120) as client:
        reference = client.generate(PROMPT, mode="full_local", **sampling)
    assert streamed == reference.text and reference.token_ids

    assert len(workers) == 2  # the replica placed one verifier and one drafter
    serve.delete("vericache")
    assert not workers & _vericache_actors()  # they ended with the replica
    with Client(target, timeout=5) as client, pytest.raises(ServerUnavailableError):
        client.generate(PROMPT, max_tokens=2)
