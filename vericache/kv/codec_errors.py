"""Errors the KV codec raises on input it cannot trust. Decoding never returns a cache that differs
from the one encoded: every failure is one of these, with a one-line reason."""

from __future__ import annotations

from vericache.errors import VeriCacheError


class CodecError(VeriCacheError):
    """Base class: the bytes are not a complete, intact KV stream for this model."""


class FormatError(CodecError):
    """Not a VeriCache KV stream, or its structure is inconsistent (bad magic, trailing data)."""


class TruncatedError(CodecError):
    """The stream ended before its last chunk."""


class ChecksumError(CodecError):
    """A checksum does not match: the bytes were altered in storage or transit."""


class VersionError(CodecError):
    """The stream was written in a format version this build cannot read."""


class ModelMismatchError(CodecError):
    """The KV was computed by a different model (or config) than the one expected."""
