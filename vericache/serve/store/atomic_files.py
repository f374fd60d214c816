"""Files written whole or not at all: a reader (or a restart) finds the old file or the new one."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def write_atomic(path: Path, write: Callable[[BinaryIO], object]) -> int:
    """Writes `path` through `write` into a temporary file, synced, then renamed over `path`;
    returns the bytes written."""
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}.{threading.get_ident()}")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
        size = f.tell()
    os.replace(tmp, path)
    return size
