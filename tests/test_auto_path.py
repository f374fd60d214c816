"""`mode: auto` (serve/auto_path.py): each request takes the path that would finish it first by
what the paths cost on this server, every path measured before it is trusted, and the output is
full-KV decoding's whichever path it takes."""

from __future__ import annotations

from tests.serve_fixtures import CONTEXT, start_server
from vericache.scheduler.path_choice import ServingPath
from vericache.serve.api_types import GenerateSummary
from vericache.serve.auto_path import AutoPaths, PathOption

LOCAL, VERICACHE, REMOTE = ServingPath.FULL_LOCAL, ServingPath.VERICACHE, ServingPath.FULL_REMOTE


def summary(ttft_s: float, tokens_per_s: float, num_tokens: int = 32) -> GenerateSummary:
    return GenerateSummary(
        finish_reason="length", num_tokens=num_tokens, rounds=1, accepted_per_round=(),
        link_bytes=0, store_bytes=0, link_wait_s=0.0, store_wait_s=0.0, ttft_s=ttft_s,
        tokens_per_s=tokens_per_s, total_s=ttft_s + 1.0,
    )  # fmt: skip


def options(local_load: int = 0, drafter_load: int = 0) -> list[PathOption]:
    return [
        PathOption(LOCAL, "verifier-0", local_load),
        PathOption(VERICACHE, "drafter-0", drafter_load),
        PathOption(REMOTE, "drafter-0", drafter_load),
    ]


def test_every_path_is_measured_before_the_measurements_choose():
    auto = AutoPaths()
    tried = []
    for _ in range(3):
        path = auto.choose(options(), 32)
        tried.append(path)
        auto.observe(path, summary(0.1, 50.0), load=1)
    assert tried == [LOCAL, VERICACHE, REMOTE]


def test_requests_started_together_spread_over_the_unmeasured_paths():
    auto = AutoPaths()
    started = [auto.choose(options(), 32) for _ in range(4)]
    assert started == [LOCAL, VERICACHE, REMOTE, LOCAL]  # the fourth: the fewest trying
    auto.ended(VERICACHE)  # cut short: nothing measured, so it is tried again
    assert auto.choose(options(), 32) is VERICACHE
    auto.observe(LOCAL, summary(0.1, 50.0), load=1)
    auto.ended(LOCAL)
    # LOCAL is measured now; the others are still being tried, so LOCAL takes the next.
    assert auto.choose(options(), 32) is LOCAL


def test_the_path_that_finishes_first_wins_at_the_loads_of_now():
    auto = AutoPaths()
    auto.observe(LOCAL, summary(0.2, 40.0), load=1)  # 25 ms a token alone
    auto.observe(VERICACHE, summary(0.5, 80.0), load=1)  # 12.5 ms, half a second to start
    auto.observe(REMOTE, summary(3.0, 45.0), load=1)  # its full KV crosses the link first
    assert auto.choose(options(), 64) is VERICACHE
    assert auto.choose(options(), 8) is LOCAL  # too short to pay VERICACHE's start
    # Three requests on the drafter already: each of its tokens takes four times as long.
    assert auto.choose(options(drafter_load=3), 64) is LOCAL


def test_a_request_cut_short_teaches_nothing_of_its_speed():
    auto = AutoPaths()
    auto.observe(LOCAL, summary(0.2, 0.0, num_tokens=1), load=1)
    assert auto.choose(options(), 32) is LOCAL  # still unmeasured: tried first


def test_auto_serves_full_kv_decoding_s_tokens_whichever_path_it_takes(
    tiny_chat_checkpoint, tmp_path
):
    from vericache.client import Client

    with start_server(tiny_chat_checkpoint, tmp_path, num_drafters=1) as server:
        with Client(server.target, timeout=120) as client:
            prefix_id = client.put_prefix(CONTEXT, compressor="snapkv", ratio=4)
            prompt = "Which function multiplies by three?"
            reference = client.generate(
                prompt, prefix_id=prefix_id, mode="full_local", max_tokens=24
            )
            paths = []
            for _ in range(4):
                got = client.generate(prompt, prefix_id=prefix_id, mode="auto", max_tokens=24)
                assert got.token_ids == reference.token_ids
                paths.append(got.stats["path"])
        # The server measured full_local on the reference; auto tries the paths it has not.
        assert paths[:2] == ["vericache", "full_remote"]
        assert set(paths[2:]) <= {"vericache", "full_local", "full_remote"}
        metrics = server.coordinator.metrics
        sample = metrics.registry.get_sample_value
        labels = {"model_name": metrics.model_name, "path": "vericache"}
        assert sample("vericache:auto_paths_total", labels) >= 1


def test_auto_offers_no_drafter_of_other_arithmetic(tiny_chat_checkpoint, tmp_path):
    import dataclasses

    from tests.serve_fixtures import wait_for
    from vericache.client import Client

    with start_server(tiny_chat_checkpoint, tmp_path, num_drafters=1) as server:
        with Client(server.target, timeout=120) as client:
            prefix_id = client.put_prefix(CONTEXT, compressor="snapkv", ratio=4)
        backend = server.coordinator.backend
        offered = {option.path for option in backend.path_options(prefix_id)}
        assert offered == {LOCAL, VERICACHE, REMOTE}
        (drafter,) = backend.drafters
        info = drafter.worker.info
        drafter.worker.info = dataclasses.replace(info, numerics=info.numerics + ":elsewhere")
        assert wait_for(lambda: drafter.numerics != backend.verifiers[0].numerics)
        assert [option.path for option in backend.path_options(prefix_id)] == [LOCAL]
