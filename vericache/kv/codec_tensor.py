"""One tensor to compact bytes and back, losslessly: reversible transforms, then zstd.

A tensor is read as a matrix [rows, columns]: rows along its first axis (tokens, slots or
quantization groups), columns all the rest (heads x channels). Each byte stream is stored in one of
two layouts, whichever compresses smaller on a sample of rows:
- "r", token-major, as stored: zstd finds repeated rows (early layers give a repeated token the
  same values);
- "c", channel-major: a channel's values follow each other, and vary little along tokens.

Multi-byte numbers are split into byte planes: the high byte of a float (sign, exponent) compresses
well, the low mantissa bytes are near random and are stored raw. Integers are delta coded along
rows first (positions ascend). Sub-byte quantization codes (uint8 tensors of a layer whose meta
gives 2 or 4 `bits`) may also be renamed, per channel, by frequency rank: channels' code
distributions differ mostly in location, and ranked they share one that zstd's per-block Huffman
table fits; channel-major, they are repacked so a byte holds consecutive tokens of one channel.
None of this depends on what the tensors mean: any bytes round-trip, only the ratio varies.
Byte planes are taken in the host's byte order: encoder and decoder must be little-endian.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import torch
import zstandard

from vericache.kv.codec_errors import CodecError, FormatError

# zstd level 1, tuned per kind of stream (measured on SmolLM2 KV). Byte planes of numbers are
# mostly literals for the Huffman coder: a small match table is faster and avoids short spurious
# matches that code worse than literals. Code streams repeat (a token's codes recur in early
# layers): a larger table and the double-fast matcher find those repeats.
ZSTD_PROFILES = {
    "literals": {"hash_log": 10, "min_match": 7},
    "matches": {"strategy": 2, "hash_log": 17, "chain_log": 16, "min_match": 5},
}
SAMPLE_ROWS = 512  # rows on which layouts are compared before the whole tensor is compressed
RAW_RATIO = 0.98  # a plane whose sample compresses less than this is stored as is
CODE_BITS = (2, 4)  # packed code widths that get the code transforms
CODE_FORMS = ("r", "c", "rank-r", "rank-c")  # codes: optionally ranked, token- or channel-major

DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "float8_e4m3fn",
        "float8_e5m2",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
    )
    if hasattr(torch, name)
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_SIGNED = {8: np.int64, 4: np.int32, 2: np.int16}
_UNSIGNED = {8: np.uint64, 4: np.uint32, 2: np.uint16}

_local = threading.local()


def _contexts() -> threading.local:
    if not hasattr(_local, "decompressor"):
        # One context per thread: zstd contexts are not thread-safe. No zstd worker threads, no
        # zstd checksum (each chunk carries a CRC).
        _local.compressors = {
            name: zstandard.ZstdCompressor(
                compression_params=zstandard.ZstdCompressionParameters.from_level(1, **params)
            )
            for name, params in ZSTD_PROFILES.items()
        }
        _local.decompressor = zstandard.ZstdDecompressor()
    return _local


def zstd_compress(data, profile: str = "literals") -> bytes:
    return _contexts().compressors[profile].compress(data)


def zstd_decompress(data, size: int) -> bytes:
    try:
        out = _contexts().decompressor.decompress(data, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise FormatError(f"a compressed section does not decompress: {exc}") from exc
    if len(out) != size:
        raise FormatError(f"a section decompressed to {len(out)} bytes, expected {size}")
    return out


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _DTYPE_NAMES:
        raise CodecError(f"the KV codec cannot store tensors of dtype {dtype}")
    return _DTYPE_NAMES[dtype]


def _matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    numel = int(np.prod(shape, dtype=np.int64))
    if len(shape) < 2 or numel == 0:
        return numel, 1
    return shape[0], numel // shape[0]


# --- Encoding -------------------------------------------------------------------------------------


def encode_tensor(
    tensor: torch.Tensor, code_bits: int | None = None, code_forms: tuple[str, ...] = CODE_FORMS
) -> tuple[dict, list]:
    """A JSON-able spec (dtype, shape, transforms, section sizes) and the sections (bytes-like).

    code_bits: the code width when the tensor may hold packed quantization codes (a hint only);
    code_forms: the forms of codes to try (all of them but in tests).
    """
    if sys.byteorder != "little":
        raise CodecError("the KV codec runs on little-endian hosts only")
    tensor = tensor.detach().cpu().contiguous()
    shape = tuple(tensor.shape)
    spec = {"dtype": dtype_name(tensor.dtype), "shape": list(shape)}
    rows, cols = _matrix_shape(shape)
    if rows * cols == 0:
        return {**spec, "method": "empty", "sizes": [], "stored": ""}, []
    data = tensor.reshape(-1).view(torch.uint8).numpy()  # [rows * cols * itemsize]
    if tensor.dtype == torch.uint8 and code_bits in CODE_BITS and len(shape) >= 2:
        form, sections, stored = _encode_codes(data.reshape(rows, cols), code_bits, code_forms)
        transform = {"method": "codes", "bits": code_bits, "form": form}
    else:
        itemsize = tensor.element_size()
        is_delta = not tensor.dtype.is_floating_point and itemsize > 1
        matrix = data.reshape(rows, cols, itemsize)
        if is_delta:
            matrix = _delta_zigzag(matrix)
        layouts, sections, stored = _encode_planes(matrix)
        transform = {"method": "planes", "delta": is_delta, "layouts": layouts}
    return {**spec, **transform, "sizes": [len(s) for s in sections], "stored": stored}, sections


def _delta_zigzag(matrix: np.ndarray) -> np.ndarray:
    """[rows, cols, size] little-endian integers -> zigzag of their differences along rows."""
    rows, cols, size = matrix.shape
    values = matrix.reshape(-1).view(_SIGNED[size]).reshape(rows, cols)
    delta = values.copy()
    delta[1:] -= values[:-1]  # wraps around, as the cumulative sum that undoes it
    zigzag = (delta << 1) ^ (delta >> (8 * size - 1))
    return zigzag.view(np.uint8).reshape(rows, cols, size)


def _encode_planes(matrix: np.ndarray) -> tuple[str, list, str]:
    """Byte planes of [rows, cols, size], each in its best layout ("r" or "c"), zstd or raw."""
    layouts, sections, stored = "", [], ""
    for plane_index in range(matrix.shape[2]):
        layout, section, how = _encode_stream(matrix[:, :, plane_index])
        layouts += layout
        sections.append(section)
        stored += how
    return layouts, sections, stored


def _encode_stream(plane: np.ndarray) -> tuple[str, bytes | memoryview, str]:
    """One [rows, cols] uint8 stream: layout, bytes, and "z" (zstd) or "r" (raw)."""
    rows, cols = plane.shape
    sample = _sample(plane)
    trials = {"r": zstd_compress(_arrange(sample, "r"))}
    if len(trials["r"]) > RAW_RATIO * sample.size:  # near-random bytes, e.g. low mantissa bits
        return "r", _buffer(plane), "r"
    if rows > 1 and cols > 1:
        trials["c"] = zstd_compress(_arrange(sample, "c"))
    layout = min(trials, key=lambda name: len(trials[name]))
    compressed = trials[layout] if rows <= SAMPLE_ROWS else zstd_compress(_arrange(plane, layout))
    if len(compressed) >= plane.size:
        return "r", _buffer(plane), "r"
    return layout, compressed, "z"


def _sample(matrix: np.ndarray) -> np.ndarray:
    """Rows from the middle: the first tokens of a prefix (template, sinks) are atypical."""
    start = max(0, (matrix.shape[0] - SAMPLE_ROWS) // 2)
    return matrix[start : start + SAMPLE_ROWS]


def _buffer(array: np.ndarray) -> memoryview:
    """The bytes of an array, without a copy when it is contiguous already."""
    return np.ascontiguousarray(array).reshape(-1).data


def _arrange(plane: np.ndarray, layout: str) -> np.ndarray:
    return np.ascontiguousarray(plane.T if layout == "c" else plane)


def _encode_codes(packed: np.ndarray, bits: int, forms) -> tuple[str, list[bytes], str]:
    """Packed codes [rows, P] in the smallest of `forms` on a sample of rows: its name, its
    sections and their storage flags."""
    sample = _sample(packed)
    luts, ranking = _rank_luts(sample, bits)

    def sections_of(codes: np.ndarray, form: str) -> list[bytes]:
        if form.startswith("rank-"):
            codes = _apply_luts(codes, luts)
        body = _to_columns(codes, bits) if form.endswith("c") else codes
        parts = [ranking, body] if form.startswith("rank-") else [body]
        return [zstd_compress(part, "matches") for part in parts]

    trials = {form: sections_of(sample, form) for form in forms}
    form = min(trials, key=lambda name: sum(len(s) for s in trials[name]))
    sections = trials[form] if packed.shape[0] <= SAMPLE_ROWS else sections_of(packed, form)
    return form, sections, "z" * len(sections)


def _unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """uint8 [..., B] -> codes [..., B * 8 / bits], lowest bits first (one table lookup a byte)."""
    codes = _UNPACK_TABLES[bits][packed]  # [..., B] of 8/bits-byte words, one code a byte
    return codes.view(np.uint8).reshape(*packed.shape[:-1], -1)


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """codes [..., C] (each < 2**bits, C a multiple of 8 / bits) -> uint8 [..., C * bits / 8]."""
    per_byte = 8 // bits
    words = np.ascontiguousarray(codes).view(_WORDS[per_byte])  # per_byte codes, little-endian
    gathered = words.copy()
    for slot in range(1, per_byte):  # code `slot` sits at bit 8 * slot, belongs at bits * slot
        gathered |= words >> (slot * (8 - bits))
    return gathered.astype(np.uint8)


def _unpack_table(bits: int) -> np.ndarray:
    per_byte = 8 // bits
    values = np.arange(256, dtype=np.uint32)
    slots = [(values >> (bits * slot)) & ((1 << bits) - 1) for slot in range(per_byte)]
    words = sum(code << (8 * slot) for slot, code in enumerate(slots))
    return words.astype(_WORDS[per_byte])


_WORDS = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
_UNPACK_TABLES = {bits: _unpack_table(bits) for bits in CODE_BITS}


def _to_columns(packed: np.ndarray, bits: int) -> np.ndarray:
    """[rows, P] packed token-major -> the same codes channel-major, packed: [M * rows * bits/8]."""
    return _pack(_unpack(packed, bits).T.reshape(-1), bits)


def _from_columns(packed: np.ndarray, rows: int, bits: int) -> np.ndarray:
    """Inverse of `_to_columns`: -> [rows, P]."""
    channel_major = _unpack(packed, bits).reshape(-1, rows)  # [M, rows]
    return _pack(channel_major.T, bits)


def _rank_luts(sample: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Per packed column, a byte table renaming each channel's codes by frequency rank in the
    sample ([P, 256]), and the packed ranking [M, S] the decoder inverts it with."""
    num_symbols = 1 << bits
    codes = _unpack(sample, bits)  # [w, M]
    num_channels = codes.shape[1]
    offsets = np.arange(num_channels, dtype=np.int32) * num_symbols
    counts = np.bincount((codes + offsets).reshape(-1), minlength=num_channels * num_symbols)
    ranking = np.argsort(-counts.reshape(num_channels, num_symbols), axis=1, kind="stable")
    ranking = ranking.astype(np.uint8)  # [M, S]: the code holding each rank
    inverse = np.empty_like(ranking)
    np.put_along_axis(
        inverse, ranking.astype(np.intp), np.arange(num_symbols, dtype=np.uint8)[None], 1
    )
    return _byte_luts(inverse, bits), _pack(ranking, bits)


def _byte_luts(channel_maps: np.ndarray, bits: int) -> np.ndarray:
    """[M, S] code maps per channel -> [M * bits / 8, 256] maps of the bytes holding them."""
    per_byte = 8 // bits
    maps = channel_maps.reshape(-1, per_byte, 1 << bits)  # [P, slot, S]
    slot_codes = _unpack(np.arange(256, dtype=np.uint8)[:, None], bits)  # [256, slot]
    mapped = maps[:, np.arange(per_byte)[None, :], slot_codes]  # [P, 256, slot]
    return _pack(mapped, bits)[..., 0]


def _apply_luts(packed: np.ndarray, luts: np.ndarray) -> np.ndarray:
    """out[t, j] = luts[j, packed[t, j]]."""
    flat = luts.reshape(-1)
    offsets = np.arange(luts.shape[0], dtype=np.int32) * 256
    return flat[packed + offsets]


# --- Decoding -------------------------------------------------------------------------------------


def decode_tensor(spec: dict, sections: list[memoryview]) -> torch.Tensor:
    """Inverse of `encode_tensor`; raises FormatError when spec and sections disagree."""
    dtype = DTYPES[spec["dtype"]]
    shape = tuple(int(n) for n in spec["shape"])
    if any(n < 0 for n in shape):
        raise FormatError(f"negative dimension in tensor shape {shape}")
    rows, cols = _matrix_shape(shape)
    itemsize = dtype.itemsize
    method = spec["method"]
    if method == "empty" and rows * cols == 0 and not sections:
        data = np.zeros(0, np.uint8)
    elif (
        method == "codes" and dtype == torch.uint8 and spec["bits"] in CODE_BITS and len(shape) > 1
    ):
        data = _decode_codes(spec, sections, rows, cols)
    elif method == "planes" and len(spec["layouts"]) == itemsize == len(sections):
        data = _decode_planes(spec, sections, rows, cols, itemsize)
    else:
        raise FormatError(f"inconsistent tensor record (method {method!r}, dtype {dtype})")
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return torch.from_numpy(raw).view(dtype).reshape(shape)


def _section(sections, index: int, stored: str, size: int) -> bytes:
    if stored[index] == "r":
        if len(sections[index]) != size:
            raise FormatError(f"a raw section holds {len(sections[index])} bytes, expected {size}")
        return sections[index]
    return zstd_decompress(sections[index], size)


def _decode_planes(spec, sections, rows: int, cols: int, itemsize: int) -> np.ndarray:
    matrix = np.empty((rows, cols, itemsize), np.uint8)
    for index, layout in enumerate(spec["layouts"]):
        plane = np.frombuffer(_section(sections, index, spec["stored"], rows * cols), np.uint8)
        matrix[:, :, index] = (
            plane.reshape(cols, rows).T if layout == "c" else plane.reshape(rows, cols)
        )
    if spec["delta"]:
        zigzag = matrix.reshape(-1).view(_UNSIGNED[itemsize]).reshape(rows, cols)
        delta = ((zigzag >> 1) ^ (0 - (zigzag & 1))).view(_SIGNED[itemsize])
        matrix = np.cumsum(delta, axis=0, dtype=_SIGNED[itemsize])
    return matrix


def _decode_codes(spec, sections, rows: int, cols: int) -> np.ndarray:
    bits, form, stored = spec["bits"], spec["form"], spec["stored"]
    is_ranked = form.startswith("rank-")
    body_index = int(is_ranked)  # a ranked form's table comes first
    if form not in CODE_FORMS or len(sections) != 1 + body_index:
        raise FormatError(f"inconsistent code record (form {form!r}, {len(sections)} sections)")
    body = np.frombuffer(_section(sections, body_index, stored, rows * cols), np.uint8)
    if form.endswith("c"):
        packed = _from_columns(body, rows, bits)
    else:
        packed = body.reshape(rows, cols)
    if not is_ranked:
        return packed.copy() if not packed.flags.writeable else packed
    num_channels = cols * 8 // bits
    table = _section(sections, 0, stored, num_channels * (1 << bits) * bits // 8)
    ranking = _unpack(np.frombuffer(table, np.uint8), bits).reshape(num_channels, -1)
    return _apply_luts(packed, _byte_luts(ranking, bits))
