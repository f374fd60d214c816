"""The client SDK's failures against the in-process fake server (tests/client_fakes.py), for both
clients: arguments checked before any RPC, the status code to exception mapping, retries and
timeouts.
"""

from __future__ import annotations

import socket
import time

import pytest

from tests.client_fakes import FOREVER, Code, fake_session, serve_fakes
from tests.timing import SLACK
from vericache.client import (
    DeadlineExceededError,
    InvalidRequestError,
    PrefixNotFoundError,
    RequestCancelledError,
    ServerBusyError,
    ServerError,
    ServerUnavailableError,
)


@pytest.fixture(scope="module")
def servers():
    yield from serve_fakes()


@pytest.fixture(params=["sync", "async"])
def fake(request, servers):
    yield from fake_session(servers, request.param)


# --- errors -------------------------------------------------------------------------------------

LOCAL_ERRORS = {
    "no-content": (lambda c: c.put_prefix(), "exactly one of text= and token_ids="),
    "two-contents": (lambda c: c.put_prefix("x", token_ids=[1]), "exactly one of"),
    "bad-token": (lambda c: c.put_prefix(token_ids=[1, -1]), "token_ids"),
    "bad-ratio": (lambda c: c.put_prefix("x", ratio=0), "ratio must be > 0"),
    "bad-mode": (lambda c: c.generate("x", mode="greedy"), "full_local, full_remote, lossy"),
    "bad-max-tokens": (lambda c: c.generate("x", max_tokens=0), "max_tokens"),
    "bad-draft-len": (lambda c: c.stream("x", draft_len=0), "draft_len"),
    "ratio-alone": (lambda c: c.generate("x", ratio=4), "give compressor"),
    "bad-bits": (lambda c: c.generate("x", compressor="kivi", bits=0), "bits"),
    "empty-prefix-id": (lambda c: c.get_prefix(""), "prefix_id"),
    "bad-timeout": (lambda c: c.list_prefixes(timeout=-1), "timeout"),
}  # fmt: skip


@pytest.mark.parametrize("call, message", LOCAL_ERRORS.values(), ids=LOCAL_ERRORS)
def test_bad_arguments_fail_before_any_rpc(fake, call, message):
    client = fake.connect()
    with pytest.raises(InvalidRequestError, match=message):
        call(client)
    assert sum(fake.state.calls.values()) == 0


def test_bad_client_settings(fake):
    with pytest.raises(InvalidRequestError, match="retries"):
        fake.connect(retries=-1)
    with pytest.raises(InvalidRequestError, match="timeout"):
        fake.connect(timeout=0)


STATUS_ERRORS = [
    (Code.INVALID_ARGUMENT, InvalidRequestError),
    (Code.NOT_FOUND, PrefixNotFoundError),
    (Code.RESOURCE_EXHAUSTED, ServerBusyError),
    (Code.UNAVAILABLE, ServerUnavailableError),
    (Code.DEADLINE_EXCEEDED, DeadlineExceededError),
    (Code.CANCELLED, RequestCancelledError),
    (Code.INTERNAL, ServerError),
]


@pytest.mark.parametrize("code, error_type", STATUS_ERRORS, ids=[c.name for c, _ in STATUS_ERRORS])
@pytest.mark.parametrize("method", ["ListPrefixes", "Generate"])
def test_each_status_code_raises_its_type_with_the_server_detail(fake, method, code, error_type):
    client = fake.connect(retries=0)
    fake.state.failures[method].append((code, f"the server says {code.name}"))
    with pytest.raises(error_type) as raised:
        client.list_prefixes() if method == "ListPrefixes" else client.generate("hi")
    assert type(raised.value) is error_type
    assert str(raised.value) == f"the server says {code.name}"
    if isinstance(raised.value, ServerError):
        assert raised.value.code is code


def test_a_stream_without_final_stats_is_a_server_error(fake):
    fake.state.omit_stats = True
    with pytest.raises(ServerError, match="without its final statistics") as raised:
        fake.connect().generate("hi")
    assert raised.value.code is Code.INTERNAL


# --- retries and timeouts -----------------------------------------------------------------------


@pytest.mark.parametrize("method", ["ListPrefixes", "Generate", "PutPrefix"])
def test_unavailable_is_retried_until_it_succeeds(fake, method):
    client = fake.connect(retries=3)
    fake.state.failures[method] = [(Code.UNAVAILABLE, "no worker yet")] * 3
    {
        "ListPrefixes": client.list_prefixes,
        "Generate": lambda: client.generate("hi"),
        "PutPrefix": lambda: client.put_prefix("manual"),
    }[method]()
    assert fake.state.calls[method] == 4


def test_retries_give_up_after_the_limit(fake):
    client = fake.connect(retries=2)
    fake.state.failures["GetPrefix"] = [(Code.UNAVAILABLE, "no worker: start one")] * 5
    with pytest.raises(ServerUnavailableError, match="^no worker: start one$"):
        client.get_prefix("p1")
    assert fake.state.calls["GetPrefix"] == 3


@pytest.mark.parametrize("code", [Code.RESOURCE_EXHAUSTED, Code.INTERNAL])
def test_other_codes_are_not_retried(fake, code):
    client = fake.connect(retries=3)
    fake.state.failures["GetPrefix"] = [(code, "no")] * 5
    with pytest.raises(ServerError):
        client.get_prefix("p1")
    assert fake.state.calls["GetPrefix"] == 1


def test_a_stream_is_not_retried_after_it_delivered_output(fake):
    client = fake.connect(retries=3)
    fake.state.fail_after_first_chunk = (Code.UNAVAILABLE, "the verifier went away")
    stream = client.stream("hi")
    assert next(stream) == " w0 w1"
    with pytest.raises(ServerUnavailableError, match="the verifier went away"):
        next(stream)
    with pytest.raises(ServerUnavailableError):
        stream.result()
    assert list(stream) == [] and fake.state.calls["Generate"] == 1


def test_an_unreachable_server_is_unavailable_after_retries(fake):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        target = f"127.0.0.1:{probe.getsockname()[1]}"
    with pytest.raises(ServerUnavailableError):
        fake.connect(target, retries=1, timeout=5).list_prefixes()


def test_timeouts_raise_deadline_exceeded(fake):
    start = time.monotonic()
    with pytest.raises(DeadlineExceededError):
        fake.connect(timeout=0.2).generate(FOREVER)
    by_client = time.monotonic() - start
    start = time.monotonic()
    with pytest.raises(DeadlineExceededError):
        fake.connect(timeout=30).generate(FOREVER, timeout=0.2)  # the call's own overrides
    # It ends as the client's own 0.2 s deadline did, not after the client's 30 s.
    assert time.monotonic() - start <= SLACK * by_client


def test_a_keyword_generate_does_not_take_is_refused_before_any_rpc(fake):
    client = fake.connect()
    with pytest.raises(InvalidRequestError, match="promt_id"):
        client.generate("Hello", promt_id="p")  # a typo of prefix_id, not dropped silently
    with pytest.raises(InvalidRequestError, match="promt_id"):
        client.stream("Hello", promt_id="p")
    assert sum(fake.state.calls.values()) == 0
