"""The acceptance benchmark's traces: first mismatches from rounds at x=64, replayed in order at
any x <= 64 with a 95% interval over prompts; the ranking says whether it is told apart from
noise; an earlier result's records are reported again by this code."""

from __future__ import annotations

import argparse

import pytest

from vericache.bench import (
    acceptance,
    acceptance_checkpoint,
    acceptance_coupling,
    acceptance_report,
    acceptance_result,
)
from vericache.bench.acceptance_report import best_at_4x, mean_ci95, replay_table


def test_a_round_tells_its_first_mismatch_unless_cut_short_with_every_draft_kept():
    drafted = [64, 64, 12, 30, 5]
    accepted = [64, 10, 12, 3, 5]
    # 64 kept: none rejected (64); 10 of 64: the 11th rejected (10); 12 of 12 and 5 of 5: cut
    # short with all kept, no mismatch seen; 3 of 30: the 4th rejected.
    assert acceptance.first_mismatches(drafted, accepted, 64) == [64, 10, 3]


def _args(draft_lens: list[int], quick: bool = True) -> argparse.Namespace:
    """What a run's result is built from besides its records."""
    return argparse.Namespace(
        draft_kv="verifier", quick=quick, draft_lens=draft_lens, model="m", dtype="float32"
    )


def _record(kind, label, mismatches, source="verifier"):
    return {"kind": kind, "compressor": label, "draft_kv": source, "identical": True,
            "first_mismatch": mismatches}  # fmt: skip


def test_the_replay_is_the_mean_over_prompts_of_their_rounds_replayed_in_order():
    records = [
        # 64 kept, then 10 and a mismatch: a run of 75 matches. At x=30: 30, 30 (each round's
        # verifier token takes the next position), then the 13 left before the break.
        _record("code", "kivi-4bit", [64, 10]),
        # 20 and a mismatch, then 40 and a mismatch: 20, then 30 of the 40, then the 9 left.
        _record("code", "kivi-4bit", [20, 40]),
        _record("code", "kivi-4bit", []),  # no round told a mismatch: not counted
    ]
    table = replay_table(records, [10, 30, 64])
    cells = table["verifier"]["code"]["kivi-4bit"]
    assert cells["10"]["mean"] == pytest.approx((69 / 7 + 56 / 6) / 2)
    assert cells["30"]["mean"] == pytest.approx((73 / 3 + 59 / 3) / 2)
    assert cells["30"]["num_prompts"] == 2
    assert cells["64"]["mean"] == pytest.approx((37 + 30) / 2)  # the recorded rounds themselves
    low, high = cells["30"]["ci95"]
    assert low < 22 < high
    assert cells["30"]["num_rounds"] == 4


def test_whole_rounds_are_taken_as_they_were_at_their_own_draft_length():
    whole = {**_record("code", "snapkv-8x-bf16 whole/30", [30, 30, 13, 30]), "whole_rounds": 30}
    assert acceptance_report.prompt_mean(whole, 30) == pytest.approx(103 / 4)
    assert not acceptance_report.replays(whole, 8)


def test_the_interval_narrows_with_more_prompts_and_uses_t_quantiles():
    mean, (low, high) = mean_ci95([10.0, 20.0])
    assert mean == 15 and high - mean == pytest.approx(12.706 * 7.0710678 / 1.4142136, rel=1e-4)
    _, wide = mean_ci95([10.0, 20.0] * 2)
    _, narrow = mean_ci95([10.0, 20.0] * 20)
    assert narrow[1] - narrow[0] < wide[1] - wide[0]
    assert mean_ci95([3.0]) == (3.0, None)


def test_the_best_at_4x_says_whether_the_ranking_is_told_apart():
    apart = {
        "kivi-4bit": {"mean": 25, "ci95": [24, 26]},
        "snapkv-4x": {"mean": 20, "ci95": [19, 21]},
    }
    close = {
        "kivi-4bit": {"mean": 25, "ci95": [22, 28]},
        "snapkv-4x": {"mean": 24, "ci95": [21, 27]},
    }
    assert best_at_4x(apart) == {"label": "kivi-4bit", "x30": 25, "ci95": [24, 26],
                                 "runner_up": "snapkv-4x", "separated": True}  # fmt: skip
    assert best_at_4x(close)["separated"] is False
    assert best_at_4x({"snapkv-2x": {"mean": 30, "ci95": None}}) is None


def test_the_result_summarizes_replayed_cells_and_plots(tmp_path):
    records = [
        _record("code", "kivi-4bit", [64, 10]),
        _record("code", "kivi-4bit", [20, 40]),
        _record("tools", "kivi-4bit", [0, 5]),
        _record("code", "streamingllm-4x", [17, 18]),
    ]
    args = _args([10, 30])
    result = acceptance_result._result(records, ["kivi-4bit", "streamingllm-4x"], args, 64, 3)
    summary = result["summary"]
    assert summary["x30"] == {"kivi-4bit": pytest.approx(22.0), "streamingllm-4x": 17.5}
    assert summary["x30_tools"] == {"kivi-4bit": pytest.approx(2.5)}
    assert summary["best_4x_x30"]["code"]["label"] == "kivi-4bit"
    assert summary["meets_target"] is False  # tools: the best 4x accepts 2.5
    assert "| code | kivi-4bit | 9.6 (" in result["table_markdown"]
    assert result["config"]["trace_draft_len"] == 64
    acceptance.plot(result, tmp_path / "acceptance.png")
    assert (tmp_path / "acceptance.png").stat().st_size > 1000


def test_an_earlier_result_is_reported_again_from_its_records():
    records = [
        _record("code", "snapkv-8x-bf16", [64, 10]),
        _record("code", "snapkv-8x-bf16 T=0.7 seeded", [20, 40]),
        _record("tools", "snapkv-8x-bf16", [0, 5]),
    ]
    args = _args([8, 30], quick=False)
    shares = {"snapkv-8x-bf16": 0.09}
    now = acceptance_result.reported(records, ["snapkv-8x-bf16"], args, 256, 3, shares)
    earlier = {**now, "environment": {"cpu": "the run's"}, "environment_steered": {"cpu": "x"}}
    earlier["table"] = {}  # as an older replay left it: the records alone are the measurement
    earlier["summary"] = {"x30": {"snapkv-8x-bf16": 20.0}}
    again = acceptance_result.report_again(earlier)
    assert again["table"] == now["table"] and again["summary"] == now["summary"]
    assert again["summary"]["x30"] == {"snapkv-8x-bf16": pytest.approx(73 / 3)}
    assert again["summary"]["best_accepted_at_c_1_8"]["code"]["c"] == 0.09
    assert again["environment"] == {"cpu": "the run's"} and "reported_environment" in again
    assert again["environment_steered"] == {"cpu": "x"} and again["records"] == records
    # A run whose drafts read the drafter's own KV alone is reported from that source again.
    drafted = [_record("code", "snapkv-8x-bf16", [64, 10], source="drafter")]
    args.draft_kv = "drafter"
    by_drafter = acceptance_result.reported(drafted, ["snapkv-8x-bf16"], args, 256, 1, shares)
    assert acceptance_result.report_again(by_drafter)["table"] == by_drafter["table"]


def test_a_run_that_samples_more_than_one_way_plots_them_side_by_side_at_x30(tmp_path, monkeypatch):
    records = [
        _record("code", "kivi-4bit", [64, 10]),
        _record("code", "kivi-4bit T=0.7 seeded", [20, 40]),
        _record("tools", "kivi-4bit T=0.7 rejection", [0, 5]),
    ]
    args = _args([10, 30])
    labels = ["kivi-4bit", "kivi-4bit T=0.7 seeded", "kivi-4bit T=0.7 rejection"]
    result = acceptance_result._result(records, labels, args, 64, 3)
    drawn = []
    monkeypatch.setattr(acceptance_report, "plot_draft_lengths", lambda *a: drawn.append("x"))
    acceptance.plot(result, tmp_path / "sampled.png")
    assert not drawn and (tmp_path / "sampled.png").stat().st_size > 1000


def test_a_checkpoint_keeps_finished_compressors_for_the_next_run(tmp_path):
    path = tmp_path / "acceptance.jsonl"
    settings = {"max_tokens": 256, "num_prompts": 48, "model": "m", "dtype": "float32"}
    first = acceptance_checkpoint.Checkpoint(path, settings)
    assert first.records("kivi-4bit", "verifier") is None and first.references("full") is None
    first.add_references("full", [(1, 2, 3), (4,)])
    first.add("kivi-4bit", "verifier", [_record("code", "kivi-4bit", [64, 3])])
    resumed = acceptance_checkpoint.Checkpoint(path, settings)  # a later run with the same settings
    assert resumed.records("kivi-4bit", "verifier") == [_record("code", "kivi-4bit", [64, 3])]
    assert resumed.records("kivi-4bit", "drafter") is None
    assert resumed.references("full") == [(1, 2, 3), (4,)]
    assert resumed.references("full T=0.7 seeded") is None
    with pytest.raises(ValueError, match="other settings"):
        acceptance_checkpoint.Checkpoint(path, {**settings, "max_tokens": 64})


def test_sampled_settings_are_labelled_and_compared_by_coupling():
    settings = acceptance.sampling_settings([0.0, 0.7], ["seeded", "rejection"])
    assert [s.label("kivi-4bit") for s in settings] == [
        "kivi-4bit", "kivi-4bit T=0.7 seeded", "kivi-4bit T=0.7 rejection"
    ]  # fmt: skip
    assert not settings[0].params(8, 0).is_sampled and settings[2].params(8, 3).is_rejection_coupled
    records = [
        _record("code", "kivi-4bit T=0.7 seeded", [20, 20]),
        _record("code", "kivi-4bit T=0.7 rejection", [25, 25]),
        _record("tools", "kivi-4bit T=0.7 seeded", [30, 30]),
        _record("tools", "kivi-4bit T=0.7 rejection", [30, 30]),
    ]
    table = replay_table(records, [30])["verifier"]
    ratios = acceptance_coupling.seeded_over_rejection(table, ["kivi-4bit"])
    assert ratios == {"0.7": pytest.approx(0.8)}  # the code cells: 20 / 25


def test_the_pooled_ratio_sums_prompts_of_every_cell_and_resamples_them():
    def sampled(kind, coupling, first_mismatch):
        record = _record(kind, f"kivi-4bit T=0.7 {coupling}", first_mismatch)
        return {**record, "temperature": 0.7}

    records = [
        sampled("code", "seeded", [20, 20]), sampled("code", "seeded", [10, 10]),
        sampled("code", "rejection", [25, 25]), sampled("code", "rejection", [15, 15]),
        sampled("tools", "seeded", [30, 30]), sampled("tools", "rejection", [30, 30]),
        sampled("math", "seeded", [1]), sampled("math", "rejection", [30]),  # not a target kind
    ]  # fmt: skip
    (pooled,) = acceptance_coupling.pooled_seeded_over_rejection(records, ["kivi-4bit"]).values()
    assert pooled["ratio"] == pytest.approx((20 + 10 + 30) / (25 + 15 + 30))
    assert pooled["num_prompts"] == 3
    low, high = pooled["ci95"]
    assert 10 / 15 <= low <= pooled["ratio"] <= high <= 1.0  # between its prompts' own ratios


@pytest.mark.slow
def test_a_sampled_run_end_to_end(monkeypatch, tiny_chat_checkpoint, tmp_path):
    """The whole benchmark on the tiny chat model and two short prompts: greedy and sampled
    rounds, both couplings; seeded outputs equal full-KV sampling's. Run again on its
    checkpoint, it decodes nothing and gives the same result."""
    from vericache.cli.bench import parse_benchmark_args
    from vericache.engine.prompt import build_chat_prompt

    def prompts(tokenizer, quick, per_kind, context_tokens=None):
        context = "def add(a, b):\n    return a + b\n" * 10
        return [
            (kind, f"{kind}:tiny", build_chat_prompt(tokenizer, context, question))
            for kind, question in [("code", "Explain add."), ("tools", "Call add.")]
        ]

    monkeypatch.setattr(acceptance, "_prompts", prompts)
    _, args = parse_benchmark_args("acceptance", [
        "--model", str(tiny_chat_checkpoint), "--compressors", "streamingllm-4x",
        "--max-tokens", "8", "--temperature", "0,0.7", "--coupling", "seeded,rejection",
        "--checkpoint", str(tmp_path / "checkpoint.jsonl"),
    ])  # fmt: skip
    result = acceptance.run(args)
    kinds = result["table"]["verifier"]
    assert set(kinds["code"]) == {
        "streamingllm-4x", "streamingllm-4x T=0.7 seeded", "streamingllm-4x T=0.7 rejection"
    }  # fmt: skip
    assert result["summary"]["identical"] is True
    assert {r["coupling"] for r in result["records"]} == {"greedy", "seeded", "rejection"}

    def refuse(*_):
        raise AssertionError("a resumed run decoded again")

    monkeypatch.setattr(acceptance.Engine, "generate", refuse)
    assert acceptance.run(args)["records"] == result["records"]


def test_c_is_the_wire_bytes_share_of_the_bf16_full_kv(tiny_chat_checkpoint):
    """A composition's c is below each of its parts' (the tiny model's KV is float32: its
    full-precision tokens count twice the bf16 bytes)."""
    from vericache.bench.common import compressor_from_label
    from vericache.engine.engine import Engine
    from vericache.engine.prompt import build_chat_prompt

    engine = Engine.from_pretrained(str(tiny_chat_checkpoint), dtype="float32")
    context = "".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(25))
    prompts = [("code", "tiny", build_chat_prompt(engine.tokenizer, context, "Explain f3."))]
    shares = {
        label: acceptance.compressed_share(engine, compressor_from_label(label), prompts)
        for label in ("snapkv-4x", "kivi-4bit", "snapkv-4x+kivi-4bit")
    }
    assert shares["snapkv-4x"] < 2 / 4  # a quarter of the fp32 slots, and the codec's zstd
    assert 0 < shares["snapkv-4x+kivi-4bit"] < min(shares["snapkv-4x"], shares["kivi-4bit"])


def test_the_frontier_reads_the_best_within_each_c_and_steerings_gain(tmp_path):
    from vericache.bench.acceptance_frontier import frontier_summary

    records = [
        _record("code", "snapkv-8x-bf16", [20, 22]),
        _record("code", "snapkv-8x-bf16 steered/2", [24, 26]),
        _record("code", "snapkv-16x-bf16", [10, 12]),
        _record("code", "kivi-4bit", [30, 30]),  # accepts the most, but c is a quarter
        _record("tools", "snapkv-16x-bf16", [8, 8]),
    ]
    args = _args([30])
    labels = ["snapkv-8x-bf16", "snapkv-8x-bf16 steered/2", "snapkv-16x-bf16", "kivi-4bit"]
    shares = {"snapkv-8x-bf16": 0.11, "snapkv-16x-bf16": 0.06, "kivi-4bit": 0.26}
    result = acceptance_result._result(records, labels, args, 64, 3) | {"c": shares}
    summary = frontier_summary(result["table"]["verifier"], shares)
    eighth, sixteenth = summary["best_accepted_at_c_1_8"], summary["best_accepted_at_c_1_16"]
    assert eighth["code"]["label"] == "snapkv-8x-bf16 steered/2"
    assert eighth["code"]["mean"] == pytest.approx(25.0) and eighth["code"]["c"] == 0.11
    assert sixteenth["code"]["label"] == "snapkv-16x-bf16" and sixteenth["tools"]["mean"] == 8
    gains = summary["steering_gain_at_c_1_8"]
    assert gains == {"code": {"snapkv-8x-bf16 steered/2": pytest.approx(25 / 21)}}
    acceptance.plot(result, tmp_path / "acceptance.png")
    assert (tmp_path / "acceptance_frontier.png").stat().st_size > 1000


def test_whole_rounds_replay_at_their_own_x_and_steering_gains_compare_like_with_like():
    from vericache.bench.acceptance_frontier import frontier_summary

    def whole(kind, label, mismatches):
        return {**_record(kind, label, mismatches), "whole_rounds": 30}

    records = [
        _record("code", "snapkv-8x-bf16", [20, 22]),  # rounds of 64: any x <= 64
        whole("code", "snapkv-8x-bf16 whole/30", [18, 20]),
        whole("code", "snapkv-8x-bf16 steered/1 whole/30", [24, 30]),
    ]
    table = replay_table(records, [10, 30, 64])["verifier"]["code"]
    assert set(table["snapkv-8x-bf16"]) == {"10", "30", "64"}
    assert set(table["snapkv-8x-bf16 whole/30"]) == {"30"}  # a round of 30 tells nothing at 64
    summary = frontier_summary({"code": table}, {"snapkv-8x-bf16": 0.09})
    # The steered whole rounds over the unsteered whole rounds, not over the traced ones.
    gains = summary["steering_gain_at_c_1_8"]["code"]
    assert gains == {"snapkv-8x-bf16 steered/1 whole/30": pytest.approx(27 / 19)}


def test_a_whole_round_run_drafts_every_round_to_its_length_and_verifies_it_whole():
    from vericache.bench.common import compressor_from_label
    from vericache.engine.request import SamplingParams

    prompt = type("Prompt", (), {"token_ids": list(range(40)), "num_prefix_tokens": 32})()
    compressor = compressor_from_label("snapkv-8x-bf16")
    params = SamplingParams(max_new_tokens=8)
    traced = acceptance._request(acceptance.Run(compressor), ("code", "w", prompt), (1,), params)
    whole_run = acceptance.Run(compressor, steer_every=1, whole_rounds=30)
    whole = acceptance._request(whole_run, ("code", "w", prompt), (1,), params)
    assert (traced.draft_len, traced.expected_ids) == (64, (1,))
    assert (whole.draft_len, whole.expected_ids, whole.steer_every) == (30, None, 1)
    assert whole_run.label == "snapkv-8x-bf16 steered/1 whole/30"


def test_the_paired_steering_gain_compares_each_prompt_with_itself():
    from vericache.bench.acceptance_frontier import paired_steering_gains

    def whole(label, mismatches, kind="code"):
        return {**_record(kind, label, mismatches), "whole_rounds": 30}

    records = [
        whole("snapkv-8x-bf16 whole/30", [10, 10]),
        whole("snapkv-8x-bf16 whole/30", [20, 20]),
        whole("snapkv-8x-bf16 steered/1 whole/30", [12, 12]),
        whole("snapkv-8x-bf16 steered/1 whole/30", [24, 24]),
    ]
    gains = paired_steering_gains(records, {"snapkv-8x-bf16": 0.09}, 1 / 8)
    gain = gains["code"]["snapkv-8x-bf16 steered/1 whole/30"]
    assert gain["ratio"] == pytest.approx(36 / 30) and gain["num_prompts"] == 2
    low, high = gain["ci95"]
    assert low == pytest.approx(1.2) and high == pytest.approx(1.2)  # both prompts gain 20%
    assert paired_steering_gains(records, {"snapkv-8x-bf16": 0.2}, 1 / 8) == {}


def test_the_refresh_share_is_the_mean_over_prompts_of_the_entries_a_refresh_replaces():
    from vericache.bench.acceptance_frontier import refresh_shares

    steered = "snapkv-8x-bf16 steered/1 whole/30"

    def refreshed(kept, changed):
        return {
            **_record("code", steered, [10]),
            "kept_entries": kept,
            "changed_per_refresh": changed,
        }

    records = [
        refreshed(100, [30, 10]),  # 20 of 100 a refresh
        refreshed(200, [20]),  # 10 of 200
        _record("code", "snapkv-8x-bf16 whole/30", [10]),  # unsteered: no refreshes
    ]
    shares = refresh_shares(records)
    assert list(shares) == [steered]
    cell = shares[steered]["code"]
    assert cell["mean"] == pytest.approx((0.2 + 0.1) / 2)
    low, high = cell["ci95"]
    assert low < 0.1 and high > 0.2
