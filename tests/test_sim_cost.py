"""The simulator's profiles and its cost of a forward: pure Python, no model, no torch."""

from __future__ import annotations

import json

import pytest

from vericache.errors import InvalidRequestError
from vericache.sim.cost import Row, forward_cost, weights_fit
from vericache.sim.profiles import (
    DeviceProfile,
    bundled,
    device_profile,
    model_profile,
)

# Per bundled model: (biases on q, k and v; embedding tied to the LM head), from its config.json.
ARCHITECTURE = {
    "llama-3.1-70b": (False, False),
    "qwen2.5-32b": (True, False),
    "mistral-small-24b": (False, False),
    "smollm2-135m": (False, True),
}

# A device with few flops per byte, as a CPU has (about 6).
CPU_LIKE = DeviceProfile(
    name="cpu-like", source="test", memory_bytes=24 << 30, hbm_bytes_per_s=1e10,
    peak_flops=6e10, host_to_device_bytes_per_s=1e10, interconnect_bytes_per_s=1e9,
    bandwidth_efficiency=1.0, compute_efficiency=1.0, forward_overhead_s=0.0, layer_overhead_s=0.0,
)  # fmt: skip


def _params_from_shapes(name: str) -> int:
    m, (qkv_bias, tied) = model_profile(name), ARCHITECTURE[name]
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    attention = m.hidden_size * (q + 2 * kv) + q * m.hidden_size + (q + 2 * kv) * qkv_bias
    mlp = 3 * m.hidden_size * m.intermediate_size
    per_layer = attention + mlp + 2 * m.hidden_size  # and two norms
    embeddings = m.vocab_size * m.hidden_size * (1 if tied else 2)
    return m.num_layers * per_layer + m.hidden_size + embeddings


def test_every_bundled_model_has_the_parameters_its_shapes_give():
    assert set(bundled("models")) == set(ARCHITECTURE)
    for name in ARCHITECTURE:
        assert model_profile(name).num_params == _params_from_shapes(name), name


def test_bundled_gpus_are_datasheets_and_the_cpu_a_measurement():
    assert {"h100-sxm", "h100-nvl", "h200", "cpu"} <= set(bundled("devices"))
    for name in bundled("devices"):
        device = device_profile(name)
        if name == "cpu":  # `mode: auto`'s prior on a CPU (serve/backends/path_costs.py)
            assert device.is_measured and device.product_curve
            continue
        assert not device.is_measured and device.source.startswith("datasheet")
        assert device.bytes_per_s < device.hbm_bytes_per_s and device.flops < device.peak_flops


def test_a_decode_step_of_a_70b_model_reads_its_weights_once_per_forward():
    model, device = model_profile("llama-3.1-70b"), device_profile("h100-sxm")
    kv = model.kv_bytes_per_token()
    one = forward_cost(model, device, [Row(1, 4096, kv)], tensor_parallel=2)
    assert not one.is_compute_bound
    weights = model.weights_bytes() / 2
    assert one.bytes_read == pytest.approx(weights + 4097 * kv / 2)
    assert one.seconds == pytest.approx(
        one.bytes_read / device.bytes_per_s + one.overhead_s + one.communication_s
    )
    batch = forward_cost(model, device, [Row(1, 4096, kv)] * 8, tensor_parallel=2)
    assert batch.bytes_read == pytest.approx(weights + 8 * 4097 * kv / 2)  # weights once
    assert batch.seconds < 2 * one.seconds


def test_a_verification_costs_about_one_step_on_a_gpu_and_several_on_a_cpu():
    big, gpu = model_profile("llama-3.1-70b"), device_profile("h100-sxm")
    kv = big.kv_bytes_per_token()
    step = forward_cost(big, gpu, [Row(1, 8192, kv)], tensor_parallel=2).seconds
    verify = forward_cost(big, gpu, [Row(31, 8192, kv)], tensor_parallel=2).seconds
    assert 1.0 < verify / step < 1.25
    small = model_profile("smollm2-135m")
    kv32 = small.kv_bytes_per_token(4)
    step = forward_cost(small, CPU_LIKE, [Row(1, 3000, kv32)], weight_element_size=4).seconds
    verify = forward_cost(small, CPU_LIKE, [Row(31, 3000, kv32)], weight_element_size=4)
    assert verify.is_compute_bound and verify.seconds / step > 3


def test_prefill_is_compute_bound_and_attention_grows_with_context():
    model, device = model_profile("qwen2.5-32b"), device_profile("h200")
    kv = model.kv_bytes_per_token()
    prefill = forward_cost(model, device, [Row(2048, 0, kv)])
    assert prefill.is_compute_bound
    near, far = (forward_cost(model, device, [Row(2048, n, kv)]).flops for n in (0, 30000))
    pairs_added = 2048 * 30000
    assert far - near == pytest.approx(4 * 64 * 40 * 128 * pairs_added)


def test_tensor_parallel_splits_the_work_and_pays_its_all_reduces():
    model, device = model_profile("mistral-small-24b"), device_profile("h100-nvl")
    rows = [Row(1, 16384, model.kv_bytes_per_token())] * 4
    alone, pair = (forward_cost(model, device, rows, tensor_parallel=g) for g in (1, 2))
    assert alone.communication_s == 0 and pair.communication_s > 0
    assert pair.bytes_read == pytest.approx(alone.bytes_read / 2)
    assert pair.flops == pytest.approx(alone.flops / 2)
    with pytest.raises(InvalidRequestError, match="divide"):
        forward_cost(model, device, rows, tensor_parallel=3)


def test_a_70b_model_needs_two_80gb_devices():
    model, device = model_profile("llama-3.1-70b"), device_profile("h100-sxm")
    assert weights_fit(model, device, 1) < 0 < weights_fit(model, device, 2)


def test_bad_rows_and_profiles_are_refused(tmp_path):
    model, device = model_profile("smollm2-135m"), device_profile("h200")
    with pytest.raises(InvalidRequestError, match="at least one row"):
        forward_cost(model, device, [])
    for bad in ((0, 0, 1.0), (1, -1, 1.0), (1, 0, 0.0)):
        with pytest.raises(InvalidRequestError):
            Row(*bad)
    with pytest.raises(InvalidRequestError, match="known: .*llama-3.1-70b"):
        model_profile("gpt-5")
    data = json.loads(json.dumps(device.__dict__))
    (tmp_path / "extra.json").write_text(json.dumps({**data, "warp_speed": 9}))
    with pytest.raises(InvalidRequestError, match="unknown fields \\['warp_speed'\\]"):
        device_profile(str(tmp_path / "extra.json"))
    del data["peak_flops"]
    (tmp_path / "short.json").write_text(json.dumps(data))
    with pytest.raises(InvalidRequestError, match="missing fields \\['peak_flops'\\]"):
        device_profile(str(tmp_path / "short.json"))
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(InvalidRequestError, match="not JSON"):
        device_profile(str(tmp_path / "broken.json"))
    (tmp_path / "zero.json").write_text(json.dumps({**device.__dict__, "compute_efficiency": 0}))
    with pytest.raises(InvalidRequestError, match="compute_efficiency"):
        device_profile(str(tmp_path / "zero.json"))


def test_measured_products_follow_their_curve_not_the_roofline(tmp_path):
    """Between the row counts timed the products' time is interpolated, past the last it grows
    with the rows (flops bind); a calibration's curve survives its JSON."""
    model = model_profile("smollm2-135m")
    curve = ((1, 1e-10), (8, 2e-10), (16, 4e-10))
    measured = DeviceProfile(**{**CPU_LIKE.__dict__, "product_curve": curve})
    weight_bytes = model.weights_bytes()

    def products_s(device, rows: int) -> float:
        return forward_cost(model, device, [Row(rows, 0, 1.0)]).dense_s

    assert products_s(measured, 1) == pytest.approx(weight_bytes * 1e-10)
    assert products_s(measured, 12) == pytest.approx(weight_bytes * 3e-10)  # halfway 8 to 16
    assert products_s(measured, 32) == pytest.approx(weight_bytes * 8e-10)  # twice 16's
    roofline = max(weight_bytes / CPU_LIKE.bytes_per_s, 2 * model.num_params * 12 / 6e10)
    assert products_s(CPU_LIKE, 12) == pytest.approx(roofline)
    path = tmp_path / "measured.json"
    path.write_text(json.dumps(measured.__dict__))
    assert device_profile(str(path)) == measured
    for bad in (((2, 1e-10),), ((1, 1e-10), (1, 2e-10)), ((1, 0.0),), ((1, 1e-10, 3),)):
        with pytest.raises(InvalidRequestError, match="product_curve"):
            DeviceProfile(**{**CPU_LIKE.__dict__, "product_curve": bad})
