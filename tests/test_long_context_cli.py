"""`vericache generate --long-context`: the same tokens as full decoding, its statistics in the
JSON, and one-line errors for options that do not fit together."""

from __future__ import annotations

import json

import pytest

from tests.test_cli import run_cli, tiny_generate_argv


def test_long_context_generate_equals_full(capsys, tmp_path, tiny_chat_checkpoint):
    common = tiny_generate_argv(tmp_path, tiny_chat_checkpoint)
    common += ["--compressor", "kivi", "--bits", "2", "--draft-len", "4"]
    long_context = ["--long-context", "--memory-budget", "64MiB", "--pcie-bandwidth", "1GB/s"]
    results = {}
    for name, extra in [
        ("full", ["--mode", "full"]),
        ("vericache", ["--mode", "vericache", *long_context]),
        ("full-baseline", ["--mode", "full", *long_context]),
    ]:
        code, out, err = run_cli([*common, *extra], capsys)
        assert code == 0, err
        results[name] = json.loads(out)
    assert results["vericache"]["token_ids"] == results["full"]["token_ids"]
    assert results["full-baseline"]["token_ids"] == results["full"]["token_ids"]
    stats = results["vericache"]["long_context"]
    assert stats["num_loads"] == results["vericache"]["stats"]["rounds"] >= 1
    assert 0 < stats["peak_device_bytes"] <= 64 * 2**20
    assert "long_context" not in results["full"]


def test_long_context_text_output(capsys, tiny_chat_checkpoint):
    argv = ["generate", "--model", str(tiny_chat_checkpoint), "--prompt", "Hi.", "--max-tokens"]
    code, out, _ = run_cli([*argv, "6", "--draft-len", "2", "--long-context"], capsys)
    assert code == 0 and "[long-context]" in out and "full-KV loads" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--memory-budget", "2GiB"], "need --long-context"),
        (["--pcie-bandwidth", "8GB/s"], "need --long-context"),
        (["--long-context", "--mode", "lossy"], "vericache or full"),
        (["--long-context", "--server", "localhost:1"], "in this process"),
        (["--long-context", "--memory-budget", "lots"], "is not like '4GiB'"),
        (["--long-context", "--pcie-bandwidth", "fast"], "is not like '1.2GB/s'"),
        (["--long-context", "--memory-budget", "0"], "must be > 0"),
    ],
)
def test_bad_long_context_options_are_one_line(capsys, args, message):
    code, out, err = run_cli(["generate", "--prompt", "hi", *args], capsys)
    assert code != 0 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err


def test_budget_smaller_than_the_weights_is_one_line(capsys, tiny_chat_checkpoint):
    argv = ["generate", "--model", str(tiny_chat_checkpoint), "--prompt", "Hi."]
    code, _, err = run_cli([*argv, "--long-context", "--memory-budget", "1MiB"], capsys)
    assert code != 0 and len(err.strip().splitlines()) == 1 and "weights" in err
