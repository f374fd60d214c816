"""The soak benchmark, small: two clients for a few seconds on the tiny model, a drafter
SIGKILLed in the middle; nothing lost, repeated or wrong, and the metrics agree with the clients."""

from __future__ import annotations

import pytest

from vericache.cli.bench import parse_benchmark_args

pytestmark = pytest.mark.ray


def test_a_short_soak_with_a_killed_drafter_loses_nothing(ray_cluster, tiny_chat_checkpoint):
    module, args = parse_benchmark_args(
        "soak",
        [
            "--model", str(tiny_chat_checkpoint), "--seconds", "8", "--clients", "2",
            "--max-tokens", "24", "--context-chars", "600", "--kill", "drafter",
        ],
    )  # fmt: skip
    summary = module.run(args)["summary"]
    assert summary["killed"] == "drafter" and summary["completed"] > 0
    assert summary["lost_tokens"] == 0 and summary["duplicated_tokens"] == 0
    assert summary["wrong"] == 0 and summary["failed_mid_stream"] == 0, summary
    (restart,) = summary["restarts"]
    assert restart["kind"] == "drafter" and restart["back_after_kill_s"] is not None
    assert restart["server_restarts"] == 1 and restart["server_restart_s"] > 0
    assert summary["identical"], summary
    assert summary["metrics_match"], summary
