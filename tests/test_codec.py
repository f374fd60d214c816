"""The KV codec: bit-exact round trips of every layer kind, and a typed error, never a wrong cache,
on truncated, corrupted, wrong-version or wrong-model input."""

from __future__ import annotations

import dataclasses
import io
import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vericache.cli.main import main
from vericache.compress import build_compressor, cache_from_state
from vericache.kv.cache import DenseLayerKV, KVCache
from vericache.kv.codec import (
    FORMAT_VERSION,
    decode,
    decode_bytes,
    decode_iter,
    encode,
    encode_bytes,
    iter_encode,
    model_fingerprint,
)
from vericache.kv.codec_errors import (
    ChecksumError,
    CodecError,
    FormatError,
    ModelMismatchError,
    TruncatedError,
    VersionError,
)
from vericache.kv.codec_tensor import CODE_FORMS, decode_tensor, encode_tensor
from vericache.kv.state import CacheState, LayerState
from vericache.model.config import ModelConfig

FINGERPRINT = "sha256:test-model"
DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def full_cache(num_tokens: int, num_layers=2, heads=2, head_dim=16, dtype=torch.bfloat16):
    generator = torch.Generator().manual_seed(num_tokens)
    positions = torch.arange(num_tokens, dtype=torch.int32)
    layers = []
    for _ in range(num_layers):
        keys, values = torch.randn(2, num_tokens, heads, head_dim, generator=generator).to(dtype)
        layers.append(DenseLayerKV.from_tensors(keys, values, positions))
    return KVCache(layers, num_tokens)


def round_trip(state: CacheState) -> CacheState:
    back = decode_bytes(encode_bytes(state, FINGERPRINT), FINGERPRINT)
    assert back.equals(state)
    return back


# --- Round trips -------------------------------------------------------------------------------


# 700 tokens: more rows than the codec samples, KIVI groups plus a full-precision residual.
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "compressor",
    [
        None,
        ("kivi", {"bits": 2}),
        ("kivi", {"bits": 4}),
        ("kivi", {"bits": 8}),
        ("streamingllm", {"ratio": 4.0}),
        ("streamingllm", {"ratio": 3.0, "sliding": True}),
    ],
)
def test_compressed_caches_round_trip_exactly(dtype, compressor):
    full = full_cache(700, dtype=dtype)
    cache = (
        full
        if compressor is None
        else build_compressor(compressor[0], **compressor[1]).compress(full)
    )
    state = cache.to_state()
    back = round_trip(state)
    rebuilt = cache_from_state(back)
    assert type(rebuilt) is type(cache)
    keys, values = rebuilt.layers[1].keys_values()
    expected_keys, expected_values = cache.layers[1].keys_values()
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)


def test_extras_budgets_special_values_and_empty_tensors_round_trip():
    special = torch.tensor([float("nan"), -0.0, 0.0, float("inf"), -float("inf"), 1e-40])
    payload_nan = torch.tensor([0x7FC1, -1], dtype=torch.int16).view(torch.bfloat16)
    state = CacheState(
        num_tokens=12,
        layers=[
            LayerState(
                "dense",
                {},
                {
                    "keys": torch.empty(0, 2, 4),
                    "values": torch.empty(0, 2, 4),
                    "positions": torch.empty(0, 2, dtype=torch.int32),
                },
            ),
            LayerState(
                "dense",
                {"note": "é", "scale": 0.5, "flag": True},
                {
                    "keys": special.view(1, 2, 3),
                    "values": special.view(1, 2, 3) * 2,
                    "positions": torch.tensor([[7, 11]], dtype=torch.int32),
                },
            ),
            LayerState(
                "quantized",
                {"bits": 4, "group_size": 1},
                {
                    "codes": torch.randint(0, 256, (3, 2, 2), dtype=torch.uint8),
                    "nan_payloads": payload_nan,
                    "one": torch.tensor([3.5]),
                },
            ),
        ],
        budgets=[3, 1, 4],
        compressor={"name": "h2o", "params": {"ratio": 4.0, "recent": 8, "sliding": False}},
        extras={
            "accumulated": [
                torch.rand(0, 2),
                torch.rand(5, 2),
                torch.rand(1, 2, dtype=torch.float64),
            ],
            "mask": [torch.tensor([True, False, True])],
            "nothing": [],
        },
    )
    back = round_trip(state)
    assert back.compressor == state.compressor and back.budgets == [3, 1, 4]
    assert back.layers[1].meta == {"note": "é", "scale": 0.5, "flag": True}


def make_tensor(shape: list[int], dtype: torch.dtype, pattern: str, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    numel = 1
    for size in shape:
        numel *= size
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if pattern == "random":  # every bit pattern, NaNs included
        raw = torch.randint(
            0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=generator
        )
        return raw.view(dtype).reshape(shape)
    if pattern == "ramp":  # sorted, like positions
        return (torch.arange(numel) % 97).to(dtype).reshape(shape)
    return torch.full(shape, 3, dtype=dtype)


@st.composite
def tensors(draw, rows=None):
    dtype = draw(st.sampled_from(DTYPES))
    ndim = draw(st.integers(1, 3))  # 0-d: see test_scalar_tensors_round_trip
    shape = draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim))
    if ndim:
        shape[0] = draw(st.sampled_from([0, 1, 2, 7, 40, 600])) if rows is None else rows
    pattern = draw(st.sampled_from(["random", "ramp", "constant"]))
    return make_tensor(shape, dtype, pattern, draw(st.integers(0, 1000)))


@st.composite
def layer_states(draw):
    kind = draw(st.sampled_from(["dense", "quantized", "other"]))
    meta = draw(st.sampled_from([{}, {"bits": 2}, {"bits": 4, "group_size": 32}, {"bits": 8}]))
    names = draw(
        st.lists(
            st.sampled_from(["keys", "values", "codes", "positions", "x"]), unique=True, max_size=4
        )
    )
    tensors_by_name = {name: draw(tensors()) for name in names}
    if meta and draw(st.booleans()):  # packed codes, e.g. [T, H, D * bits / 8]
        rows = draw(st.sampled_from([1, 33, 600]))
        tensors_by_name["codes"] = make_tensor([rows, 2, 4], torch.uint8, "random", rows)
    return LayerState(kind, meta, tensors_by_name)


@st.composite
def cache_states(draw):
    layers = draw(st.lists(layer_states(), max_size=3))
    extras = draw(st.dictionaries(st.text(max_size=5), st.lists(tensors(), max_size=2), max_size=2))
    budgets = draw(st.one_of(st.none(), st.lists(st.integers(0, 10**6), max_size=3)))
    compressor = draw(
        st.sampled_from([None, {"name": "snapkv", "params": {"ratio": 4.0, "window": 32}}])
    )
    return CacheState(draw(st.integers(0, 10**6)), layers, budgets, compressor, extras)


@PROPERTY
@given(cache_states())
def test_any_cache_state_round_trips_exactly(state):
    round_trip(state)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scalar_tensors_round_trip(dtype):
    # Outside a CacheState: CacheState.equals cannot view a 0-d float tensor as bytes.
    scalar = make_tensor([], dtype, "random", 1)
    spec, sections = encode_tensor(scalar)
    back = decode_tensor(spec, sections)
    assert back.shape == () and back.dtype == dtype
    assert torch.equal(back.reshape(1).view(torch.uint8), scalar.reshape(1).view(torch.uint8))


@pytest.mark.parametrize("form", CODE_FORMS)
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("rows", [1, 37, 700])
def test_every_form_of_codes_round_trips(form, bits, rows):
    # Codes with a per-channel offset, as quantized values have, in every form the codec can pick.
    generator = torch.Generator().manual_seed(rows)
    levels = 1 << bits
    codes = (torch.randn(rows, 3, 16, generator=generator) + torch.linspace(-2, 2, 16)).mul(
        levels / 6
    )
    codes = codes.add(levels / 2).round().clamp(0, levels - 1).to(torch.uint8)
    from vericache.kernels.quant import pack

    packed = pack(codes, bits)
    spec, sections = encode_tensor(packed, bits, code_forms=(form,))
    assert spec["form"] == form
    assert torch.equal(decode_tensor(spec, [memoryview(bytes(s)) for s in sections]), packed)


def test_codec_picks_compact_forms():
    # Positions ascend: delta coding makes them nearly free.
    positions = torch.arange(5000, dtype=torch.int32).unsqueeze(1).expand(-1, 4).contiguous()
    spec, sections = encode_tensor(positions)
    assert sum(map(len, sections)) < positions.numel() * 4 / 100
    # Channels of their own magnitude compress channel-major; repeated rows token-major.
    generator = torch.Generator().manual_seed(0)
    magnitudes = 2.0 ** torch.randint(-20, 20, (64,), generator=generator)
    channels = torch.randn(2000, 64, generator=generator).sign() * magnitudes
    assert encode_tensor(channels.to(torch.bfloat16))[0]["layouts"][1] == "c"
    repeated = torch.randn(50, 64).to(torch.bfloat16).repeat(40, 1)
    assert encode_tensor(repeated)[0]["layouts"][1] == "r"
    # Random low bytes are stored raw, not wasted on zstd.
    assert encode_tensor(torch.randn(2000, 64).to(torch.bfloat16))[0]["stored"][0] == "r"


def test_quantized_cache_is_smaller_on_the_wire_than_resident():
    full = full_cache(1024, num_layers=2, heads=2, head_dim=64)
    for bits in (2, 4):
        cache = build_compressor("kivi", bits=bits).compress(full)
        assert len(encode_bytes(cache.to_state(), FINGERPRINT)) < cache.resident_bytes


# --- Streaming ---------------------------------------------------------------------------------


class TrickleReader(io.RawIOBase):
    """Hands out at most 5 bytes a read, as a socket may."""

    def __init__(self, data: bytes):
        self._data, self._offset = data, 0

    def readable(self):
        return True

    def read(self, size=-1):
        piece = self._data[self._offset : self._offset + min(size, 5)]
        self._offset += len(piece)
        return piece


def sample_state() -> CacheState:
    state = build_compressor("kivi", bits=2).compress(full_cache(200, num_layers=3)).to_state()
    state.extras = {"scores": [torch.rand(10, 2), torch.rand(3, 2)]}
    return state


def test_streaming_interfaces_agree():
    state = sample_state()
    pieces = list(iter_encode(state, FINGERPRINT))
    assert len(pieces) == 1 + 3 + 1 + 1  # header, layers, extras, end
    blob = b"".join(pieces)
    assert blob == encode_bytes(state, FINGERPRINT)
    out = io.BytesIO()
    assert encode(state, FINGERPRINT, out) == len(blob) and out.getvalue() == blob
    assert decode(TrickleReader(blob), FINGERPRINT).equals(state)
    small_pieces = [blob[i : i + 7] for i in range(0, len(blob), 7)]
    assert decode_iter(small_pieces, FINGERPRINT).equals(state)
    # Two streams back to back: decode stops at the end chunk.
    both = io.BytesIO(blob + blob)
    assert decode(both, FINGERPRINT).equals(state) and decode(both, FINGERPRINT).equals(state)


# --- Damaged input -----------------------------------------------------------------------------

BLOB = encode_bytes(sample_state(), FINGERPRINT)


@PROPERTY
@given(st.integers(0, len(BLOB) - 1), st.integers(1, 255))
def test_any_flipped_byte_is_detected(position, xor):
    damaged = bytearray(BLOB)
    damaged[position] ^= xor
    with pytest.raises(CodecError):
        decode_bytes(bytes(damaged), FINGERPRINT)


@PROPERTY
@given(st.integers(0, len(BLOB) - 1))
def test_any_truncation_is_detected(length):
    with pytest.raises(TruncatedError):
        decode_bytes(BLOB[:length], FINGERPRINT)
    with pytest.raises(TruncatedError):
        decode(io.BytesIO(BLOB[:length]), FINGERPRINT)


@PROPERTY
@given(st.integers(0, len(BLOB) - 1), st.binary(min_size=1, max_size=8), st.booleans())
def test_inserted_or_deleted_bytes_are_detected(position, inserted, delete):
    damaged = BLOB[:position] + (b"" if delete else inserted) + BLOB[position + delete :]
    with pytest.raises(CodecError):
        decode_bytes(damaged, FINGERPRINT)


def test_each_kind_of_bad_input_has_its_error():
    with pytest.raises(ModelMismatchError, match="expected sha256:other"):
        decode_bytes(BLOB, "sha256:other")
    newer = bytearray(BLOB)
    newer[8:10] = struct.pack("<H", FORMAT_VERSION + 1)
    with pytest.raises(VersionError):
        decode_bytes(bytes(newer), FINGERPRINT)
    with pytest.raises(FormatError, match="not a VeriCache KV stream"):
        decode_bytes(b"GIF89a" + BLOB[6:], FINGERPRINT)
    with pytest.raises(FormatError, match="after the end chunk"):
        decode_bytes(BLOB + b"\0", FINGERPRINT)
    with pytest.raises(TruncatedError):
        decode_bytes(b"", FINGERPRINT)
    corrupted = bytearray(BLOB)
    corrupted[-100] ^= 1
    with pytest.raises(ChecksumError):
        decode_bytes(bytes(corrupted), FINGERPRINT)
    # Chunks that are intact but out of order.
    pieces = list(iter_encode(sample_state(), FINGERPRINT))
    pieces[1], pieces[2] = pieces[2], pieces[1]
    with pytest.raises(FormatError, match="expected chunk 0"):
        decode_bytes(b"".join(pieces), FINGERPRINT)


def test_unstorable_states_are_refused_when_encoding():
    state = CacheState(1, [LayerState("dense", {}, {"z": torch.zeros(2, dtype=torch.complex64)})])
    with pytest.raises(CodecError, match="dtype"):
        encode_bytes(state, FINGERPRINT)
    tuple_params = CacheState(1, [], compressor={"name": "x", "params": {"sizes": (1, 2)}})
    with pytest.raises(CodecError, match="JSON"):
        encode_bytes(tuple_params, FINGERPRINT)


def test_model_fingerprint_tells_models_apart():
    raw = {
        "model_type": "llama",
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    config = ModelConfig.from_hf(raw)
    fingerprint = model_fingerprint(config, "tiny")
    assert fingerprint == model_fingerprint(ModelConfig.from_hf(raw), "tiny")
    assert fingerprint != model_fingerprint(config, "other")
    assert fingerprint != model_fingerprint(dataclasses.replace(config, rms_norm_eps=1e-5), "tiny")
    blob = encode_bytes(sample_state(), fingerprint)
    with pytest.raises(ModelMismatchError):
        decode_bytes(blob, model_fingerprint(config, "other"))


# --- vericache kv-size ----------------------------------------------------------------------------


def test_kv_size_reports_bad_arguments_in_one_line(tmp_path, capsys):
    missing = ["kv-size", "--context-file", str(tmp_path / "nope.txt"), "--compressor", "kivi"]
    assert main(missing) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "context.txt").write_text("def f():\n    return 1\n")
    unknown = ["kv-size", "--context-file", str(tmp_path / "context.txt"), "--compressor", "zip"]
    assert main(unknown) == 2
    assert "unknown compressor 'zip'" in capsys.readouterr().err


@pytest.mark.slow
def test_kv_size_on_the_embedded_model(tmp_path, capsys):
    context = tmp_path / "context.py"
    context.write_text("".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(15)))
    argv = ["kv-size", "--context-file", str(context), "--dtype", "float32", "--json"]
    # float32: a CPU without bfloat16 units prefills in bfloat16 about ten times slower.
    reports = {}
    for name, strength in [("kivi", ["--bits", "2"]), ("snapkv", ["--ratio", "4"])]:
        assert main([*argv, "--compressor", name, *strength]) == 0
        reports[name] = json.loads(capsys.readouterr().out)
    report = reports["kivi"]
    assert report["label"] == "kivi-2bit" and report["round_trip_exact"] is True
    assert report["full_bytes"] == 2 * report["full_bf16_bytes"]
    assert report["wire_bytes"] < report["resident_bytes"] < report["full_bf16_bytes"]
    composed = ["--compressor", "snapkv+kivi", "--ratio", "4", "--bits", "2"]
    assert main([*argv, *composed]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["label"] == "snapkv-4x+kivi-2bit" and report["round_trip_exact"] is True
    assert report["compressor"]["name"] == "snapkv+kivi"
    # Smaller than either part alone (the kept 1/4, each at about 2/16 bits plus statistics and
    # a full-precision residual).
    assert report["c"] < min(reports["kivi"]["c"], reports["snapkv"]["c"])
