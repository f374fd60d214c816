"""Full KV in host memory, and its asynchronous loads onto the device (the paper's Pipeline 1).

`HostKV` is one request's full KV in host memory: pinned on CUDA, so that copies run at full PCIe
speed off the compute stream. `KVLoader.start` begins loading one request's full KV and returns a
`PendingLoad` at once; `PendingLoad.wait` blocks until the KV is on the device (LMCache's visible
blocking: `get_non_blocking` then wait). Loads run one at a time, in the order they start, on one
background thread, as they would share one link: on CUDA the thread copies on its own stream, so
the copy overlaps the draft forwards on the compute stream; with a bandwidth limit, it paces the
copy to that rate (`ThrottledLink`), a slower link than PCIe.

On CPU the device is host memory: a load hands over the host buffers themselves (`HostKV.view`)
once the emulated link (`ThrottledLink`, standing for PCIe) has carried their bytes. A copy there
would stand for nothing a GPU pays for (its copy engine moves the bytes, not its compute units),
yet it would take the cores' time and memory bandwidth from the draft forwards: about 140 ms of
CPU per load of a 7k-token full KV on the embedded model. `move_compressed` moves a compressed KV
between devices.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from vericache.engine.link import LinkSpec, ThrottledLink
from vericache.errors import CacheStateError
from vericache.kv.cache import DenseLayerKV, KVCache
from vericache.kv.compressed import CompressedKV, layer_from_state
from vericache.kv.exact import ExactKV
from vericache.kv.outlier_quantized import OutlierQuantizedLayerKV
from vericache.kv.state import LayerState


class HostKV:
    """One request's full KV in host memory. Per layer, keys and values head-major
    [Hkv, capacity, D], as `DenseLayerKV` stores them (a full cache holds token i in slot i)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], num_tokens: int):
        self.keys = keys
        self.values = values
        self.num_tokens = num_tokens
        self._positions: list[torch.Tensor] | None = None  # per layer [capacity, Hkv], for views

    @classmethod
    def from_cache(cls, cache: KVCache, capacity: int, pin: bool = False) -> HostKV:
        """A host copy of a full cache, with room for `capacity` tokens (pinned if `pin`)."""
        if not cache.is_full:
            raise CacheStateError("only a full (uncompressed) cache has a host copy")
        keys, values = [], []
        # Pinned buffers are only copied from; unpinned ones are also viewed (CPU loads), whose
        # attention reads the padding past the last token: it must hold finite values.
        new = torch.empty if pin else torch.zeros
        for layer in cache.layers:
            layer_keys, _ = layer.keys_values()  # [T, H, D]
            shape = (layer_keys.shape[1], capacity, layer_keys.shape[2])
            keys.append(new(shape, dtype=layer_keys.dtype, pin_memory=pin))
            values.append(new(shape, dtype=layer_keys.dtype, pin_memory=pin))
        host = cls(keys, values, 0)
        host.append(ExactKV.of(cache, 0, cache.num_tokens, copy=False))
        return host

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of the tokens held (what a load moves)."""
        per_token = sum(k[:, 0].nbytes + v[:, 0].nbytes for k, v in zip(self.keys, self.values))
        return self.num_tokens * per_token

    def append(self, exact: ExactKV) -> None:
        """Takes the exact KV of the tokens right after the ones held (from any device), through
        the one append of committed tokens (`KVCache.append_exact`) into these buffers."""
        start, end = exact.start, exact.end
        if start != self.num_tokens or end > self.capacity:
            raise CacheStateError(
                f"host KV holds {self.num_tokens} of {self.capacity} tokens: cannot take tokens "
                f"[{start}, {end})"
            )
        if exact.keys and exact.keys[0].data_ptr() == self.keys[0][:, start].data_ptr():
            self.num_tokens = end  # a view of these buffers (`view`): its tokens are here already
            return
        self._over(start).append_exact(exact)
        self.num_tokens = end

    def view(self, num_tokens: int) -> KVCache:
        """The first num_tokens tokens as a full cache over these host buffers, without a copy:
        tokens it appends are written here (and `append` of them then copies nothing). The
        buffers must hold finite values throughout, as `from_cache`'s zero-filled ones do."""
        if self.keys[0].is_pinned():
            raise CacheStateError("pinned host KV is copied to the device, not viewed")
        return self._over(num_tokens)

    def _over(self, num_tokens: int) -> KVCache:
        """A full cache over these buffers holding their first num_tokens tokens."""
        if self._positions is None:
            num_kv_heads, capacity, _ = self.keys[0].shape
            slots = torch.arange(capacity, dtype=torch.int32).unsqueeze(1)
            self._positions = [slots.repeat(1, num_kv_heads) for _ in self.keys]
        layers = [
            DenseLayerKV.over(keys, values, positions, num_tokens)
            for keys, values, positions in zip(self.keys, self.values, self._positions)
        ]
        return KVCache(layers, num_tokens)


@dataclass
class LoadedKV:
    cache: KVCache  # the full KV on the device
    num_bytes: int  # bytes moved
    load_s: float  # from the copy's start to its end (the link's time)
    stall_s: float  # time `wait` blocked: the load was late
    was_ready: bool  # the load had completed before `wait` was called


class PendingLoad:
    def __init__(self, future: Future, num_bytes: int):
        self._future = future
        self.num_bytes = num_bytes

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> LoadedKV:
        """Blocks until the full KV is on the device."""
        was_ready = self._future.done()
        start = time.perf_counter()
        cache, load_s = self._future.result()
        stall_s = 0.0 if was_ready else time.perf_counter() - start
        return LoadedKV(cache, self.num_bytes, load_s, stall_s, was_ready)


class KVLoader:
    """Loads host KV onto `device` in the background, one load at a time, at most
    `bytes_per_s` (None: as fast as the copy goes)."""

    def __init__(self, device: torch.device | str, bytes_per_s: float | None = None):
        self.device = torch.device(device)
        self.link = ThrottledLink(LinkSpec(bytes_per_s))
        self._is_cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._is_cuda else None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vericache-kv-load")

    def start(self, host: HostKV) -> PendingLoad:
        """Starts loading the tokens `host` holds now; returns at once."""
        num_tokens, num_bytes = host.num_tokens, host.nbytes
        if not self._is_cuda:
            future = self._executor.submit(self._hand_over, host, num_tokens, num_bytes)
            return PendingLoad(future, num_bytes)
        # Allocated on the compute stream, which frees them after the verification; the copy
        # stream waits for the allocation.
        layers = self._new_layers(host)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        future = self._executor.submit(self._copy, host, num_tokens, layers)
        return PendingLoad(future, num_bytes)

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def _new_layers(self, host: HostKV) -> list[DenseLayerKV]:
        # Left uninitialised: attention reads whole key blocks past the last token, and
        # DenseLayerKV zeroes that padding when it is first read (0 * NaN would be NaN).
        return [
            DenseLayerKV(k.shape[0], k.shape[2], k.dtype, self.device, host.capacity)
            for k in host.keys
        ]

    def _hand_over(self, host: HostKV, num_tokens: int, num_bytes: int) -> tuple[KVCache, float]:
        """A CPU load: the host buffers, once the link has carried their bytes."""
        start = time.perf_counter()
        self.link.send_blocking(num_bytes)
        return host.view(num_tokens), time.perf_counter() - start

    def _copy(self, host: HostKV, num_tokens: int, layers) -> tuple[KVCache, float]:
        """A CUDA load: copies on the loader's stream into `layers`, paced to the link."""
        start = time.perf_counter()
        with torch.cuda.stream(self._stream):
            positions = torch.arange(num_tokens, dtype=torch.int32, device=self.device)
            for layer, keys, values in zip(layers, host.keys, host.values):
                keys, values = keys[:, :num_tokens], values[:, :num_tokens]  # [H, T, D]
                num_bytes = keys.nbytes + values.nbytes
                # Book the wire first, so that the copy overlaps the time it stands for.
                arrival = time.perf_counter() + self.link.schedule(num_bytes, first=False)
                layer.append(keys.transpose(0, 1), values.transpose(0, 1), positions)
                time.sleep(max(0.0, arrival - time.perf_counter()))
            self._stream.synchronize()
        return KVCache(layers, num_tokens), time.perf_counter() - start


def move_compressed(cache: CompressedKV, device: torch.device | str, rope=None) -> CompressedKV:
    """The same compressed KV on another device (through its state: every layer kind moves).
    `rope` (the target device's RotaryEmbedding) serves layers that store keys before RoPE."""
    layers = []
    for state in cache.to_state().layers:
        tensors = {name: t.to(device) for name, t in state.tensors.items()}
        layer = layer_from_state(LayerState(state.kind, dict(state.meta), tensors))
        if isinstance(layer, OutlierQuantizedLayerKV):
            layer.attach_rope(rope)
        layers.append(layer)
    extras = {name: [t.to(device) for t in ts] for name, ts in cache.extras.items()}
    budgets = None if cache.budgets is None else list(cache.budgets)
    return CompressedKV(layers, cache.num_tokens, cache.compressor, budgets, extras)
