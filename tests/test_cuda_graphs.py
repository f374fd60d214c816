"""Static forwards captured in CUDA graphs (model/static_forward.py), where a GPU is present: the
dynamic forward's bits, whichever caches a replay serves, and vericache's output full decoding's
with graphs on and off (tests/test_static_forward.py: the same path on CPU, uncaptured;
tests/test_triton_interpreter.py: its table kernels under Triton's interpreter)."""

from __future__ import annotations

import pytest
import torch

from tests.test_static_forward import kivi_draft_sources, kivi_draft_steps
from vericache.compress import KIVI, SnapKV, StreamingLLM
from vericache.engine.engine import Engine, EngineConfig
from vericache.engine.request import DecodeMode, Request, SamplingParams
from vericache.kv.prefixed import shared_clone
from vericache.model.loader import load_model
from vericache.model.runner import ModelRunner, SequenceInput

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def runner(request, tiny_checkpoint):
    loaded = load_model(str(tiny_checkpoint("llama")), dtype=request.param, device="cuda")
    runner = ModelRunner(loaded.config, loaded.weights, "cuda")
    assert runner.static is not None and runner.static.captures  # the default on CUDA
    return runner


def _ids(count: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 512, (count,), generator=torch.Generator().manual_seed(seed))


def _sessions(runner: ModelRunner, seed: int) -> list:
    """Two caches of their own and two over one shared prefix, each with its prompt's KV."""
    with runner.dynamic_only():
        prefix = runner.new_cache(capacity=256)
        runner.prefill(_ids(70, seed), prefix, invariant=True)
        caches = [runner.new_cache(capacity=512), runner.new_cache(capacity=512)]
        caches += [shared_clone(prefix, capacity=512) for _ in range(2)]
        for i, cache in enumerate(caches):
            runner.prefill(_ids(30 + 7 * i, seed + i), cache, invariant=True)
    return caches


def _steps(runner: ModelRunner, caches: list, seed: int) -> list[torch.Tensor]:
    """Decode steps, then verifications (padded to token buckets), then a mixed step."""
    logits = []
    for step, rows in enumerate(([1, 1, 1, 1], [1, 1, 1, 1], [3, 4, 6, 5], [4, 1, 4, 1])):
        batch = [
            SequenceInput(_ids(n, 1000 * seed + 10 * step + i), cache, n)
            for i, (n, cache) in enumerate(zip(rows, caches))
        ]
        logits += runner.forward(batch, invariant=True)
    torch.cuda.synchronize()
    return logits


def test_a_captured_step_has_the_dynamic_forwards_bits_for_any_caches(runner):
    for seed in (0, 1):  # the second set of caches lies elsewhere: the same graphs serve it
        caches = _sessions(runner, seed)
        twins = [cache.clone() for cache in caches]
        captured_before = runner.static.num_captured
        ours = _steps(runner, caches, seed)
        with runner.dynamic_only():
            reference = _steps(runner, twins, seed)
        for mine, theirs in zip(ours, reference):
            assert torch.equal(mine, theirs)
        for mine, theirs in zip(caches, twins):
            assert mine.to_state().equals(theirs.to_state())
        if seed == 1:
            assert runner.static.num_captured == captured_before  # replayed, not captured again


def test_a_replayed_step_allocates_only_its_logits(runner):
    caches = _sessions(runner, 3)
    batch = lambda: [SequenceInput(_ids(1, 0), cache, 1) for cache in caches]  # noqa: E731
    runner.forward(batch(), invariant=True)  # captured
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    for _ in range(5):
        logits = runner.forward(batch(), invariant=True)
    torch.cuda.synchronize()
    del logits
    after = torch.cuda.memory_stats()["allocation.all.allocated"]
    assert after - before <= 5 * 2  # per step: the logits' copy and the ids' staging at most


def _requests(mode, compressor=None, params=SamplingParams(max_new_tokens=32)):
    generator = torch.Generator().manual_seed(5)
    prompts = [(96, 8), (300, 12), (0, 20)]
    return [
        Request(
            tuple(torch.randint(3, 512, (prefix + suffix,), generator=generator).tolist()),
            prefix, params, mode, compressor, 6, request_id=str(i),
        )
        for i, (prefix, suffix) in enumerate(prompts)
    ]  # fmt: skip


@pytest.mark.parametrize(
    "compressor",
    [StreamingLLM(ratio=4), SnapKV(ratio=4), KIVI(bits=4, group_size=8, residual_length=8)],
    ids=["streamingllm", "snapkv", "kivi"],
)
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_vericache_equals_full_with_graphs_on_and_off(tiny_checkpoint, compressor, sampled):
    params = SamplingParams(max_new_tokens=32)
    if sampled:
        params = SamplingParams(max_new_tokens=32, temperature=0.8, top_p=0.9, seed=11)
    outputs = {}
    for graphs in (False, True):
        config = EngineConfig(static_shapes=graphs)
        engine = Engine.from_pretrained(str(tiny_checkpoint("llama")), device="cuda", config=config)
        full = engine.generate(_requests(DecodeMode.FULL, params=params))
        ours = engine.generate(_requests(DecodeMode.VERICACHE, compressor, params))
        outputs[graphs] = ([o.token_ids for o in full], [o.token_ids for o in ours])
        if graphs:
            assert engine.runner.static.num_captured > 0
    assert outputs[True][0] == outputs[False][0]  # full decoding, graphs or not
    assert outputs[True][1] == outputs[True][0] == outputs[False][1]


def test_captured_drafts_over_kivi_follow_the_dynamic_forward(runner):
    """Drafts over packed codes (fast rows: close, not bit for bit)."""
    sources = kivi_draft_sources(runner)
    captured, _ = kivi_draft_steps(runner, sources)
    with runner.dynamic_only():
        dynamic, _ = kivi_draft_steps(runner, sources)
    results = [torch.cat(logits).float() for logits in (captured, dynamic)]
    tolerance = 1e-3 if runner.dtype == torch.float32 else 5e-2
    torch.testing.assert_close(results[0], results[1], atol=tolerance, rtol=tolerance)
