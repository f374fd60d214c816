"""The `vericache` command line: its JSON contract and its one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from vericache.cli.main import main
from vericache.compress import COMPRESSORS, build_compressor

STATS_KEYS = {
    "rounds",
    "draft_tokens",
    "accepted_tokens",
    "mean_accepted_per_round",
    "tokens_per_round",
}


def run_cli(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse errors
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--compressor", "snapkv9"], "unknown compressor 'snapkv9'"),
        (["--ratio", "0.5"], "ratio must lie in [1, 64]"),
        (["--ratio", "inf"], "ratio must lie in [1, 64]"),
        (["--compressor", "kivi", "--bits", "3"], "bits must be one of (2, 4, 8)"),
        (["--compressor", "kivi", "--ratio", "4"], "takes no parameter 'ratio'"),
        (["--mode", "sampled"], "invalid choice: 'sampled'"),
        (["--draft-len", "many"], "must be a whole number or 'auto'"),
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--temperature", "0.7", "--top-p", "0"], "top_p must lie in (0, 1]"),
        (["--coupling", "nearest"], "invalid choice: 'nearest'"),
    ],
)
def test_bad_arguments_exit_nonzero_with_one_line(capsys, args, message):
    code, out, err = run_cli(["generate", "--prompt", "hi", *args], capsys)
    assert code != 0
    assert out == ""
    assert len(err.strip().splitlines()) == 1
    assert message in err


@pytest.mark.parametrize(
    "device, num_cuda_devices, message",
    [
        ("cuda", 0, "device 'cuda' asked for, but CUDA is not available"),
        ("cuda:2", 1, "device 'cuda:2' asked for, but CUDA has 1 device(s)"),
    ],
)
def test_a_device_this_machine_lacks_is_one_line(
    monkeypatch, capsys, device, num_cuda_devices, message
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: num_cuda_devices > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: num_cuda_devices)
    code, out, err = run_cli(["generate", "--prompt", "hi", "--device", device], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err


def test_prompt_longer_than_the_context_is_one_line(capsys, tmp_path, tiny_chat_checkpoint):
    context = tmp_path / "context.txt"
    context.write_text("word " * 2000)  # far beyond the tiny model's 512 positions
    code, out, err = run_cli(
        [
            "generate",
            "--model",
            str(tiny_chat_checkpoint),
            "--context-file",
            str(context),
            "--prompt",
            "hi",
            "--mode",
            "full",
        ],
        capsys,
    )
    assert code != 0 and out == ""
    assert len(err.strip().splitlines()) == 1 and "context is 512" in err


def test_missing_context_file_is_one_line(capsys, tiny_chat_checkpoint):
    code, _, err = run_cli(
        [
            "generate",
            "--model",
            str(tiny_chat_checkpoint),
            "--context-file",
            "/nonexistent/x.txt",
            "--prompt",
            "hi",
        ],
        capsys,
    )
    assert code != 0 and "does not exist" in err and len(err.strip().splitlines()) == 1


def tiny_generate_argv(tmp_path, checkpoint) -> list[str]:
    """`vericache generate` on the tiny chat model over a small code context, 12 tokens, JSON."""
    context = tmp_path / "context.txt"
    context.write_text("def add(a, b):\n    return a + b\n" * 20)
    return ["generate", "--model", str(checkpoint), "--context-file", str(context),
            "--prompt", "Explain.", "--max-tokens", "12", "--json"]  # fmt: skip


def test_json_contract_and_vericache_equals_full(capsys, tmp_path, tiny_chat_checkpoint):
    common = tiny_generate_argv(tmp_path, tiny_chat_checkpoint)
    results = {}
    for mode in ("full", "lossy", "vericache"):
        code, out, _ = run_cli(
            [*common, "--mode", mode, "--compressor", "kivi", "--bits", "2", "--draft-len", "4"],
            capsys,
        )
        assert code == 0
        results[mode] = json.loads(out)
    for result in results.values():
        assert {"text", "token_ids", "stats", "timing"} <= result.keys()
        assert STATS_KEYS <= result["stats"].keys()
        assert {"total_s", "tokens_per_s"} <= result["timing"].keys()
        assert isinstance(result["text"], str) and all(
            isinstance(t, int) for t in result["token_ids"]
        )
    assert results["vericache"]["token_ids"] == results["full"]["token_ids"]
    assert results["vericache"]["text"] == results["full"]["text"]
    stats = results["vericache"]["stats"]
    assert stats["rounds"] >= 1 and stats["draft_tokens"] >= stats["accepted_tokens"]
    assert stats["tokens_per_round"] == pytest.approx(stats["mean_accepted_per_round"] + 1)
    assert results["full"]["stats"]["draft_tokens"] == 0
    assert results["vericache"]["steer_every"] == 0  # kivi keeps no token set to steer


@pytest.mark.parametrize(
    "args, message",
    [
        (["--compressor", "kivi", "--bits", "4", "--steer-every", "2"], "not kivi"),
        (["--compressor", "snapkv", "--steer-every", "-1"], "steer_every must be >= 0"),
    ],
)
def test_steering_what_cannot_be_steered_is_one_line(
    capsys, tmp_path, tiny_chat_checkpoint, args, message
):
    argv = [*tiny_generate_argv(tmp_path, tiny_chat_checkpoint), "--mode", "vericache", *args]
    code, out, err = run_cli(argv, capsys)
    assert code != 0 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err


def test_sampling_on_the_command_line_keeps_full_decodings_sample(
    capsys, tmp_path, tiny_chat_checkpoint
):
    common = tiny_generate_argv(tmp_path, tiny_chat_checkpoint)
    sampling = ["--temperature", "0.8", "--top-p", "0.95", "--seed", "5"]
    results = {}
    for mode in ("full", "vericache"):
        argv = [*common, *sampling, "--mode", mode, "--compressor", "kivi", "--bits", "2"]
        code, out, _ = run_cli(argv, capsys)
        assert code == 0
        results[mode] = json.loads(out)
    assert results["vericache"]["token_ids"] == results["full"]["token_ids"]
    assert results["vericache"]["seed"] == 5
    code, out, _ = run_cli([*common, "--mode", "full"], capsys)
    assert json.loads(out)["seed"] is None  # greedy: nothing sampled


def test_unknown_benchmark_is_refused(capsys):
    code, _, err = run_cli(["bench", "nonexistent"], capsys)
    assert code != 0 and "invalid choice" in err


def test_console_script_is_installed():
    result = subprocess.run(
        [sys.executable, "-m", "vericache.cli.main", "generate", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "--context-file" in result.stdout and "--draft-len" in result.stdout


def test_compressors_lists_the_registry_as_json(capsys):
    code, out, _ = run_cli(["compressors", "--json"], capsys)
    listed = {entry["name"]: entry for entry in json.loads(out)}
    assert code == 0 and set(listed) == set(COMPRESSORS)
    assert listed["snapkv"]["kind"] == "token_dropping" and listed["snapkv"]["mode"] == "offline"
    assert listed["kivi"]["params"] == {"bits": 4, "group_size": 32, "residual_length": 128}
    for entry in listed.values():  # the listing rebuilds each compressor
        assert build_compressor(entry["name"], **entry["params"]).label == entry["label"]
