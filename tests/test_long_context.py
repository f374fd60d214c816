"""Long-context decoding (Pipeline 1) on the tiny model: output equal to full-KV decoding, the
device-memory budget enforced and used for more requests than the full-KV baseline holds, full-KV
loads complete before their verification, and the CPU loader held to its bandwidth."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from tests.compressor_table import TABLE, pick, row_id
from tests.timing import SLACK, slept_s
from vericache.compress import KIVI, StreamingLLM
from vericache.engine.device_memory import (
    DeviceMemory,
    DeviceMemoryError,
    compressed_prefill_bound,
    full_kv_bytes,
)
from vericache.engine.engine import DraftKVSource, EngineConfig
from vericache.engine.host_kv import HostKV, KVLoader, move_compressed
from vericache.engine.long_context import LongContextEngine
from vericache.engine.long_context_config import LongContextConfig
from vericache.engine.request import DecodeMode, Request, SamplingParams
from vericache.errors import InvalidRequestError
from vericache.kv.exact import ExactKV
from vericache.model.runner import SequenceInput
from vericache.scheduler import LockstepScheduler

MAX_NEW = 24
# (prefix tokens, suffix tokens): every full KV fits one 1024-slot key block, so every request
# reserves the same full KV.
PROMPT_SHAPES = [(300, 8), (600, 12), (0, 20), (900, 10), (450, 6), (750, 9), (150, 5), (820, 4)]
FAST_LINK = 1e12  # bytes/s: every load spans one iteration


def make_requests(mode, compressor=None, draft_len=4, params=None, num=None):
    generator = torch.Generator().manual_seed(1)
    params = params or SamplingParams(max_new_tokens=MAX_NEW)
    requests = []
    for index, (prefix, suffix) in enumerate(PROMPT_SHAPES[: num or len(PROMPT_SHAPES)]):
        ids = torch.randint(3, 512, (prefix + suffix,), generator=generator).tolist()
        requests.append(Request(ids, prefix, params, mode, compressor, draft_len, str(index)))
    return requests


@pytest.fixture(scope="module")
def full_outputs(tiny_engine):
    return [out.token_ids for out in tiny_engine().generate(make_requests(DecodeMode.FULL))]


@pytest.fixture(scope="module")
def sizes(tiny_engine):
    """(weights bytes, full KV bytes of any test request)."""
    runner = tiny_engine().runner
    (request,) = make_requests(DecodeMode.FULL, num=1)
    return runner.weights.nbytes, full_kv_bytes(request, runner.config, 4)


@pytest.fixture
def make_engine(tiny_engine):
    engines = []

    def make(
        budget=None, link=FAST_LINK, iteration_s=None, config=EngineConfig(), cls=None, **options
    ):
        long_context = LongContextConfig(budget, link, iteration_s, **options)
        engine = (cls or LongContextEngine)(tiny_engine().runner, None, config, long_context)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


def budget_for(sizes, num_full: float) -> int:
    weights, full = sizes
    return int(weights + num_full * full)


STREAMING_EASY, STREAMING_HARD = pick("streamingllm")
KIVI_EASY, KIVI_HARD = pick("kivi")


@pytest.mark.parametrize(
    "compressor, draft_len",
    [
        (STREAMING_EASY, 1),
        (STREAMING_EASY, 30),
        (STREAMING_HARD, 4),
        (dataclasses.replace(STREAMING_EASY, dtype="bfloat16"), 30),
        (dataclasses.replace(STREAMING_HARD, dtype="float16"), 4),
        (KIVI_EASY, 4),
        (KIVI_HARD, 30),
    ],
    ids=lambda p: getattr(p, "label", p),
)
def test_outputs_equal_full_decoding(make_engine, sizes, full_outputs, compressor, draft_len):
    engine = make_engine(budget_for(sizes, 4.5))
    outputs = engine.generate(make_requests(DecodeMode.VERICACHE, compressor, draft_len))
    assert [out.token_ids for out in outputs] == full_outputs
    assert [out.request_id for out in outputs] == [str(i) for i in range(len(PROMPT_SHAPES))]
    for out in outputs:
        stats = out.stats
        assert stats.rounds >= 1
        assert all(0 <= a <= d for a, d in zip(stats.accepted_per_round, stats.drafted_per_round))
    assert engine.stats.num_loads == sum(out.stats.rounds for out in outputs)
    assert engine.stats.num_output_tokens == sum(len(out.token_ids) for out in outputs)


def test_drafter_kv_source_is_exact_too(make_engine, sizes, full_outputs):
    engine = make_engine(budget_for(sizes, 4.5), config=EngineConfig(DraftKVSource.DRAFTER))
    outputs = engine.generate(make_requests(DecodeMode.VERICACHE, StreamingLLM(ratio=4), 6))
    assert [out.token_ids for out in outputs] == full_outputs


def test_budget_holds_more_requests_than_the_full_baseline(make_engine, sizes, full_outputs):
    budget = budget_for(sizes, 4.5)
    full = make_engine(budget)
    baseline = full.generate(make_requests(DecodeMode.FULL, num=6))
    assert [out.token_ids for out in baseline] == full_outputs[:6]
    # floor((budget - weights) / full KV) at once, the rest queued.
    assert full.stats.max_running == 4
    assert full.stats.peak_device_bytes == budget_for(sizes, 4)

    # A link slow enough that loads span several iterations and overlap one another.
    engine = make_engine(budget, link=20e6, iteration_s=2e-3)
    checked = []
    end_iteration = engine.scheduler.end_iteration

    def checked_end_iteration(elapsed_s=None):
        # What is held never exceeds what the scheduler planned for this iteration.
        planned = engine.scheduler.memory_in_use(engine.scheduler.iteration)
        checked.append(engine.memory.in_use_bytes <= planned)
        end_iteration(elapsed_s)

    engine.scheduler.end_iteration = checked_end_iteration
    outputs = engine.generate(make_requests(DecodeMode.VERICACHE, StreamingLLM(ratio=4), 8))
    assert [out.token_ids for out in outputs] == full_outputs
    assert checked and all(checked)
    assert engine.stats.peak_device_bytes <= budget
    assert engine.stats.max_running > full.stats.max_running
    assert engine.memory.in_use_bytes == engine.memory.weights_bytes  # everything released


def test_lockstep_baseline_is_exact_and_loads_every_full_kv_together(
    make_engine, sizes, full_outputs
):
    # Every request prefilled before the first round, which then takes them all.
    engine = make_engine(budget_for(sizes, 12), lockstep_draft_len=5, max_parked=8)
    assert isinstance(engine.scheduler, LockstepScheduler)
    outputs = engine.generate(make_requests(DecodeMode.VERICACHE, StreamingLLM(ratio=4), 5))
    assert [out.token_ids for out in outputs] == full_outputs
    assert all(max(out.stats.drafted_per_round) == 5 for out in outputs)
    # The first round verifies all eight together: their full KVs are on the device at once.
    weights, full = sizes
    assert engine.stats.peak_device_bytes >= weights + len(PROMPT_SHAPES) * full
    assert engine.stats.peak_full_kv_bytes == len(PROMPT_SHAPES) * full
    assert engine.memory.in_use_bytes == engine.memory.weights_bytes


class CheckedEngine(LongContextEngine):
    """Checks, before each verification, that every full KV has arrived whole (and that the
    drafts stayed within the device memory held for them); counts the forwards that draft and
    verify at once."""

    num_shared_forwards = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        run = self.forward.run

        def checked_run(compressed_batch, full_batch):
            self._check_forward(compressed_batch, full_batch)
            run(compressed_batch, full_batch)

        self.forward.run = checked_run

    def _check_forward(self, compressed_batch, full_batch):
        self.num_shared_forwards += bool(compressed_batch and full_batch)
        for seq in full_batch:
            assert seq.full_cache.num_tokens == len(seq.token_ids) - 1
            key = next(k for k, s in self._running.items() if s is seq)
            host, full = self._host[key], seq.full_cache
            assert host.num_tokens == full.num_tokens
            # The drafts stayed within the room held for them.
            assert seq.compressed_cache.resident_bytes <= self.memory.held(("compressed", key))
            for layer, host_keys, host_values in zip(full.layers, host.keys, host.values):
                keys, values = layer.keys_values()  # [T, H, D]; the host's are [H, T, D]
                n = host.num_tokens
                assert torch.equal(keys[: full.num_tokens], host_keys[:, :n].transpose(0, 1))
                assert torch.equal(values[: full.num_tokens], host_values[:, :n].transpose(0, 1))


def test_late_loads_are_waited_for(make_engine, sizes, full_outputs):
    # An iteration estimate far too long: loads start one iteration ahead and arrive late.
    engine = make_engine(budget_for(sizes, 4.5), link=2e6, iteration_s=1.0, cls=CheckedEngine)
    requests = make_requests(DecodeMode.VERICACHE, StreamingLLM(ratio=1), 30, num=2)
    outputs = engine.generate(requests)
    assert [out.token_ids for out in outputs] == full_outputs[:2]
    assert engine.stats.num_late_loads > 0 and engine.stats.stall_s > 0


def test_loads_started_ahead_arrive_in_time(make_engine, sizes, full_outputs):
    engine = make_engine(budget_for(sizes, 4.5), cls=CheckedEngine)
    outputs = engine.generate(make_requests(DecodeMode.VERICACHE, StreamingLLM(ratio=4), 4))
    assert [out.token_ids for out in outputs] == full_outputs
    # A fast link: (nearly) every load is complete before its verification, and the draft step
    # of the others then shares the verification's forward.
    assert engine.stats.num_late_loads <= engine.stats.num_loads // 3
    assert engine.num_shared_forwards > 0


def test_requests_added_while_running(make_engine, sizes, full_outputs):
    engine = make_engine(budget_for(sizes, 4.5))
    requests = make_requests(DecodeMode.VERICACHE, KIVI(bits=2, group_size=8), 4)
    keys = [engine.add_request(request) for request in requests[:3]]
    outputs = {}
    for _ in range(5):
        outputs |= engine.run_iteration()
    keys += [engine.add_request(request) for request in requests[3:]]
    while engine.has_unfinished:
        outputs |= engine.run_iteration()
    assert [outputs[key].token_ids for key in keys] == full_outputs


def test_adaptive_draft_lengths_follow_acceptance(make_engine, sizes, full_outputs):
    engine = make_engine(budget_for(sizes, 4.5))
    requests = [
        dataclasses.replace(r, adaptive_draft_len=True)
        for r in make_requests(DecodeMode.VERICACHE, StreamingLLM(ratio=4), 24)
    ]
    outputs = engine.generate(requests)
    assert [out.token_ids for out in outputs] == full_outputs
    for out in outputs:
        drafted, accepted = out.stats.drafted_per_round, out.stats.accepted_per_round
        assert max(drafted) <= 24  # the request's draft_len bounds its adaptive length
        if accepted[0] == drafted[0]:
            assert drafted[1] > drafted[0]  # all accepted: draft longer
        else:
            assert max(drafted[1:]) <= 12  # rejections: draft short (never under the load span)


@pytest.mark.parametrize("mode", [DecodeMode.VERICACHE, DecodeMode.FULL])
def test_abort_frees_what_a_request_held(make_engine, sizes, full_outputs, mode):
    # A slow link: loads are in flight when the abort comes.
    engine = make_engine(budget_for(sizes, 2.5), link=20e6, iteration_s=2e-3)
    requests = make_requests(mode, StreamingLLM(ratio=4) if mode is DecodeMode.VERICACHE else None)
    keys = [engine.add_request(request) for request in requests[:4]]
    outputs = {}
    for _ in range(6):
        outputs |= engine.run_iteration()
    assert engine.output_ids(keys[0]) == full_outputs[0][: len(engine.output_ids(keys[0]))]
    assert engine.output_ids(keys[3]) == []  # not prefilled yet: the budget holds fewer
    engine.abort(keys[0])  # running
    engine.abort(keys[3])  # waiting for its prefill
    with pytest.raises(KeyError):
        engine.abort(keys[0])
    while engine.has_unfinished:
        outputs |= engine.run_iteration()
    assert set(outputs) == {keys[1], keys[2]}
    assert [outputs[key].token_ids for key in keys[1:3]] == full_outputs[1:3]
    assert engine.memory.in_use_bytes == engine.memory.weights_bytes


@pytest.mark.parametrize("max_new", [1, 2])
def test_tiny_token_budgets(make_engine, sizes, full_outputs, max_new):
    engine = make_engine(budget_for(sizes, 4.5))
    params = SamplingParams(max_new_tokens=max_new)
    outputs = engine.generate(make_requests(DecodeMode.VERICACHE, StreamingLLM(), 4, params, 3))
    assert [out.token_ids for out in outputs] == [ids[:max_new] for ids in full_outputs[:3]]
    assert engine.stats.num_loads == (3 if max_new == 2 else 0)


def test_refusals(make_engine, sizes):
    engine = make_engine(budget_for(sizes, 1) + 1024)
    (vericache,) = make_requests(DecodeMode.VERICACHE, StreamingLLM(), num=1)
    with pytest.raises(InvalidRequestError, match="budget"):
        engine.add_request(vericache)  # the prefill needs a full KV and its compressed KV
    # The prefill fits; decoding, its compressed KV grown by every output token, would not.
    prefill_bound = compressed_prefill_bound(vericache, engine.model_config, 4)
    with pytest.raises(InvalidRequestError, match="to decode"):
        make_engine(budget_for(sizes, 1) + prefill_bound + 1).add_request(vericache)
    (lossy,) = make_requests(DecodeMode.LOSSY, StreamingLLM(), num=1)
    with pytest.raises(InvalidRequestError, match="vericache or full"):
        engine.add_request(lossy)
    (full,) = make_requests(DecodeMode.FULL, num=1)
    engine.add_request(full)
    with pytest.raises(InvalidRequestError, match="one mode"):
        engine.add_request(vericache)
    with pytest.raises(InvalidRequestError, match="weights"):
        make_engine(sizes[0])
    with pytest.raises(InvalidRequestError, match="window"):
        make_engine(budget_for(sizes, 4), link=1e3, iteration_s=1e-3).add_request(vericache)


@pytest.mark.parametrize("compressor", TABLE, ids=row_id)
def test_prefill_compressed_kv_within_its_bound(make_engine, compressor):
    engine = make_engine()
    for request in make_requests(DecodeMode.VERICACHE, compressor, num=4):
        if not request.num_prefix_tokens:
            continue  # nothing to compress
        seq = engine.starter.start(request)  # the prefill alone, as the engine runs it
        element_size = engine.runner.dtype.itemsize
        bound = compressed_prefill_bound(request, engine.model_config, element_size)
        assert seq.compressed_cache.resident_bytes <= bound


def test_compressed_kv_in_16_bits_is_bounded_at_2_bytes_an_element(make_engine):
    engine = make_engine()
    element_size = engine.runner.dtype.itemsize
    for request in make_requests(DecodeMode.VERICACHE, StreamingLLM(ratio=3, dtype="bfloat16")):
        if not request.num_prefix_tokens:
            continue
        seq = engine.starter.start(request)
        bound = compressed_prefill_bound(request, engine.model_config, element_size)
        as_float32 = dataclasses.replace(request, compressor=StreamingLLM(ratio=3))
        assert seq.compressed_cache.resident_bytes <= bound
        assert bound < compressed_prefill_bound(as_float32, engine.model_config, element_size)


def test_device_memory_accountant():
    memory = DeviceMemory(budget_bytes=1000, weights_bytes=100)
    memory.hold("a", 500)
    memory.hold("b", 300)
    assert memory.in_use_bytes == 900 and memory.fits(100) and not memory.fits(101)
    memory.hold("a", 200)  # shrinks
    with pytest.raises(DeviceMemoryError, match="budget of 1000"):
        memory.hold("c", 401)
    assert memory.held("c") == 0 and memory.in_use_bytes == 600
    memory.release("a")
    memory.release("a")
    assert memory.in_use_bytes == 400 and memory.peak_bytes == 900
    # Bytes by kind of owner: ("full", key) owners add up under "full".
    memory.hold(("full", 1), 150)
    memory.hold(("full", 2), 250)
    memory.release(("full", 1))
    memory.hold(("full", 3), 100)
    assert memory.kind_bytes["full"] == 350 and memory.kind_peak_bytes["full"] == 400
    assert memory.kind_peak_bytes["b"] == 300


def test_cpu_loader_honours_its_bandwidth(tiny_engine):
    runner = tiny_engine().runner
    cache = runner.new_cache(capacity=4096)
    runner.prefill(torch.arange(2000) % 500 + 3, cache, num_logits=0)
    host = HostKV.from_cache(cache, capacity=4096)
    assert host.nbytes == 2000 * runner.config.kv_bytes_per_token(4)  # 1,024,000 bytes
    bandwidth = 5e6
    loader = KVLoader("cpu", bandwidth)
    try:
        start = time.perf_counter()
        pending = [loader.start(host) for _ in range(2)]  # two loads share the link
        first, second = (load.wait() for load in pending)
        elapsed = time.perf_counter() - start
    finally:
        loader.close()
    expected = host.nbytes / bandwidth  # 0.2 s each
    # Never faster than the link; slower only by how late a busy machine wakes the loader, as it
    # wakes a plain sleep of as long.
    assert 0.98 * expected <= first.load_s <= SLACK * slept_s(expected)
    assert 1.96 * expected <= elapsed <= SLACK * slept_s(2 * expected)
    for layer, loaded in zip(cache.layers, second.cache.layers):
        assert torch.equal(layer.keys_values()[0][:2000], loaded.keys_values()[0][:2000])
        assert torch.equal(layer.positions(), loaded.positions())
    assert second.cache.is_full and second.cache.num_tokens == 2000


def test_cpu_load_hands_over_the_host_buffers(tiny_engine):
    """On CPU a load is the host KV itself: a verification's tokens land in host memory, and
    committing them copies nothing."""
    runner = tiny_engine().runner
    cache = runner.new_cache(capacity=2048)
    runner.prefill(torch.arange(700) % 500 + 3, cache, num_logits=0)
    host = HostKV.from_cache(cache, capacity=2048)
    loader = KVLoader("cpu")
    try:
        loaded = loader.start(host).wait().cache
    finally:
        loader.close()
    assert loaded.layers[0].keys_values()[0].data_ptr() == host.keys[0].data_ptr()
    new_tokens = torch.tensor([5, 6, 7])
    runner.forward([SequenceInput(new_tokens, loaded, 3)], invariant=True)
    runner.forward([SequenceInput(new_tokens, cache, 3)], invariant=True)
    loaded.truncate(702)  # two of the three kept, as after a verification
    host.append(ExactKV.of(loaded, 700, 702, copy=False))
    assert host.num_tokens == 702
    for layer, keys, values in zip(cache.layers, host.keys, host.values):  # host: [H, T, D]
        expected_keys, expected_values = layer.keys_values()
        assert torch.equal(keys[:, :702].transpose(0, 1), expected_keys[:702])
        assert torch.equal(values[:, :702].transpose(0, 1), expected_values[:702])
        assert torch.count_nonzero(keys[:, 703:]) == 0  # padding attention reads stays finite


@pytest.mark.parametrize("compressor", pick("streamingllm", "kivi"), ids=row_id)
def test_move_compressed_keeps_every_bit(tiny_engine, compressor):
    runner = tiny_engine().runner
    cache = runner.new_cache()
    runner.prefill(torch.arange(3, 203), cache, num_logits=0)
    compressed = compressor.compress(cache)
    moved = move_compressed(compressed, "cpu", runner.rope)
    assert moved.to_state().equals(compressed.to_state())
    assert moved.compressor is compressor and moved.resident_bytes == compressed.resident_bytes
