"""VERICACHE rounds driven by the scheduler (staggered and lock-step) in the served system: exact
outputs, full-KV loads started ahead of each verification and within the verifier's memory, and
requests that leave the schedule (finished, cancelled, refused) leave nothing behind."""

from __future__ import annotations

import concurrent.futures
import dataclasses

import pytest

from tests.serve_fixtures import CONTEXT, open_sessions, start_server, wait_for
from vericache.client import Client
from vericache.engine.device_memory import slot_bytes
from vericache.errors import InvalidRequestError, WorkerUnavailableError
from vericache.model.loader import load_model
from vericache.serve.config import CoordinatorConfig
from vericache.serve.workers.handles import LocalAnswer, VerifierHandle
from vericache.serve.workers.kv_transfer import KVKind
from vericache.serve.workers.worker import DraftFailedError, SessionNotFoundError
from vericache.serve.workers.worker_api import (
    DraftCall,
    Drafted,
    DraftRole,
    OpenDrafter,
    OpenVerifier,
    VerifyCall,
)

PROMPTS = [
    "Which function multiplies by three?",
    "Write a function that adds two lists.",
    "What does scale_7 return?",
    "Explain scale_0 in one line.",
]
MAX_TOKENS = 40
LOAD_BANDWIDTH = 50e6  # bytes/s: the store's loads onto the verifier's device, emulated


class RecordingVerifier(VerifierHandle):
    """The verifier's handle, recording each load and verification the coordinator asks for
    (a call's load starts before its verification), and whether its drafts were still to come."""

    def __init__(self, handle: VerifierHandle):
        super().__init__(handle.worker, handle.transport, handle.name)
        self.calls: list[tuple[str, str]] = []
        self.drafts_by_reference = 0

    async def verify(self, call):
        if call.load_first:
            self.calls.append(("load", call.session_id))
        self.calls.append(("verify", call.session_id))
        self.drafts_by_reference += not isinstance(call.drafts, tuple)
        return await super().verify(call)


def _all_at_once(client, prefix_id: str, max_tokens: int) -> list:
    """Every prompt of PROMPTS as a VERICACHE request, all in flight together."""
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(
            pool.map(
                lambda p: client.generate(
                    p, prefix_id=prefix_id, mode="vericache", max_tokens=max_tokens
                ),
                PROMPTS,
            )
        )


@pytest.fixture(scope="module", params=["staggered", "lockstep"])
def scheduled(request, tiny_chat_checkpoint, tmp_path_factory):
    """A server whose verifier holds two requests' full KV at most, so four requests at once
    must take turns: their prefixes are dropped after verifying and loaded again before the next."""
    model = load_model(str(tiny_chat_checkpoint))
    full_kv_bytes = model.config.max_position_embeddings * slot_bytes(model.config, 4)
    config = CoordinatorConfig(scheduling=request.param, default_draft_len=6)
    root = tmp_path_factory.mktemp(f"scheduled-{request.param}")
    with start_server(
        tiny_chat_checkpoint,
        root,
        config=config,
        resident_bytes=2 * full_kv_bytes,
        load_bandwidth=LOAD_BANDWIDTH,
    ) as server:
        backend = server.coordinator.backend
        recording = RecordingVerifier(backend.verifiers[0])
        backend.verifiers[0] = recording
        backend.schedules[recording.name].verifier = recording
        with Client(server.target, timeout=120) as client:
            prefix_id = client.put_prefix(CONTEXT, compressor="streamingllm", ratio=4)
            yield server, client, prefix_id, recording


def test_scheduled_rounds_equal_full_decoding(scheduled):
    server, client, prefix_id, recording = scheduled
    references = [
        client.generate(p, prefix_id=prefix_id, mode="full_local", max_tokens=MAX_TOKENS)
        for p in PROMPTS
    ]
    results = _all_at_once(client, prefix_id, MAX_TOKENS)
    for result, reference in zip(results, references):
        assert result.token_ids == reference.token_ids
        assert result.text == reference.text
        assert result.stats["rounds"] < MAX_TOKENS
    # Only two full KVs fit: sessions were dropped between rounds and loaded again, each from the
    # verifier's one copy of the prefix, which the first reference read from the store (held to
    # the emulated host-to-device bandwidth) and nothing read again.
    assert any(kind == "load" for kind, _ in recording.calls)
    assert sum(r.stats["store_bytes"] for r in results) == 0
    first = references[0].stats
    assert first["store_bytes"] > 0 or all(r.stats["store_bytes"] == 0 for r in references)
    assert first["store_wait_s"] >= first["store_bytes"] / LOAD_BANDWIDTH
    schedule = server.coordinator.backend.schedules[recording.name]
    assert wait_for(lambda: not schedule.scheduler.has_requests)
    costs = schedule.scheduler.costs
    peak = schedule.scheduler.metrics.peak_memory_bytes
    assert costs.weights_bytes < peak <= costs.memory_budget_bytes
    # Each planned iteration is in the server's metrics.
    metrics = server.coordinator.metrics
    labels = {"model_name": metrics.model_name}
    sample = metrics.registry.get_sample_value
    assert sample("vericache:scheduler_verify_batch_size_sum", labels) >= len(PROMPTS)
    assert sample("vericache:scheduler_draft_batch_size_count", labels) > MAX_TOKENS / 6
    assert sample("vericache:scheduler_memory_peak_bytes", labels) == peak
    # Each request's round made one drafter call and one verifier call, and one more verifier
    # call where its load began in an iteration where no verification began to carry it.
    calls = sample("vericache:round_worker_calls_total", labels)
    rounds = sample("vericache:spec_decode_num_drafts_total", labels)
    # ...except a request's last round where its budget left one token: no draft call.
    assert 2 * rounds - len(PROMPTS) <= calls <= 2 * rounds
    assert recording.drafts_by_reference > 0
    # The verifier itself never held more full KV than its budget, openings included.
    residency = server.run(recording.residency())
    assert 0 < residency.peak_bytes <= recording.worker.config.resident_bytes
    assert wait_for(lambda: open_sessions(server) == 0)


def test_every_verification_follows_its_own_load(scheduled):
    server, client, prefix_id, recording = scheduled
    recording.calls.clear()
    _all_at_once(client, prefix_id, 24)
    loaded: set[str] = set()
    verified = 0
    for method, session_id in recording.calls:
        if method == "load":
            loaded.add(session_id)
        else:
            assert session_id in loaded, "verified without a load since its last verification"
            loaded.discard(session_id)
            verified += 1
    assert verified >= len(PROMPTS)


def test_a_cancelled_request_leaves_the_schedule(scheduled):
    server, client, prefix_id, recording = scheduled
    stream = client.stream(
        "Go on.", prefix_id=prefix_id, mode="vericache", max_tokens=300, draft_len=2
    )
    next(iter(stream))
    stream.close()
    schedule = server.coordinator.backend.schedules[recording.name]
    assert wait_for(lambda: not schedule.scheduler.has_requests)
    assert wait_for(lambda: open_sessions(server) == 0)
    # The server schedules the next request as before.
    result = client.generate("hi", prefix_id=prefix_id, mode="vericache", max_tokens=6)
    assert len(result.token_ids) == 6


def test_a_request_past_the_verifier_memory_is_refused(tiny_chat_checkpoint, tmp_path):
    config = CoordinatorConfig(scheduling="staggered")
    tiny_budget = 1 << 10
    with start_server(
        tiny_chat_checkpoint, tmp_path, config=config, resident_bytes=tiny_budget
    ) as server:
        with Client(server.target, timeout=60) as client:
            prefix_id = client.put_prefix(CONTEXT, compressor="streamingllm", ratio=4)
            with pytest.raises(InvalidRequestError, match="budget"):
                client.generate("hi", prefix_id=prefix_id, mode="vericache", max_tokens=6)
            assert wait_for(lambda: open_sessions(server) == 0)
            # Modes that do not verify in rounds still run.
            result = client.generate("hi", prefix_id=prefix_id, mode="lossy", max_tokens=6)
            assert len(result.token_ids) == 6


def test_scheduling_must_be_a_known_policy():
    with pytest.raises(InvalidRequestError, match="scheduling"):
        dataclasses.replace(CoordinatorConfig(), scheduling="round-robin")


@pytest.fixture
def two_sessions(scheduled):
    """Two sessions opened on the scheduled server's verifier and drafter directly, each drafted
    once: (the verifier, their pending token)."""
    server, client, prefix_id, _ = scheduled
    verifier = server.coordinator.backend.verifiers[0].worker
    drafter = server.coordinator.backend.drafters[0].worker
    record = verifier.get_prefix(prefix_id)
    prompt = (*record.token_ids, 11, 12)
    address = verifier.transfer_address
    for session_id in ("first", "second"):
        opened = verifier.open(OpenVerifier(session_id, prompt, prefix_id, 512, True))
        grant = verifier.config.secret.grant(session_id, prefix_id, KVKind.COMPRESSED)
        drafter.open(
            OpenDrafter(session_id, DraftRole.DRAFT, address, prefix_id, prompt,
                        record.num_tokens, 512, grant)
        )  # fmt: skip
        drafted = drafter.draft(
            DraftCall(session_id, (opened.first_token,), 2, frozenset(), opened.exact)
        )
        assert len(drafted.tokens) == 2
    yield verifier, (opened.first_token,)
    for session_id in ("first", "second"):
        verifier.close_session(session_id)
        drafter.close_session(session_id)


def test_a_verification_waits_for_its_drafts_by_reference(two_sessions):
    """A scheduled round's verifier call comes before its drafts: one whose session closes while
    it waits ends, one whose draft call failed fails (the coordinator reports the draft call's
    own error), and the others verify."""
    verifier, pending = two_sessions
    never, failing, answered = (concurrent.futures.Future() for _ in range(3))
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        waiting = pool.submit(
            verifier.verify, VerifyCall("first", pending, LocalAnswer(never), load_first=True)
        )
        verifying = pool.submit(
            verifier.verify, VerifyCall("second", pending, LocalAnswer(answered))
        )
        failed = pool.submit(verifier.verify, VerifyCall("second", pending, LocalAnswer(failing)))
        failing.set_exception(SessionNotFoundError("the drafter holds no session 'second'"))
        with pytest.raises(DraftFailedError, match="SessionNotFoundError"):
            failed.result(30)
        answered.set_result(Drafted((5, 6), 0.01))
        verified = verifying.result(60)
        assert len(verified.tokens) == 3 and verified.forward_s > 0
        assert not waiting.done()
        verifier.close_session("first")
        with pytest.raises(SessionNotFoundError, match="verifier"):
            waiting.result(30)


def test_a_verification_gives_up_on_drafts_that_never_come(two_sessions):
    verifier, pending = two_sessions
    patience = verifier.config
    verifier.config = dataclasses.replace(patience, draft_wait_s=0.3)
    try:
        with pytest.raises(WorkerUnavailableError, match="did not come within 0.3 s"):
            verifier.verify(VerifyCall("first", pending, LocalAnswer(concurrent.futures.Future())))
    finally:
        verifier.config = patience
    # The session is intact: its next verification runs.
    assert len(verifier.verify(VerifyCall("first", pending, (5,))).tokens) == 2


def test_verifications_that_span_iterations_stay_exact(scheduled):
    """A verifier slower than a draft step: each verification runs over several iterations while
    the other requests draft, and is reported when its reservation ends."""
    server, client, prefix_id, recording = scheduled
    costs = server.coordinator.backend.schedules[recording.name].scheduler.costs
    costs.verify_s = 6 * costs.iteration_s  # as measured on a slow verifier (refined as it runs)
    assert costs.num_verify_iterations() >= 6
    references = [
        client.generate(p, prefix_id=prefix_id, mode="full_local", max_tokens=24) for p in PROMPTS
    ]
    results = _all_at_once(client, prefix_id, 24)
    assert [r.token_ids for r in results] == [r.token_ids for r in references]
    assert wait_for(lambda: open_sessions(server) == 0)
