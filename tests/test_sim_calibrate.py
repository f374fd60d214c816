"""`vericache calibrate` on CPU with tiny shapes: every code path the GPU run takes, in seconds."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from vericache.calibration.calibrate import CalibrationPlan, calibrate
from vericache.cli.main import main
from vericache.errors import InvalidRequestError
from vericache.sim import calibration_fit as calibration
from vericache.sim.profiles import DeviceProfile, ModelProfile, device_profile

TINY = ModelProfile(
    name="tiny", source="test", num_layers=4, hidden_size=64, intermediate_size=128, num_heads=4,
    num_kv_heads=2, head_dim=16, vocab_size=256, num_params=200_000, max_positions=4096,
)  # fmt: skip
PLAN = CalibrationPlan(
    num_layers=4, product_rows=(1, 2, 8), contexts=(64, 96), batches=(1, 2), verify_tokens=(5, 9),
    copy_bytes=1 << 20, stream_bytes=1 << 20, repeats=2,
)  # fmt: skip


def test_a_calibration_measures_fits_and_predicts_every_forward(tmp_path):
    result = calibrate(TINY, torch.device("cpu"), PLAN)
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(result))
    profile = device_profile(str(path))  # the simulator reads what calibrate writes
    assert profile.is_measured and "host copy" in profile.source
    assert profile.hbm_bytes_per_s > 0 and profile.peak_flops > 0
    assert profile.forward_overhead_s >= 0 and profile.layer_overhead_s >= 0
    assert [p["rows"] for p in result["products"]] == [1, 2, 8]
    # The products' curve: seconds per weight byte at every row count, never falling as they grow.
    per_byte = [p["seconds"] / p["weight_bytes"] for p in result["products"]]
    curve = profile.product_curve
    assert [rows for rows, _ in curve] == [1, 2, 8]
    assert all(fitted <= timed for (_, fitted), timed in zip(curve, per_byte))
    assert [fitted for _, fitted in curve] == sorted(fitted for _, fitted in curve)
    assert curve[-1][1] == pytest.approx(per_byte[-1])
    shapes = {
        (f["num_layers"], f["new_tokens"], f["context"], f["batch"]) for f in result["forwards"]
    }
    for layers in (4, 2):  # the deeper slice and the shallower one
        assert {(layers, 1, c, b) for c in (64, 96) for b in (1, 2)} <= shapes
        assert {(layers, 5, 64, 1), (layers, 9, 64, 1)} <= shapes
    assert all(f["predicted_s"] > 0 and f["seconds"] > 0 for f in result["forwards"])
    assert result["copies"]["alone_bytes_per_s"] > 0
    # A decode step beside a second process running the same: the profile's co-runner slowdown.
    co_runner = result["co_runner"]
    assert co_runner["beside_s"] > 0 and co_runner["alone_s"] > 0
    assert profile.co_runner_slowdown == co_runner["slowdown"] >= 1


def test_the_overhead_fit_recovers_a_known_fixed_and_per_layer_cost():
    profile = dataclasses.replace(
        device_profile("h200"), forward_overhead_s=0.0, layer_overhead_s=0.0
    )
    forwards = []
    for layers in (2, 4, 8):
        for context in (1000, 5000):
            forward = {"num_layers": layers, "new_tokens": 1, "context": context, "batch": 1}
            explained = calibration.predicted_seconds(profile, TINY, forward, 2)
            forward["seconds"] = explained + 1e-3 + 5e-5 * layers
            forwards.append(forward)
    forwards = [f for f in forwards if f["num_layers"] in (2, 8)]
    fitted = calibration._with_overhead(profile, TINY, forwards, 2)
    assert fitted.forward_overhead_s == pytest.approx(1e-3, rel=1e-6)
    assert fitted.layer_overhead_s == pytest.approx(5e-5, rel=1e-6)
    for forward in forwards:
        predicted = calibration.predicted_seconds(fitted, TINY, forward, 2)
        assert predicted == pytest.approx(forward["seconds"])


def test_a_plan_that_cannot_fit_is_refused():
    for bad in ({"product_rows": (2, 4)}, {"num_layers": 1}, {"contexts": ()}, {"repeats": 0}):
        with pytest.raises(InvalidRequestError):
            dataclasses.replace(PLAN, **bad)


def test_the_command_writes_a_profile_and_refuses_what_it_cannot_do(tmp_path, capsys):
    arch = tmp_path / "tiny.json"
    arch.write_text(json.dumps(dataclasses.asdict(TINY)))
    out = tmp_path / "cpu.json"
    assert main(["calibrate", "--device", "cpu", "--arch", str(arch), "--out", str(out),
                 "--layers", "2", "--repeats", "1"]) == 0  # fmt: skip
    assert json.loads(out.read_text())["plan"]["repeats"] == 1
    assert device_profile(str(out)).is_measured and "GB/s" in capsys.readouterr().out
    if not torch.cuda.is_available():
        assert main(["calibrate", "--device", "cuda", "--arch", str(arch), "--out", str(out)]) == 2
        assert "CUDA is not available" in capsys.readouterr().err
    assert main(["calibrate", "--device", "cpu", "--arch", "gpt-5", "--out", str(out)]) == 2
    assert "no model profile 'gpt-5'" in capsys.readouterr().err
    missing = tmp_path / "nowhere" / "cpu.json"
    assert main(["calibrate", "--device", "cpu", "--arch", str(arch), "--out", str(missing)]) == 2


def test_the_attention_fit_recovers_known_attention_rates():
    # Forwards timed on a made-up device whose attention streams KV at half the products'
    # bandwidth and computes at a hundredth of their flops, with a known overhead (per forward,
    # per layer, and per row and layer).
    start = dataclasses.replace(
        device_profile("h200"), forward_overhead_s=0.0, layer_overhead_s=0.0
    )
    truth = dataclasses.replace(
        start, attention_bytes_per_s=start.bytes_per_s / 2, attention_flops=start.flops / 100,
        forward_overhead_s=2e-4, layer_overhead_s=1e-5, row_overhead_s=3e-6,
        exact_row_overhead_s=4e-6,
    )  # fmt: skip
    forwards = [
        {"num_layers": layers, "new_tokens": tokens, "context": context, "batch": batch,
         "exact": exact}
        for layers in (2, 4)
        for tokens, batch, exact in ((1, 1, False), (1, 8, False), (1, 8, True), (31, 1, True))
        for context in (20000, 60000)
    ]  # fmt: skip
    for forward in forwards:
        forward["seconds"] = calibration.predicted_seconds(truth, TINY, forward, 2)
    fitted = calibration._with_attention_bandwidth(start, TINY, forwards, 2)
    assert fitted.attention_bytes_per_s == pytest.approx(truth.attention_bytes_per_s, rel=1e-6)
    assert fitted.row_overhead_s == pytest.approx(truth.row_overhead_s, rel=1e-6)
    fitted = calibration._with_overhead(fitted, TINY, forwards, 2)
    assert fitted.forward_overhead_s == pytest.approx(2e-4, rel=1e-6)
    assert fitted.layer_overhead_s == pytest.approx(1e-5, rel=1e-6)
    fitted = calibration._with_exact_rows(fitted, TINY, forwards, 2)
    assert fitted.exact_row_overhead_s == pytest.approx(truth.exact_row_overhead_s, rel=1e-6)
    fitted = calibration._with_attention_compute(fitted, TINY, forwards, 2)
    assert fitted.attention_flops == pytest.approx(truth.attention_flops, rel=1e-6)
    for forward in forwards:
        predicted = calibration.predicted_seconds(fitted, TINY, forward, 2)
        assert predicted == pytest.approx(forward["seconds"])


def test_rows_of_one_size_fit_the_bandwidth_alone():
    """With a single context the rows' overhead cannot be told from their KV: the bandwidth
    takes both, and the rows' overhead stays 0."""
    start = dataclasses.replace(
        device_profile("h200"), forward_overhead_s=0.0, layer_overhead_s=0.0
    )
    truth = dataclasses.replace(start, attention_bytes_per_s=start.bytes_per_s / 2)
    forwards = [
        {"num_layers": layers, "new_tokens": 1, "context": 20000, "batch": batch}
        for layers in (2, 4)
        for batch in (1, 8)
    ]
    for forward in forwards:
        forward["seconds"] = calibration.predicted_seconds(truth, TINY, forward, 2)
    fitted = calibration._with_attention_bandwidth(start, TINY, forwards, 2)
    assert fitted.row_overhead_s == 0.0
    assert fitted.attention_bytes_per_s == pytest.approx(truth.attention_bytes_per_s, rel=1e-6)


def test_the_products_curve_never_falls_as_the_rows_grow():
    timed = ((1, 4.0), (2, 5.0), (4, 3.0), (8, 6.0))
    products = [{"rows": rows, "seconds": s, "weight_bytes": 10} for rows, s in timed]
    curve = calibration.product_curve(products)
    assert [rows for rows, _ in curve] == [1, 2, 4, 8]
    assert [fitted for _, fitted in curve] == pytest.approx([0.3, 0.3, 0.3, 0.6])


def test_a_stored_calibration_is_fitted_again_and_two_average_into_one():
    first = calibrate(TINY, torch.device("cpu"), PLAN)
    tampered = first | {"profile": first["profile"] | {"layer_overhead_s": 1.0}}
    assert calibration.refit(tampered, TINY)["profile"] == first["profile"]

    def slowed(result: dict, factor: float) -> dict:
        return result | {
            name: [t | {"seconds": factor * t["seconds"]} for t in result[name]]
            for name in ("products", "forwards")
        }

    both = calibration.averaged(first, slowed(first, 3.0), TINY)
    for name in ("products", "forwards"):  # each timing the mean of the two
        seconds = [2 * t["seconds"] for t in first[name]]
        assert [t["seconds"] for t in both[name]] == pytest.approx(seconds)
    profile = DeviceProfile(**both["profile"])
    assert profile.hbm_bytes_per_s == pytest.approx(first["profile"]["hbm_bytes_per_s"] / 2)
    assert all(f["predicted_s"] > 0 for f in both["forwards"])
    with pytest.raises(InvalidRequestError, match="one plan and dtype"):
        calibration.averaged(first, first | {"dtype": "bfloat16"}, TINY)
