"""Device memory of long-context decoding: what one request takes, and an accountant that enforces
the budget on what is really held.

The device holds the weights, the compressed KV of every resident request and the full KV of the
requests being loaded or verified (or, in the full-KV baseline, of every running request).
`DeviceMemory` adds up the bytes held, by owner, and raises `DeviceMemoryError` the moment the sum
would pass the budget: the scheduler plans within the budget, the accountant checks that what runs
stays within it. Sizes are those of the tensors a cache allocates: a full KV at the capacity its
buffers reserve (keys, values and int32 positions), a compressed KV at its `resident_bytes`.
Activations and the allocator's slack are not counted: leave room for them in the budget.
"""

from __future__ import annotations

import math
import os
from collections.abc import Hashable

import torch

from vericache.engine.request import Request
from vericache.errors import InvalidRequestError, VeriCacheError
from vericache.kv import slots
from vericache.model.config import ModelConfig


class DeviceMemoryError(VeriCacheError):
    """More device memory was taken than the budget allows (a planning bug, not a user error)."""


class DeviceMemory:
    def __init__(self, budget_bytes: int, weights_bytes: int):
        if not 0 <= weights_bytes < budget_bytes:
            raise InvalidRequestError(
                f"the device-memory budget of {budget_bytes} bytes does not even hold the "
                f"weights ({weights_bytes} bytes): raise the budget"
            )
        self.budget_bytes = budget_bytes
        self.weights_bytes = weights_bytes
        self.in_use_bytes = weights_bytes
        self.peak_bytes = weights_bytes  # high-water mark
        # Per kind of owner (the first item of a tuple owner, such as ("full", key)): bytes held
        # now, and their high-water mark.
        self.kind_bytes: dict[Hashable, int] = {}
        self.kind_peak_bytes: dict[Hashable, int] = {}
        self._held: dict[Hashable, int] = {}

    @property
    def free_bytes(self) -> int:
        return self.budget_bytes - self.in_use_bytes

    def fits(self, num_bytes: int) -> bool:
        return num_bytes <= self.free_bytes

    def held(self, owner: Hashable) -> int:
        return self._held.get(owner, 0)

    def hold(self, owner: Hashable, num_bytes: int) -> None:
        """Sets what `owner` holds (it may grow or shrink); raises if the budget would pass."""
        in_use = self.in_use_bytes - self.held(owner) + num_bytes
        if in_use > self.budget_bytes:
            raise DeviceMemoryError(
                f"{owner!r} would take {num_bytes} bytes: {in_use} in use, more than the "
                f"budget of {self.budget_bytes}"
            )
        self._add_to_kind(owner, num_bytes - self.held(owner))
        self._held[owner] = num_bytes
        self.in_use_bytes = in_use
        self.peak_bytes = max(self.peak_bytes, in_use)

    def release(self, owner: Hashable) -> None:
        num_bytes = self._held.pop(owner, 0)
        self._add_to_kind(owner, -num_bytes)
        self.in_use_bytes -= num_bytes

    def _add_to_kind(self, owner: Hashable, num_bytes: int) -> None:
        kind = owner[0] if isinstance(owner, tuple) else owner
        held = self.kind_bytes.get(kind, 0) + num_bytes
        self.kind_bytes[kind] = held
        self.kind_peak_bytes[kind] = max(self.kind_peak_bytes.get(kind, 0), held)


def slot_bytes(config: ModelConfig, element_size: int) -> int:
    """Bytes one token takes in a dense cache: keys, values and one int32 position per KV head."""
    return slots.slot_bytes(
        config.kv_bytes_per_token(element_size), config.num_layers, config.num_kv_heads
    )


def full_kv_capacity(request: Request, max_positions: int, shares_prefix: bool = True) -> int:
    """Slots a request's full KV reserves (`slots.full_kv_slots`); where it reads its prefix from
    a shared copy (kv/prefixed.py), it reserves its own slots exactly."""
    return slots.full_kv_slots(
        len(request.prompt_ids),
        request.params.max_new_tokens,
        request.draft_len,
        max_positions,
        request.num_prefix_tokens if shares_prefix else 0,
    )


def full_kv_bytes(request: Request, config: ModelConfig, element_size: int) -> int:
    return slots.reserved_full_kv_bytes(
        len(request.prompt_ids),
        request.params.max_new_tokens,
        request.draft_len,
        config.max_position_embeddings,
        slot_bytes(config, element_size),
    )


def compressed_element_size(request: Request, element_size: int) -> int:
    """Bytes per key or value element of a request's compressed KV: its compressor's storage
    dtype (a token-dropping compressor may keep 16-bit slots), else the model's `element_size`."""
    storage = getattr(request.compressor, "storage_dtype", None)
    return storage.itemsize if storage is not None else element_size


def compressed_token_bytes(config: ModelConfig, element_size: int) -> int:
    """The most one appended token adds to a compressed KV: its keys and values at full
    precision, its position and one float32 of online-compressor state per KV head (H2O's
    scores). Compressors evict or quantize; none grows faster."""
    return slot_bytes(config, element_size) + 4 * config.num_layers * config.num_kv_heads


def compressed_kv_bound(
    resident_bytes: int, request: Request, config: ModelConfig, element_size: int
) -> int:
    """The most a compressed KV holding `resident_bytes` after the prefill holds over the
    request's life, every output token appended (`element_size`: the model's)."""
    num_tokens = request.params.max_new_tokens + 1
    token_bytes = compressed_token_bytes(config, compressed_element_size(request, element_size))
    return resident_bytes + num_tokens * token_bytes


def compressed_prefill_bound(request: Request, config: ModelConfig, element_size: int) -> int:
    """The most the compressed KV made at a request's prefill takes: its prefix compressed, then
    the rest of the prompt appended. Token dropping keeps ceil(prefix / ratio) tokens summed over
    layers (PyramidKV moves budget between layers; rounding may add one); quantization is bounded
    by the prompt at full precision (`element_size`: the model's)."""
    num_tokens = len(request.prompt_ids)
    ratio = request.compressor.kept_token_ratio
    if ratio is not None:
        split = min(request.num_prefix_tokens, num_tokens - 1)
        num_tokens = math.ceil(split / ratio) + 1 + num_tokens - split
    return num_tokens * compressed_token_bytes(
        config, compressed_element_size(request, element_size)
    )


# A worker on CPU holds prefixes' KV in this share of the machine's RAM unless told otherwise: the
# rest stays for its weights, its sessions and whatever else runs there.
CPU_PREFIX_SHARE = 0.25
# On CUDA, the share of the memory free after the weights: the rest is the allocator's slack and
# the activations of a forward.
CUDA_FREE_SHARE = 0.9


def prefix_budget_left(device: torch.device | str, reserved_bytes: int = 0) -> int:
    """The bytes a worker may hold prefixes' KV in by default, asked once its weights are
    loaded: on CUDA a share of the device memory free less `reserved_bytes` (the other KV it
    keeps there); on CPU a share of the RAM."""
    device = torch.device(device)
    if device.type != "cuda":
        return int(device_memory_bytes(device) * CPU_PREFIX_SHARE)
    free, _ = torch.cuda.mem_get_info(device)
    left = int(free * CUDA_FREE_SHARE) - reserved_bytes
    if left < 1:
        raise InvalidRequestError(
            f"the GPU has no room for prefixes' KV after the weights and "
            f"{reserved_bytes / 2**30:.1f} GiB of other KV: set the prefix cache's size"
        )
    return left


def device_memory_bytes(device: torch.device | str) -> int:
    """The whole memory of a device: the default budget."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
