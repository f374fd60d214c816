"""A remote drafter's kept set, steered by the central verifier (serve/workers/steered_sessions.py,
compress/kept_set.py): served VeriCache with `steer_every` gives full-KV decoding's tokens, its
refreshes cross the link (counted in its link bytes) and are taken in by the drafter, a refresh
damaged on the way is dropped and counted without changing a token, and a request steering what
cannot be steered is refused naming why."""

from __future__ import annotations

import dataclasses

import pytest

from tests.serve_fixtures import CONTEXT, serving_one_prefix
from vericache.client import InvalidRequestError
from vericache.engine import request as request_module
from vericache.serve.workers.steered_sessions import SteeredSessions

PROMPT = "Which function multiplies by seven, and what does it return?"
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def served(tiny_chat_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("steering")
    with serving_one_prefix(tiny_chat_checkpoint, root, "snapkv") as (server, client, prefix_id):
        # The drafter fetches the compressed KV once, here: the tests' link bytes are the
        # rounds' alone.
        _generate(client, prefix_id, mode="vericache")
        yield server, client, prefix_id


def _generate(client, prefix_id, **options):
    return client.generate(
        PROMPT, prefix_id=prefix_id, max_tokens=MAX_TOKENS, draft_len=4, **options
    )


SAMPLINGS = {"greedy": {}, "seeded": {"temperature": 0.8, "seed": 5}}


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
def test_a_steered_remote_drafter_gives_full_decodings_tokens(served, sampling, monkeypatch):
    server, client, prefix_id = served
    reference = _generate(client, prefix_id, mode="full_local", **sampling)
    plain = _generate(client, prefix_id, mode="vericache", **sampling)
    sent, booked = _watch_the_link(monkeypatch)
    steered = _generate(client, prefix_id, mode="vericache", steer_every=1, **sampling)
    assert steered.token_ids == plain.token_ids == reference.token_ids
    stats = steered.stats
    # Each refresh sent was taken in: the round that ends the request, which no draft call
    # follows, sends none.
    assert stats["kept_set_refreshes"] == len(sent) >= 1
    assert stats["kept_set_refreshes_dropped"] == 0
    assert plain.stats["kept_set_refreshes"] == 0
    # The refreshes crossed the link beside the rounds' exact KV, and the request paid for them.
    assert 0 < sum(sent) < sum(booked) == stats["link_bytes"]


def _watch_the_link(monkeypatch) -> tuple[list[int], list[int]]:
    """The bytes of each kept-set refresh the verifier sends, and of everything it books on the
    link toward the drafter (exact KV and refreshes)."""
    from vericache.serve.workers.verifier import Verifier

    sent, booked = [], []
    real_after_round, real_hand_over = SteeredSessions.after_round, Verifier._hand_over

    def after_round(self, *args):
        refresh = real_after_round(self, *args)
        if refresh is not None:
            sent.append(refresh.nbytes)
        return refresh

    def hand_over(self, nbytes):
        booked.append(nbytes)
        return real_hand_over(self, nbytes)

    monkeypatch.setattr(SteeredSessions, "after_round", after_round)
    monkeypatch.setattr(Verifier, "_hand_over", hand_over)
    return sent, booked


def test_a_refresh_damaged_on_the_way_is_dropped_and_counted(served, monkeypatch):
    server, client, prefix_id = served
    real_after_round = SteeredSessions.after_round

    def damaging(self, session_id, full, drafter_version):
        refresh = real_after_round(self, session_id, full, drafter_version)
        if refresh is None or refresh.version != 1:
            return refresh
        layer = refresh.layers[0]
        keys = layer.keys.clone()
        keys.view(-1)[0] += 1.0  # the first refresh arrives with a changed value
        damaged = dataclasses.replace(layer, keys=keys)
        return dataclasses.replace(refresh, layers=(damaged, *refresh.layers[1:]))

    monkeypatch.setattr(SteeredSessions, "after_round", damaging)
    reference = _generate(client, prefix_id, mode="full_local")
    steered = _generate(client, prefix_id, mode="vericache", steer_every=1)
    assert steered.token_ids == reference.token_ids
    assert steered.stats["kept_set_refreshes_dropped"] == 1
    # The next refreshes were planned from the set the drafter still held, and taken in.
    assert steered.stats["kept_set_refreshes"] >= 1
    metrics = server.coordinator.metrics
    labels = {"model_name": metrics.model_name, "outcome": "dropped"}
    assert metrics.registry.get_sample_value("vericache:kept_set_refreshes_total", labels) >= 1


def test_steering_what_cannot_be_steered_is_refused(served):
    server, client, prefix_id = served
    with pytest.raises(InvalidRequestError, match="mode 'vericache' only"):
        _generate(client, prefix_id, mode="full_local", steer_every=2)
    kivi = client.put_prefix(CONTEXT, compressor="kivi", bits=4)
    with pytest.raises(InvalidRequestError, match="not kivi"):
        _generate(client, kivi, mode="vericache", steer_every=2)
    with pytest.raises(InvalidRequestError, match="steer_every must be an integer >= 0"):
        _generate(client, prefix_id, mode="vericache", steer_every=-1)


def test_a_request_that_does_not_choose_is_steered_over_a_long_prefix_alone(served, monkeypatch):
    """Unset, `steer_every` is the engine's default: every round where the prefix has
    STEERED_PREFIX_TOKENS tokens or more (here lowered below the tiny prefix's length, then
    raised above it); 0 turns steering off whatever the prefix."""
    server, client, prefix_id = served
    reference = _generate(client, prefix_id, mode="full_local")
    monkeypatch.setattr(request_module, "STEERED_PREFIX_TOKENS", 8)
    long_enough = _generate(client, prefix_id, mode="vericache")
    off = _generate(client, prefix_id, mode="vericache", steer_every=0)
    monkeypatch.setattr(request_module, "STEERED_PREFIX_TOKENS", 1 << 20)
    too_short = _generate(client, prefix_id, mode="vericache")
    assert long_enough.token_ids == off.token_ids == too_short.token_ids == reference.token_ids
    assert long_enough.stats["kept_set_refreshes"] >= 1
    assert off.stats["kept_set_refreshes"] == too_short.stats["kept_set_refreshes"] == 0


def test_a_compositions_regrouped_refreshes_cross_to_the_drafter(served, monkeypatch):
    """snapkv+kivi: each refresh carries the drafter's leading KIVI groups quantized again."""
    server, client, _ = served
    composed = client.put_prefix(CONTEXT, compressor="snapkv+kivi", ratio=4, bits=4)
    reference = _generate(client, composed, mode="full_local")
    sent, _ = _watch_the_link(monkeypatch)
    steered = _generate(client, composed, mode="vericache", steer_every=1)
    assert steered.token_ids == reference.token_ids
    assert steered.stats["kept_set_refreshes"] == len(sent) >= 1
    assert steered.stats["kept_set_refreshes_dropped"] == 0
