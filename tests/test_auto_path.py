"""`mode: auto` (serve/backends/auto_path.py over serve/backends/path_costs.py): each request takes
the path that would finish it first by the cost model at the workers' loads now, what the server
measured corrects the model, and the output is full-KV decoding's whichever path it takes."""

from __future__ import annotations

import dataclasses

import pytest

from tests.serve_fixtures import CONTEXT, start_server
from vericache.engine.link import LinkSpec
from vericache.errors import InvalidRequestError
from vericache.scheduler.path_choice import ServingPath
from vericache.serve.api_types import GenerateSummary
from vericache.serve.backends.auto_path import PRIOR_ACCEPTED_SHARE, PROBES, AutoPaths
from vericache.serve.backends.co_runners import StartedBeside
from vericache.serve.backends.path_costs import (
    PathCosts,
    PathOption,
    RequestShape,
    default_device_profile,
)
from vericache.serve.config import CoordinatorConfig
from vericache.sim.profiles import model_profile

LOCAL, VERICACHE = ServingPath.FULL_LOCAL, ServingPath.VERICACHE
REMOTE, WARM = ServingPath.FULL_REMOTE, ServingPath.FULL_WARM
MODEL = model_profile("smollm2-135m")
KV_BYTES_PER_TOKEN = 2 * MODEL.num_layers * MODEL.num_kv_heads * MODEL.head_dim * 4  # float32
SHAPE = RequestShape("p", 3200, 40, 96, 8, 0.25)
# The prefix's full KV crosses in about 3 s, some hundred tokens' decoding.
LINK = LinkSpec(SHAPE.prefix_tokens * KV_BYTES_PER_TOKEN / 3.0)


def costs() -> PathCosts:
    return PathCosts(MODEL, default_device_profile("cpu:avx512:float32"), KV_BYTES_PER_TOKEN, 4)


def summary(
    ttft_s: float, tokens_per_s: float, num_tokens: int = 96, accepted=()
) -> GenerateSummary:
    return GenerateSummary(
        finish_reason="length", num_tokens=num_tokens, rounds=max(1, len(accepted)),
        accepted_per_round=tuple(accepted), link_bytes=0, store_bytes=0, link_wait_s=0.0,
        store_wait_s=0.0, ttft_s=ttft_s, tokens_per_s=tokens_per_s, total_s=ttft_s + 1.0,
    )  # fmt: skip


def options(local_load: int = 0, drafter_load: int = 0, warm: bool = False) -> list[PathOption]:
    full = WARM if warm else REMOTE
    return [
        PathOption(LOCAL, "verifier-0", local_load),
        PathOption(VERICACHE, "drafter-0", drafter_load, local_load, warm, LINK),
        PathOption(full, "drafter-0", drafter_load, link=LINK),
    ]


def test_the_cost_model_prices_every_path_from_the_first_request():
    auto = AutoPaths(costs())
    estimates = {o.path: auto.estimate(o, SHAPE) for o in options()}
    # A cold drafter's full KV crosses the link first: seconds before its first token.
    assert estimates[REMOTE].setup_s > 2.5 > estimates[LOCAL].setup_s
    # Unless its device holds the prefix's full KV from an earlier request.
    holding = dataclasses.replace(options()[2], holds_prefix=True)
    assert auto.estimate(holding, SHAPE).setup_s == pytest.approx(estimates[LOCAL].setup_s)
    # Alone, a full-KV step beats a round's steps per token on a CPU, where weights bind.
    assert estimates[LOCAL].seconds_per_token < estimates[VERICACHE].seconds_per_token
    assert auto.choose(options(), SHAPE).path is LOCAL


def test_the_loads_of_now_send_a_request_where_it_finishes_first():
    def chosen(offered: list[PathOption]) -> ServingPath:  # by a fresh server: no probe runs
        return AutoPaths(costs()).choose(offered, SHAPE).path

    # Two requests on the verifier, none on the warm drafter: full decoding there.
    assert chosen(options(local_load=2, warm=True)) is WARM
    # The drafter cold for the prefix: moving the full KV costs more than VeriCache's start.
    assert chosen(options(local_load=2)) is VERICACHE
    # Both busy: the compressed KV's cheaper steps batch better than full ones.
    assert chosen(options(local_load=4, drafter_load=4, warm=True)) is VERICACHE


def test_measurements_correct_the_model_path_by_path():
    auto = AutoPaths(costs())
    option = options()[0]
    prior = auto.estimate(option, SHAPE)

    def observe(slower: float) -> None:  # FULL_LOCAL measured `slower` times the model's
        measured = summary(prior.setup_s, 1 / (slower * prior.seconds_per_token))
        choice = auto.choose([option], SHAPE)
        auto.observe(choice, measured, load=1)
        auto.finished(choice)

    vericache = options()[1]
    vericache_prior = auto.estimate(vericache, SHAPE)
    observe(3.0)  # the first measurement replaces the prior at once
    corrected = auto.estimate(option, SHAPE)
    assert corrected.seconds_per_token == pytest.approx(3 * prior.seconds_per_token, rel=0.01)
    assert corrected.setup_s == pytest.approx(prior.setup_s, rel=0.01)
    # A path not yet measured takes the device's correction of steps, not its setup's...
    unmeasured = auto.estimate(vericache, SHAPE)
    assert unmeasured.seconds_per_token == pytest.approx(
        3 * vericache_prior.seconds_per_token, rel=0.01
    )
    assert unmeasured.setup_s == pytest.approx(vericache_prior.setup_s, rel=0.01)
    assert auto.choose(options(), SHAPE).path is LOCAL
    # ...until its own requests are measured: VeriCache at its prior now wins alone.
    measured = summary(vericache_prior.setup_s, 1 / vericache_prior.seconds_per_token)
    choice = auto.choose([vericache], SHAPE)
    auto.observe(choice, measured, load=1)
    auto.finished(choice)
    assert auto.choose(options(), SHAPE).path is VERICACHE
    for _ in range(30):  # later ones move a moving average
        observe(1.5)
    corrected = auto.estimate(option, SHAPE)
    assert corrected.seconds_per_token == pytest.approx(1.5 * prior.seconds_per_token, rel=0.01)


def test_a_turn_its_worker_keeps_spares_the_prompt_s_prefill_in_the_price():
    costs_now = costs()
    long_prompt = RequestShape("p", 3200, 2000, 96, 8, 0.25)
    fresh, kept = (PathOption(LOCAL, "verifier-0", 0, reused=n) for n in (0, 1900))
    assert costs_now.setup_s(kept, long_prompt) < costs_now.setup_s(fresh, long_prompt) / 5
    # The verifier keeps the agent's last turn, the drafter does not: it goes back there.
    auto = AutoPaths(costs_now)
    on_drafter = PathOption(WARM, "drafter-0", 0, link=LINK)
    for reused, path in ((1900, LOCAL), (0, WARM)):
        on_verifier = PathOption(LOCAL, "verifier-0", 2, reused=reused)
        assert auto.choose([on_verifier, on_drafter], long_prompt).path is path


def test_workers_busy_beside_a_path_s_worker_slow_it_by_the_measured_slowdown():
    shared = dataclasses.replace(default_device_profile("cpu:avx512:float32"), co_runner_slowdown=2)
    auto = AutoPaths(PathCosts(MODEL, shared, KV_BYTES_PER_TOKEN, 4))
    alone, beside = (PathOption(LOCAL, "verifier-0", 2, co_runners=n) for n in (0, 1))
    prior = auto.estimate(alone, SHAPE)
    assert auto.estimate(beside, SHAPE).seconds_per_token == pytest.approx(
        2 * prior.seconds_per_token
    )
    # Two requests on the verifier, none on the warm drafter beside it on one machine: that
    # drafter decodes at half speed while the verifier runs, so the request joins the verifier.
    verifier = PathOption(LOCAL, "verifier-0", 2)
    for co_runners, path in ((0, WARM), (1, LOCAL)):
        slowed = (StartedBeside(2, 1, 1),) if co_runners else ()
        drafter = PathOption(WARM, "drafter-0", 0, link=LINK, co_runners=co_runners,
                             started_beside=slowed)  # fmt: skip
        assert auto.choose([verifier, drafter], SHAPE).path is path
    # A request measured at the slowdown its co-runners predict corrects nothing.
    measured = summary(2 * prior.setup_s, 1 / (2 * prior.seconds_per_token))
    auto.observe(auto.choose([alone], SHAPE), measured, load=3, co_runners=1)
    assert auto.estimate(alone, SHAPE).seconds_per_token == pytest.approx(prior.seconds_per_token)
    assert auto.estimate(alone, SHAPE).setup_s == pytest.approx(prior.setup_s)


def test_a_path_is_charged_with_the_requests_it_slows():
    shared = dataclasses.replace(
        default_device_profile("cpu:avx512:float32"), co_runner_slowdown=1.3
    )
    costs_now = PathCosts(MODEL, shared, KV_BYTES_PER_TOKEN, 4)
    # Joining a batch of four slows each of them by its row.
    (batch,) = costs_now.slowed(PathOption(LOCAL, "verifier-0", 4), SHAPE)
    assert batch.num_requests == 4 and 1 < batch.factor < 1.5
    # Starting the idle drafter beside the busy verifier slows its five requests 1.3x; a
    # VeriCache request also adds its verifications to the verifier's batch.
    beside = (StartedBeside(5, 1, 1),)
    remote = PathOption(REMOTE, "drafter-0", 0, link=LINK, co_runners=1, started_beside=beside)
    assert [s.factor for s in costs_now.slowed(remote, SHAPE)] == pytest.approx([1.0, 1.3])
    vericache = PathOption(VERICACHE, "drafter-0", 0, 5, False, LINK, co_runners=1,
                           started_beside=beside)  # fmt: skip
    _, verifications, co_runner = costs_now.slowed(vericache, SHAPE)
    assert verifications.num_requests == 5 and verifications.factor > 1


def test_a_request_joins_the_rows_over_its_prefix_for_little():
    costs_now, auto = costs(), AutoPaths(costs())
    # Four requests on the verifier: over four other prefixes, over two, or over its own.
    apart, two, own = (
        PathOption(LOCAL, "verifier-0", 4, same_prefix=same, other_prefixes=others)
        for same, others in ((0, 4), (0, 2), (4, 0))
    )
    per_token = [costs_now.seconds_per_token(o, SHAPE, 0.6, 4) for o in (apart, two, own)]
    assert per_token[0] > per_token[1] > per_token[2]
    factors = [costs_now.slowed(o, SHAPE)[0].factor for o in (apart, own)]
    assert factors[0] > factors[1] > 1
    # The idle drafter beside the verifier, which must fetch the prefix first: it wins over a
    # verifier whose rows read other prefixes, not over one whose rows read the request's own.
    beside = (StartedBeside(4, 1, 1),)
    cold = PathOption(REMOTE, "drafter-0", 0, link=LINK, co_runners=1, started_beside=beside)
    assert auto.choose([apart, cold], SHAPE).path is REMOTE
    assert auto.choose([own, cold], SHAPE).path is LOCAL


def test_a_path_not_yet_measured_takes_one_request_at_a_time():
    auto = AutoPaths(costs())
    both = options(local_load=2, warm=True)[::2]  # FULL_LOCAL, FULL_WARM: the drafter wins
    probe = auto.choose(both, SHAPE)
    assert probe.path is WARM and probe.is_probe
    # While its probe runs, the next request goes elsewhere, unless nothing else is offered.
    assert auto.choose(both, SHAPE).path is LOCAL
    assert auto.choose(both[1:], SHAPE).path is WARM
    # Its probe ended unmeasured (cut short): the next one probes it again.
    auto.finished(probe)
    probe = auto.choose(both, SHAPE)
    assert probe.is_probe
    # Measured as the model predicts, PROBES times: open to every request, none a probe.
    for _ in range(PROBES):
        estimate = auto.estimate(probe.option, SHAPE)
        auto.observe(probe, summary(estimate.setup_s, 1 / estimate.seconds_per_token), load=1)
        auto.finished(probe)
        probe = auto.choose(both, SHAPE)
        assert probe.path is WARM
    auto.finished(probe)
    again = [auto.choose(both, SHAPE) for _ in range(2)]
    assert [c.path for c in again] == [WARM, WARM] and not any(c.is_probe for c in again)


def test_the_measured_acceptance_replaces_the_prior_pooled_over_drafts():
    auto = AutoPaths(costs())
    choice = auto.choose([options()[1]], SHAPE)
    before = auto.estimate(choice.option, SHAPE).seconds_per_token
    predicted = auto.costs.seconds_per_token(choice.option, SHAPE, 1 / 8, 0)
    # One lucky request (every draft of its 3 rounds accepted) moves it, but not all the way.
    auto.observe(choice, summary(1.0, 1 / predicted, accepted=[8] * 3), load=1)
    assert PRIOR_ACCEPTED_SHARE < auto.accepted_share < 0.75
    for _ in range(30):  # one draft in eight accepted, at the speed that predicts
        auto.observe(choice, summary(1.0, 1 / predicted, accepted=[1] * 12), load=1)
    assert auto.accepted_share == pytest.approx(1 / 8, abs=0.01)
    assert auto.estimate(choice.option, SHAPE).seconds_per_token > 1.5 * before
    # A request of many rounds weighs more than one of few.
    auto.observe(choice, summary(1.0, 1 / predicted, accepted=[8]), load=1)
    after_one_round = auto.accepted_share
    auto.observe(choice, summary(1.0, 1 / predicted, accepted=[1] * 40), load=1)
    assert auto.accepted_share < after_one_round
    assert auto.accepted_share == pytest.approx(1 / 8, abs=0.05)


def test_a_request_cut_short_teaches_nothing_of_its_speed():
    auto = AutoPaths(costs())
    option = options()[0]
    prior = auto.estimate(option, SHAPE)
    auto.observe(auto.choose([option], SHAPE), summary(prior.setup_s, 0.0, num_tokens=1), load=1)
    assert auto.estimate(option, SHAPE) == prior


def test_the_prior_is_the_gpus_datasheet_or_the_cpus_profile():
    assert default_device_profile("cuda:NVIDIA H100 80GB HBM3:sm90:bfloat16").name == "h100-sxm"
    assert default_device_profile("cuda:NVIDIA H200:sm90:bfloat16").name == "h200"
    assert default_device_profile("cpu:avx512:float32").name == "cpu"
    assert default_device_profile("cuda:Some Other GPU:sm80:bfloat16").name == "cpu"
    with pytest.raises(InvalidRequestError, match="no device profile"):
        CoordinatorConfig(cost_profile="no-such-device")


def test_the_default_mode_is_auto_or_vericache():
    assert CoordinatorConfig().default_mode == "auto"
    assert CoordinatorConfig(default_mode="vericache").default_mode == "vericache"
    with pytest.raises(InvalidRequestError, match="default_mode must be one of"):
        CoordinatorConfig(default_mode="lossy")


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
            for mode in ("auto", None, "auto"):  # auto is the default where a prefix is given
                got = client.generate(prompt, prefix_id=prefix_id, mode=mode, max_tokens=24)
                assert got.token_ids == reference.token_ids
                paths.append(got.stats["path"])
        assert set(paths) <= {"vericache", "full_local", "full_remote", "full_warm"}
        metrics = server.coordinator.metrics
        sample = metrics.registry.get_sample_value
        counted = {
            path: sample(
                "vericache:auto_paths_total", {"model_name": metrics.model_name, "path": path}
            )
            or 0
            for path in set(paths)
        }
        assert sum(counted.values()) == 3


def test_auto_offers_no_drafter_of_other_arithmetic(tiny_chat_checkpoint, tmp_path):
    import dataclasses

    from tests.serve_fixtures import wait_for
    from vericache.client import Client

    with start_server(tiny_chat_checkpoint, tmp_path, num_drafters=1) as server:
        with Client(server.target, timeout=120) as client:
            prefix_id = client.put_prefix(CONTEXT, compressor="snapkv", ratio=4)
        backend = server.coordinator.backend
        offered = {option.path for option in backend.path_options(prefix_id, (1, 2))}
        assert offered == {LOCAL, VERICACHE, REMOTE}
        (drafter,) = backend.drafters
        info = drafter.worker.info
        drafter.worker.info = dataclasses.replace(info, numerics=info.numerics + ":elsewhere")
        assert wait_for(lambda: drafter.numerics != backend.verifiers[0].numerics)
        assert [option.path for option in backend.path_options(prefix_id, (1, 2))] == [LOCAL]
