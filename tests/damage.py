"""Ways a stored file gets damaged, for the integrity tests."""

from __future__ import annotations

from pathlib import Path


def flip_bytes(path: Path, num_bytes: int = 64) -> None:
    """Inverts `num_bytes` three quarters into a file: past any header, inside the data."""
    data = bytearray(path.read_bytes())
    middle = len(data) * 3 // 4
    for index in range(middle, min(middle + num_bytes, len(data))):
        data[index] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGES = {"flipped": flip_bytes, "truncated": truncate, "removed": Path.unlink}
