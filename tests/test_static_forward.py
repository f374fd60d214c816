"""The static forward (model/static_forward.py) on CPU: the same logits and caches, bit for bit, as
the dynamic forward, whatever its buckets pad; the forwards it cannot serve go dynamic; and the
engine's output with it is full decoding's (tests/test_cuda_graphs.py: the same under capture)."""

from __future__ import annotations

import pytest
import torch

from tests.test_engine_exactness import make_prompts
from vericache.compress import KIVI, KVQuant, PyramidKV, SnapKV, StreamingLLM
from vericache.compress.context import ModelContext
from vericache.engine.engine import Engine, EngineConfig
from vericache.engine.request import DecodeMode, Request, SamplingParams
from vericache.kv.cache import KVCache
from vericache.kv.prefixed import PrefixedLayerKV, shared_clone
from vericache.model.loader import load_model
from vericache.model.runner import ModelRunner, SequenceInput
from vericache.model.static_forward import StaticForward
from vericache.model.static_shape import bucket

PROMPT = 70
KIVI_4 = KIVI(bits=4, group_size=8, residual_length=8)


@pytest.fixture(scope="module")
def runners(tiny_checkpoint):
    """A dynamic and a static runner over the same weights."""
    loaded = load_model(str(tiny_checkpoint("llama")))
    dynamic = ModelRunner(loaded.config, loaded.weights, static_shapes=False)
    static = ModelRunner(loaded.config, loaded.weights, static_shapes=True)
    assert dynamic.static is None and isinstance(static.static, StaticForward)
    return dynamic, static


def _ids(count: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 512, (count,), generator=torch.Generator().manual_seed(seed))


_PREFIXES: dict[int, KVCache] = {}


def _prefilled(runner: ModelRunner, seed: int, compressor=None) -> KVCache:
    """A prompt's full KV, or compressed by `compressor`; "prefixed": a session's over a shared
    prefix (one copy for every seed), its own tokens after it."""
    if compressor == "prefixed":
        if id(runner) not in _PREFIXES:
            _PREFIXES[id(runner)] = prefix = runner.new_cache()
            runner.prefill(_ids(PROMPT, 99), prefix)
        session = shared_clone(_PREFIXES[id(runner)], capacity=PROMPT + 256)
        runner.prefill(_ids(5 + seed, seed), session)
        return session
    cache, ids = runner.new_cache(), _ids(PROMPT + seed, seed)
    runner.prefill(ids, cache)
    if compressor is None:
        return cache
    return compressor.compress(cache, ModelContext(runner, ids.tolist()))


# (tokens, logits, fast) per sequence, and the forward's kernel set
BATCHES = {
    "one exact token (a spare row)": ([(1, 1, False)], True),
    "three decode steps (bucket 4)": ([(1, 1, False)] * 3, True),
    "verifications and drafts": ([(5, 5, False), (1, 1, True), (5, 5, False), (1, 1, True)], True),
    "draft steps alone": ([(1, 1, True)] * 5, False),
    "verifications of 3 and 6 tokens (padded to 4 and 8)": ([(3, 3, False), (6, 6, False)], True),
}


@pytest.mark.parametrize(
    "compressor",
    [None, StreamingLLM(ratio=4), PyramidKV(ratio=4), "prefixed", KIVI_4],
    ids=["full", "streamingllm", "pyramidkv", "prefixed", "kivi"],
)
@pytest.mark.parametrize("name", list(BATCHES))
def test_a_static_forward_has_the_dynamic_forwards_bits(runners, name, compressor):
    dynamic, static = runners
    rows, invariant = BATCHES[name]
    sources = [_prefilled(dynamic, seed, compressor) for seed in range(len(rows))]
    results = []
    for runner in (dynamic, static):
        caches = [source.clone() for source in sources]
        before = static.static.num_forwards
        for step in range(3):  # the same buffers serve the next steps
            batch = [
                SequenceInput(_ids(n, 100 * step + i), cache, logits, fast_attention=fast)
                for i, ((n, logits, fast), cache) in enumerate(zip(rows, caches))
            ]
            logits = runner.forward(batch, invariant=invariant)
        results.append((logits, caches))
        # Drafts over KIVI's packed codes are static; exact rows over them are not.
        served = compressor is not KIVI_4 or any(fast for *_, fast in rows)
        assert static.static.num_forwards - before == (3 if runner is static and served else 0)
    (ours, our_caches), (theirs, their_caches) = results[1], results[0]
    for mine, reference in zip(ours, theirs):
        assert torch.equal(mine, reference)
    for mine, reference in zip(our_caches, their_caches):
        assert mine.num_tokens == reference.num_tokens
        assert mine.to_state().equals(reference.to_state())


def test_the_forwards_it_cannot_serve_go_dynamic(runners, tiny_checkpoint):
    dynamic, static = runners

    def shape(cache, n=1, **fields):
        return static.static.split([SequenceInput(_ids(n, 0), cache, n, **fields)], True)

    assert shape(_prefilled(dynamic, 0)) is not None
    prefixed = _prefilled(dynamic, 0, "prefixed")
    assert isinstance(prefixed.layers[0], PrefixedLayerKV) and shape(prefixed) is not None
    quantized = KIVI_4.compress(_prefilled(dynamic, 0))
    assert shape(quantized) is None  # an exact row over packed codes
    assert shape(quantized, fast_attention=True) is not None  # a draft over them
    outliers = _prefilled(dynamic, 0, KVQuant(bits=4, group_size=8, residual_length=8))
    assert shape(outliers, fast_attention=True) is None
    assert shape(_prefilled(dynamic, 0), n=600) is None  # a prefill chunk
    prefill = SequenceInput(_ids(40, 0), _prefilled(dynamic, 0), 1)  # wants one token's logits
    assert static.static.split([prefill], True) is None
    assert shape(_prefilled(dynamic, 0), observe=lambda *args: None) is None
    full = dynamic.new_cache()
    dynamic.prefill(_ids(250, 0), full)
    assert full.layers[0].capacity - full.layers[0].num_slots == 6  # a 256-slot buffer
    # 5 tokens feed 8 (3 padding): no room.
    assert shape(full, n=4) is not None and shape(full, n=5) is None
    # Past the largest bucket, and beside one it cannot serve: those it can, the others dynamic.
    too_many = [SequenceInput(_ids(1, i), full, 1) for i in range(65)]
    split = static.static.split([*too_many, SequenceInput(_ids(1, 0), quantized, 1)], True)
    assert split.chosen == list(range(64)) and bucket(65) is None
    assert split.placed == [(0, i) for i in range(64)]
    windowed = load_model(str(tiny_checkpoint("mistral")))
    windowed_runner = ModelRunner(windowed.config, windowed.weights, static_shapes=True)
    cache = windowed_runner.new_cache()
    windowed_runner.prefill(_ids(10, 0), cache)
    assert windowed_runner.static.split([SequenceInput(_ids(1, 0), cache, 1)], True) is None


@pytest.fixture(scope="module")
def static_engine(tiny_checkpoint):
    loaded = load_model(str(tiny_checkpoint("llama")))
    runner = ModelRunner(loaded.config, loaded.weights, static_shapes=True)
    return Engine(runner, None, EngineConfig())


def _requests(mode, compressor=None, draft_len=6, params=SamplingParams(max_new_tokens=24)):
    return [
        Request(ids, prefix, params, mode, compressor, draft_len, request_id=str(i))
        for i, (ids, prefix) in enumerate(make_prompts())
    ]


@pytest.mark.parametrize(
    "compressor",
    [StreamingLLM(ratio=4), SnapKV(ratio=4), KIVI(bits=4, group_size=8, residual_length=8)],
    ids=["streamingllm", "snapkv", "kivi"],
)
def test_vericache_over_static_forwards_equals_full_decoding(
    tiny_engine, static_engine, compressor
):
    reference = [out.token_ids for out in tiny_engine().generate(_requests(DecodeMode.FULL))]
    before = static_engine.runner.static.num_forwards
    full = static_engine.generate(_requests(DecodeMode.FULL))
    vericache = static_engine.generate(_requests(DecodeMode.VERICACHE, compressor))
    assert [out.token_ids for out in full] == reference
    assert [out.token_ids for out in vericache] == reference
    assert static_engine.runner.static.num_forwards > before


def test_sampled_vericache_over_static_forwards_samples_what_full_kv_samples(
    tiny_engine, static_engine
):
    params = SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.9, seed=7)
    reference = tiny_engine().generate(_requests(DecodeMode.FULL, params=params))
    ours = static_engine.generate(_requests(DecodeMode.VERICACHE, StreamingLLM(ratio=4), 6, params))
    assert [out.token_ids for out in ours] == [out.token_ids for out in reference]


class _WrongGraph:
    """A captured graph whose replay leaves its logits at zero: what a capture that broke the
    kernels' arithmetic could give."""

    def __init__(self, step):
        step.output = torch.zeros(step.shape.num_tokens, 512)

    def replay(self) -> None:
        pass


def _failing_capture(step):
    raise RuntimeError("operation not permitted when stream is capturing")


def _no_copies(step, batch, placed):
    raise torch.OutOfMemoryError("no room for a copy of a cache")


@pytest.mark.parametrize(
    "capture, probes",
    [(_failing_capture, None), (_WrongGraph, None), (_WrongGraph, _no_copies)],
    ids=["capture-fails", "replay-differs", "no-copy-to-check-against"],
)
def test_a_failed_or_wrong_capture_leaves_the_caches_as_before_and_goes_dynamic(
    runners, monkeypatch, capture, probes
):
    """On CUDA a shape's first step is captured, and its first replay's exact rows checked
    against the dynamic forward. Where capture fails or the rows differ, the step's reservations
    are rolled back, it runs dynamic, and so does every later forward (the capture path, staged
    through its tables, run on CPU with a capture that fails or a graph that computes wrong)."""
    from vericache.kernels import triton_ops
    from vericache.model import static_forward
    from vericache.model.static_forward import StaticForward

    dynamic, _ = runners
    loaded_runner = ModelRunner(dynamic.config, dynamic.weights, static_shapes=False)
    loaded_runner.static = static = StaticForward(loaded_runner, tables=True)
    static.captures = True
    monkeypatch.setattr(triton_ops, "available", lambda: True)

    def captured(step):
        step.graph = capture(step)

    monkeypatch.setattr(static, "_capture", captured)
    if probes is not None:
        monkeypatch.setattr(static_forward, "_probes", probes)
    results = []
    for runner in (dynamic, loaded_runner):
        caches = [_prefilled(dynamic, seed) for seed in range(2)]
        logits = runner.forward(
            [SequenceInput(_ids(3, i), cache, 3) for i, cache in enumerate(caches)], True
        )
        results.append((logits, caches))
    assert static.failed and static.num_forwards == 0
    assert static.split([SequenceInput(_ids(1, 0), _prefilled(dynamic, 0), 1)], True) is None
    for mine, reference in zip(*(logits for logits, _ in results)):
        assert torch.equal(mine, reference)
    for mine, reference in zip(*(caches for _, caches in results)):
        assert mine.to_state().equals(reference.to_state())


def test_the_largest_steps_go_dynamic(runners):
    _, static = runners
    verifications = [
        SequenceInput(_ids(32, i), _prefilled(static, 0), 32) for i in range(17)
    ]  # 17 padded to 32 sequences of 32 tokens: past MAX_ROWS
    assert static.static.split(verifications, True) is None
    assert static.static.split(verifications[:16], True) is not None


def kivi_draft_sources(runner: ModelRunner) -> list[KVCache]:
    """Three KIVI-4 caches (prompts of 45, 70 and 33 tokens), prefilled by the dynamic forward:
    drafts over them fill a bucket of four with a padding sequence."""
    sources = []
    with runner.dynamic_only():
        for length in (45, 70, 33):
            cache = runner.new_cache()
            runner.prefill(torch.arange(3, 3 + length), cache)
            sources.append(KIVI_4.compress(cache))
    return sources


def kivi_draft_steps(runner: ModelRunner, sources: list[KVCache]):
    """Three draft steps of the three over copies of `sources`: their logits and the copies."""
    caches, logits = [source.clone() for source in sources], []
    for step in range(3):
        batch = [
            SequenceInput(torch.tensor([7 + step + i]), cache, 1, fast_attention=True)
            for i, cache in enumerate(caches)
        ]
        logits += runner.forward(batch, invariant=False)
    return logits, caches
