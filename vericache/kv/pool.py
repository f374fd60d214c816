"""Buffers of released caches, handed out again to the next caches of the same shape.

A worker opens a session per request and closes it when the request ends: about 140 MB of full KV
for a 3k-token session of the embedded model. On CPU, torch allocates with malloc, which returns
blocks this large to the operating system when they are freed (and gives each thread its own
arena), so every page of the next session's buffers faulted in again: a quarter of a second of a
2.5k-token prefix load, ten times the copy itself. A `BufferPool` keeps released buffers (up to
`max_bytes`) and hands them to the next cache of the same shape, dtype and device; on CUDA,
torch's caching allocator already does this. Buffers come back uninitialised, as fresh ones are.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import torch

BufferKey = tuple[tuple[int, ...], torch.dtype, torch.device]


class BufferPool:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._free: dict[BufferKey, list[torch.Tensor]] = defaultdict(list)
        self._bytes = 0
        self._lock = threading.Lock()  # workers open and close sessions on many threads
        self.num_reused = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers waiting to be reused."""
        return self._bytes

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        """A buffer of this shape: a released one when there is one, else a new one."""
        key = (tuple(shape), dtype, torch.device(device))
        with self._lock:
            free = self._free.get(key)
            if free:
                buffer = free.pop()
                self._bytes -= buffer.nbytes
                self.num_reused += 1
                return buffer
        return torch.empty(shape, dtype=dtype, device=device)

    def release(self, buffer: torch.Tensor) -> None:
        """Takes back a buffer nothing reads or writes any more; beyond `max_bytes`, drops it."""
        key = (tuple(buffer.shape), buffer.dtype, buffer.device)
        with self._lock:
            if self._bytes + buffer.nbytes > self.max_bytes:
                return
            self._free[key].append(buffer)
            self._bytes += buffer.nbytes
