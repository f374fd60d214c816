"""A compact, versioned, chunked binary format for KV caches (`CacheState`), streamed both ways.

Wire layout, integers little-endian:

    prelude  magic (8 bytes) | version u16 | flags u16 | header length u32 | CRC32 of those 16 bytes
    header   JSON: model fingerprint, layer count, KV heads, head dim, dtype, compressor spec,
             token count, budgets, extras names and counts | CRC32 of the JSON
    chunks   one per layer, then one per extras name, then an end chunk; each is
             tag u8 | 3 zero bytes | index u32 | payload length u64 | payload CRC32 | CRC32 of these
             20 bytes, then the payload: compressed and JSON lengths (u32 each) | zstd(JSON
             descriptor: layer kind, meta, and per tensor its name, dtype, shape, transform and
             section sizes) | the tensors' sections. The end chunk's payload is its own index u32.

A chunk is produced and consumed whole, so a sender can put each on the network as it is encoded
(`iter_encode`) and a receiver decodes as chunks arrive (`decode`, `decode_iter`). Tensors are made
compact by codec_tensor.py. Every byte is covered by a checksum, and the end chunk closes the
stream, so truncated, corrupted, wrong-version and wrong-model input raises a `CodecError`
subclass instead of giving a wrong cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import struct
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, BinaryIO

import torch

from vericache.kv.codec_errors import (
    ChecksumError,
    CodecError,
    FormatError,
    ModelMismatchError,
    TruncatedError,
    VersionError,
)
from vericache.kv.codec_tensor import (
    decode_tensor,
    dtype_name,
    encode_tensor,
    zstd_compress,
    zstd_decompress,
)
from vericache.kv.state import CacheState, LayerState

if TYPE_CHECKING:
    from vericache.model.config import ModelConfig

__all__ = [
    "ChecksumError",
    "CodecError",
    "FormatError",
    "ModelMismatchError",
    "TruncatedError",
    "VersionError",
    "decode",
    "decode_bytes",
    "decode_iter",
    "encode",
    "encode_bytes",
    "iter_encode",
    "model_fingerprint",
]

MAGIC = b"\x89VKV\r\n\x1a\n"  # PNG-style: catches text-mode newline mangling and 7-bit channels
FORMAT_VERSION = 1
_PRELUDE = struct.Struct("<8sHHI")
_CHUNK = struct.Struct("<B3xIQI")
_U32 = struct.Struct("<I")
_DESCRIPTOR = struct.Struct("<II")  # compressed size, JSON size
MAX_HEADER_BYTES = 1 << 24
MAX_DESCRIPTOR_BYTES = 1 << 26


class ChunkTag:
    LAYER = 1
    EXTRAS = 2
    END = 3


def model_fingerprint(config: ModelConfig, model_name: str) -> str:
    """Identity of the model whose KV a stream holds: a hash of its name and every `ModelConfig`
    field (a frozen dataclass)."""
    described = {"model": model_name, "config": dataclasses.asdict(config)}
    digest = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()
    return f"sha256:{digest[:32]}"


# --- Encoding -------------------------------------------------------------------------------------


def iter_encode(state: CacheState, fingerprint: str) -> Iterator[bytes]:
    """The stream as byte strings, the header then one chunk at a time, each made when asked for."""
    for pieces in _encoded_pieces(state, fingerprint):
        yield b"".join(pieces)


def encode(state: CacheState, fingerprint: str, out: BinaryIO) -> int:
    """Write the stream to `out` chunk by chunk; returns the number of bytes written."""
    written = 0
    for pieces in _encoded_pieces(state, fingerprint):
        for piece in pieces:
            out.write(piece)
            written += len(piece)
    return written


def encode_bytes(state: CacheState, fingerprint: str) -> bytes:
    return b"".join(piece for pieces in _encoded_pieces(state, fingerprint) for piece in pieces)


def _encoded_pieces(state: CacheState, fingerprint: str) -> Iterator[list]:
    """The header, then each chunk, as lists of bytes-like pieces (joined only when needed)."""
    yield [_header_bytes(state, fingerprint)]
    index = 0
    for layer in state.layers:
        yield _chunk(ChunkTag.LAYER, index, _layer_payload(layer))
        index += 1
    for name, tensors in state.extras.items():
        yield _chunk(ChunkTag.EXTRAS, index, _extras_payload(name, tensors))
        index += 1
    yield _chunk(ChunkTag.END, index, [_U32.pack(index)])


def _json(value, what: str) -> bytes:
    """Compact JSON that reads back equal (tuples or non-JSON objects would not)."""
    try:
        text = json.dumps(value, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise CodecError(f"{what} cannot be stored: {exc}") from exc
    if json.loads(text) != value:
        raise CodecError(f"{what} does not survive JSON (tuples or NaN?): {value!r}")
    return text.encode()


def _header_bytes(state: CacheState, fingerprint: str) -> bytes:
    header = {
        "fingerprint": fingerprint,
        "num_layers": len(state.layers),
        **_geometry(state),
        "compressor": state.compressor,
        "num_tokens": state.num_tokens,
        "budgets": state.budgets,
        "extras": [[name, len(tensors)] for name, tensors in state.extras.items()],
    }
    body = _json(header, "the cache header")
    prelude = _PRELUDE.pack(MAGIC, FORMAT_VERSION, 0, len(body))
    return b"".join([prelude, _crc(prelude), body, _crc(body)])


def _geometry(state: CacheState) -> dict:
    """KV heads, head dim and dtype of the model's keys, as the first layer holds them."""
    tensors = state.layers[0].tensors if state.layers else {}
    floats = {name: t for name, t in tensors.items() if t.is_floating_point() and t.dim() == 3}
    # "keys" (dense) or "residual_keys" (quantized) rather than fp16 scales stored before them.
    keys = [t for name, t in floats.items() if name.endswith("keys")] or list(floats.values())
    if not keys:
        return {"num_kv_heads": None, "head_dim": None, "dtype": None}
    _, num_kv_heads, head_dim = keys[0].shape
    return {"num_kv_heads": num_kv_heads, "head_dim": head_dim, "dtype": dtype_name(keys[0].dtype)}


def _crc(data) -> bytes:
    return _U32.pack(zlib.crc32(data))


def _chunk(tag: int, index: int, pieces: list) -> list:
    """One chunk's pieces: its head, the head's CRC, then the payload's pieces (bytes-like)."""
    crc = 0
    for piece in pieces:
        crc = zlib.crc32(piece, crc)
    head = _CHUNK.pack(tag, index, sum(len(piece) for piece in pieces), crc)
    return [head, _crc(head), *pieces]


def _tensor_records(tensors: Iterable[torch.Tensor], code_bits) -> tuple[list, list]:
    specs, sections = [], []
    for tensor in tensors:
        spec, parts = encode_tensor(tensor, code_bits)
        specs.append(spec)
        sections.extend(parts)
    return specs, sections


def _payload(descriptor: dict, sections: list, what: str) -> list:
    text = _json(descriptor, what)
    packed = zstd_compress(text)
    return [_DESCRIPTOR.pack(len(packed), len(text)), packed, *sections]


def _layer_payload(layer: LayerState) -> list:
    bits = layer.meta.get("bits")
    code_bits = bits if isinstance(bits, int) and not isinstance(bits, bool) else None
    specs, sections = _tensor_records(layer.tensors.values(), code_bits)
    descriptor = {
        "kind": layer.kind,
        "meta": layer.meta,
        "tensors": [[name, spec] for name, spec in zip(layer.tensors, specs)],
    }
    return _payload(descriptor, sections, f"layer of kind {layer.kind!r}")


def _extras_payload(name: str, tensors: list[torch.Tensor]) -> list:
    specs, sections = _tensor_records(tensors, None)
    return _payload({"name": name, "tensors": specs}, sections, f"extras {name!r}")


# --- Decoding -------------------------------------------------------------------------------------


def decode(inp: BinaryIO, expected_fingerprint: str) -> CacheState:
    """Read one stream from `inp` chunk by chunk. Raises ModelMismatchError when it holds the KV of
    another model, and another CodecError subclass when it is truncated, corrupted or unreadable.
    Tensors come back on the CPU. Bytes after the end chunk are left unread."""
    header = _read_header(inp)
    if header["fingerprint"] != expected_fingerprint:
        raise ModelMismatchError(
            f"the KV stream was made by model {header['fingerprint']}, "
            f"expected {expected_fingerprint}"
        )
    with _parsing("the cache header"):
        num_layers = int(header["num_layers"])
        extras_counts = [(str(name), int(count)) for name, count in header["extras"]]
        budgets = header["budgets"]
        budgets = None if budgets is None else [int(b) for b in budgets]
        num_tokens, compressor = int(header["num_tokens"]), header["compressor"]
    layers = [_read_layer(inp, index) for index in range(num_layers)]
    extras = {}
    for offset, (name, count) in enumerate(extras_counts):
        extras[name] = _read_extras(inp, num_layers + offset, name, count)
    _read_end(inp, num_layers + len(extras_counts))
    return CacheState(num_tokens, layers, budgets, compressor, extras)


def decode_bytes(data: bytes, expected_fingerprint: str) -> CacheState:
    """`decode` of a whole stream held in memory; trailing bytes are an error."""
    reader = io.BytesIO(data)
    state = decode(reader, expected_fingerprint)
    if reader.tell() != len(data):
        raise FormatError(f"{len(data) - reader.tell()} unexpected bytes after the end chunk")
    return state


def decode_iter(pieces: Iterable[bytes], expected_fingerprint: str) -> CacheState:
    """`decode` of a stream arriving as byte strings of any sizes (e.g. network messages)."""
    return decode(_IterReader(pieces), expected_fingerprint)


class _IterReader:
    """`read(size)` over an iterable of byte strings: at most one piece's bytes a call."""

    def __init__(self, pieces: Iterable[bytes]):
        self._pieces = iter(pieces)
        self._pending = memoryview(b"")

    def read(self, size: int) -> bytes:
        while not self._pending:
            piece = next(self._pieces, None)
            if piece is None:
                return b""
            self._pending = memoryview(piece).cast("B")
        part, self._pending = self._pending[:size], self._pending[size:]
        return bytes(part)


@contextmanager
def _parsing(what: str):
    """Checksummed but inconsistent content (a writer bug or crafted input) -> FormatError."""
    try:
        yield
    except CodecError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError, struct.error) as exc:
        raise FormatError(f"malformed {what}: {type(exc).__name__}: {exc}") from exc


def _read_exact(inp: BinaryIO, size: int, what: str) -> bytes:
    parts, remaining = [], size
    while remaining:
        part = inp.read(remaining)
        if not part:
            raise TruncatedError(
                f"the KV stream ends inside {what} ({size - remaining} of {size} bytes)"
            )
        parts.append(part)
        remaining -= len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _check_crc(data, expected: bytes, what: str) -> None:
    if _crc(data) != expected:
        raise ChecksumError(f"checksum mismatch in {what}: the KV stream is corrupted")


def _read_header(inp: BinaryIO) -> dict:
    prelude = _read_exact(inp, _PRELUDE.size, "the prelude")
    magic, version, _, body_size = _PRELUDE.unpack(prelude)
    if magic != MAGIC:
        raise FormatError("not a VeriCache KV stream (bad magic bytes)")
    if version != FORMAT_VERSION:
        raise VersionError(
            f"KV stream format version {version}; this build reads version {FORMAT_VERSION}"
        )
    _check_crc(prelude, _read_exact(inp, 4, "the prelude checksum"), "the prelude")
    if body_size > MAX_HEADER_BYTES:
        raise FormatError(f"header of {body_size} bytes is larger than {MAX_HEADER_BYTES}")
    body = _read_exact(inp, body_size, "the header")
    _check_crc(body, _read_exact(inp, 4, "the header checksum"), "the header")
    with _parsing("the cache header"):
        header = json.loads(body)
        if not isinstance(header, dict) or not isinstance(header["fingerprint"], str):
            raise FormatError("the cache header is not a JSON object with a fingerprint")
    return header


def _read_chunk(inp: BinaryIO, index: int, tag: int) -> memoryview:
    what = f"chunk {index}"
    head = _read_exact(inp, _CHUNK.size, what)
    _check_crc(head, _read_exact(inp, 4, what), f"the head of {what}")
    found_tag, found_index, size, payload_crc = _CHUNK.unpack(head)
    if (found_tag, found_index) != (tag, index):
        raise FormatError(
            f"expected chunk {index} of kind {tag}, found {found_index} of {found_tag}"
        )
    payload = _read_exact(inp, size, what)
    if zlib.crc32(payload) != payload_crc:
        raise ChecksumError(f"checksum mismatch in {what}: the KV stream is corrupted")
    return memoryview(payload)


def _split_payload(payload: memoryview, what: str) -> tuple[dict, memoryview]:
    with _parsing(what):
        packed_size, text_size = _DESCRIPTOR.unpack(payload[: _DESCRIPTOR.size])
        if text_size > MAX_DESCRIPTOR_BYTES:
            raise FormatError(f"the descriptor of {what} is too large ({text_size} bytes)")
        end = _DESCRIPTOR.size + packed_size
        descriptor = json.loads(zstd_decompress(payload[_DESCRIPTOR.size : end], text_size))
        return descriptor, payload[end:]


def _read_tensors(specs: list[dict], sections: memoryview, what: str) -> list[torch.Tensor]:
    tensors, offset = [], 0
    with _parsing(what):
        for spec in specs:
            parts = []
            for size in spec["sizes"]:
                if size < 0 or offset + size > len(sections):
                    raise FormatError(f"sections of {what} overrun its payload")
                parts.append(sections[offset : offset + size])
                offset += size
            tensors.append(decode_tensor(spec, parts))
    if offset != len(sections):
        raise FormatError(f"{len(sections) - offset} unused bytes in {what}")
    return tensors


def _read_layer(inp: BinaryIO, index: int) -> LayerState:
    what = f"layer {index}"
    descriptor, sections = _split_payload(_read_chunk(inp, index, ChunkTag.LAYER), what)
    with _parsing(what):
        names = [str(name) for name, _ in descriptor["tensors"]]
        specs = [spec for _, spec in descriptor["tensors"]]
        kind, meta = str(descriptor["kind"]), dict(descriptor["meta"])
    tensors = _read_tensors(specs, sections, what)
    return LayerState(kind, meta, dict(zip(names, tensors)))


def _read_extras(inp: BinaryIO, index: int, name: str, count: int) -> list[torch.Tensor]:
    what = f"extras {name!r}"
    descriptor, sections = _split_payload(_read_chunk(inp, index, ChunkTag.EXTRAS), what)
    with _parsing(what):
        if descriptor["name"] != name or len(descriptor["tensors"]) != count:
            raise FormatError(f"{what} does not match the header")
    return _read_tensors(descriptor["tensors"], sections, what)


def _read_end(inp: BinaryIO, index: int) -> None:
    payload = _read_chunk(inp, index, ChunkTag.END)
    if len(payload) != _U32.size or _U32.unpack(payload)[0] != index:
        raise FormatError("the end chunk does not match the chunks read")
