"""The embedded SmolLM2 on a real standard-library context: vericache == full (slow)."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from tests.compressor_table import pick
from vericache.compress import KIVI
from vericache.engine.prompt import build_chat_prompt
from vericache.engine.request import DecodeMode, Request, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prompt(embedded_engine):
    source = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    tokenizer = embedded_engine.tokenizer
    context = tokenizer.decode(tokenizer.encode(source, add_special_tokens=False)[:1200])
    return build_chat_prompt(tokenizer, context, "Write a short example that uses dedent.")


def test_vericache_equals_full_on_the_embedded_model(embedded_engine, prompt):
    params = SamplingParams(max_new_tokens=48)
    requests = [
        Request(prompt.token_ids, prompt.num_prefix_tokens, params, mode, compressor, 30)
        for mode, compressor in [
            (DecodeMode.FULL, None),
            *((DecodeMode.VERICACHE, row) for row in pick("streamingllm", "kivi")),
        ]
    ]
    full, *vericache = embedded_engine.generate(requests)
    assert len(full.token_ids) > 10 and full.text
    for out in vericache:
        assert out.token_ids == full.token_ids
        assert out.text == full.text
        assert out.stats.rounds < len(out.token_ids)  # rounds emitted several tokens each


def test_lossy_mode_drifts_on_the_embedded_model(embedded_engine, prompt):
    params = SamplingParams(max_new_tokens=48)
    full, lossy = embedded_engine.generate(
        [
            Request(prompt.token_ids, prompt.num_prefix_tokens, params, DecodeMode.FULL),
            Request(
                prompt.token_ids, prompt.num_prefix_tokens, params, DecodeMode.LOSSY, KIVI(bits=2)
            ),
        ]
    )
    assert lossy.token_ids != full.token_ids
