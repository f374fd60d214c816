"""`make demo`'s table says what the run measured, not what a run elsewhere did."""

from __future__ import annotations

from argparse import Namespace

from vericache.demo import MODES, _table


def rows(tokens_per_s: dict) -> dict:
    def record(mode):
        return {
            "tokens_per_s": tokens_per_s[mode], "mean_ttft_s": 0.5, "link_bytes": 0,
            "store_bytes": 0, "mean_accepted_per_round": 3.0,
        }  # fmt: skip

    return {mode: (record(mode), [[1, 2, 3]]) for mode in MODES}


ARGS = Namespace(requests=1, concurrency=1, draft_len=16, compressor="snapkv", ratio=4.0)


def test_the_verdict_is_the_measured_ratio():
    faster = _table(rows({"full_local": 10, "vericache": 12.5, "full_remote": 8, "lossy": 9}), ARGS)
    assert "VERICACHE served 1.25x FULL_LOCAL's tokens/s, with the same tokens" in faster
    slower = _table(rows({"full_local": 10, "vericache": 7.5, "full_remote": 8, "lossy": 9}), ARGS)
    assert "VERICACHE served 0.75x FULL_LOCAL's tokens/s: on a CPU" in slower
    assert "1/1" in slower  # identical outputs counted against FULL_LOCAL
