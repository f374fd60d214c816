"""Log-probabilities (`SamplingParams.logprobs`): a vericache request reports, for each output
token, what full-KV decoding reports, bit for bit (they come from the verifier's full-KV logits),
under greedy and seeded sampling, penalties and a grammar; they are the log-softmax of the logits
each token was chosen from (vLLM's processed logprobs); greedy choices are penalized as vLLM
penalizes them; the long-context engine reports them too."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tests.compressor_table import pick
from tests.test_engine_sampling import long_context_generate, requests
from vericache.engine.request import DecodeMode, SamplingParams

MAX_NEW = 20
GREEDY = SamplingParams(max_new_tokens=MAX_NEW, logprobs=4)
SETTINGS = {
    "greedy": GREEDY,
    "greedy-penalized": dataclasses.replace(GREEDY, repetition_penalty=1.3, presence_penalty=0.4),
    "seeded": dataclasses.replace(GREEDY, temperature=0.8, top_p=0.9, top_k=40, seed=5),
}


def _reported(outputs) -> list[list[tuple]]:
    """Each output's (token, logprob, top) per position."""
    return [[(t.token_id, t.logprob, t.top) for t in out.logprobs] for out in outputs]


@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.parametrize("draft_len", [1, 6])
def test_vericache_reports_what_full_kv_decoding_reports(tiny_engine, name, draft_len):
    engine, params = tiny_engine(), SETTINGS[name]
    kivi2, _ = pick("kivi")
    full = engine.generate(requests(DecodeMode.FULL, params))
    vericache = engine.generate(requests(DecodeMode.VERICACHE, params, kivi2, draft_len))
    assert [out.token_ids for out in vericache] == [out.token_ids for out in full]
    assert _reported(vericache) == _reported(full)  # floats equal, not close
    for out in full:
        assert [t.token_id for t in out.logprobs] == out.token_ids
        for token in out.logprobs:
            assert len(token.top) == 4 and token.logprob <= 0
            values = [value for _, value in token.top]
            assert values == sorted(values, reverse=True)
            assert sum(math.exp(v) for v in values) <= 1 + 1e-5
            if not params.is_sampled:  # the argmax of what it was chosen from is the best
                assert token.top[0] == (token.token_id, token.logprob)


def test_greedy_choices_are_penalized(tiny_engine):
    engine = tiny_engine()
    plain = engine.generate(requests(DecodeMode.FULL, GREEDY))
    penalized = engine.generate(requests(DecodeMode.FULL, SETTINGS["greedy-penalized"]))
    assert [o.token_ids for o in plain] != [o.token_ids for o in penalized]


def test_they_are_the_log_softmax_of_the_full_kv_logits(tiny_engine):
    """Greedy, unpenalized: the first token's log-probability is the prefill's last row's
    log-softmax (the tiny model's float32 forward)."""
    engine = tiny_engine()
    request = requests(DecodeMode.FULL, dataclasses.replace(GREEDY, max_new_tokens=1))[0]
    (output,) = engine.generate([request])
    cache = engine.runner.new_cache(len(request.prompt_ids) + 1)
    logits = engine.runner.prefill(torch.tensor(request.prompt_ids), cache)[-1]  # [V]
    expected = logits.float().log_softmax(-1)
    (first,) = output.logprobs
    assert first.logprob == pytest.approx(float(expected[first.token_id]), abs=1e-5)
    best = expected.topk(4)
    assert [id_ for id_, _ in first.top] == best.indices.tolist()


def test_none_are_reported_unless_asked(tiny_engine):
    outputs = tiny_engine().generate(requests(DecodeMode.FULL, SamplingParams(max_new_tokens=4)))
    assert all(out.logprobs is None for out in outputs)


def test_rejection_coupling_reports_the_verifiers_distribution(tiny_engine):
    engine = tiny_engine()
    kivi2, _ = pick("kivi")
    params = dataclasses.replace(SETTINGS["seeded"], coupling="rejection")
    outputs = engine.generate(requests(DecodeMode.VERICACHE, params, kivi2, 6))
    for out in outputs:
        assert [t.token_id for t in out.logprobs] == out.token_ids
        assert all(math.isfinite(t.logprob) and t.logprob <= 0 for t in out.logprobs)


def test_the_long_context_engine_reports_them_too(tiny_engine):
    engine = tiny_engine()
    (compressor, _) = pick("snapkv")
    outputs = long_context_generate(engine, requests(DecodeMode.VERICACHE, GREEDY, compressor))
    assert _reported(outputs) == _reported(engine.generate(requests(DecodeMode.FULL, GREEDY)))
