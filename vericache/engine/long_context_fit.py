"""Whether a request can ever run within the long-context engine's device-memory budget.

The engine checks when a request is added, before any prefill, so that a request the budget or
the scheduler would refuse later is refused at once, alone, with the engine's message.
"""

from __future__ import annotations

from vericache.engine.device_memory import (
    DeviceMemory,
    compressed_kv_bound,
    compressed_prefill_bound,
    full_kv_bytes,
)
from vericache.engine.request import DecodeMode, Request
from vericache.errors import InvalidRequestError
from vericache.model.config import ModelConfig
from vericache.scheduler import BaseScheduler


def prefill_bytes(request: Request, config: ModelConfig, element_size: int) -> int:
    """Device memory a request's prefill holds besides the weights."""
    full_bytes = full_kv_bytes(request, config, element_size)
    if request.mode is DecodeMode.FULL:
        return full_bytes
    # VeriCache: the compressed KV is made while the full KV is still there.
    return full_bytes + compressed_prefill_bound(request, config, element_size)


def check_fits(
    request: Request,
    memory: DeviceMemory,
    scheduler: BaseScheduler,
    config: ModelConfig,
    element_size: int,
) -> None:
    """Raises InvalidRequestError where the request's prefill, or (VeriCache) its decoding or
    the load of its full KV, could never fit."""
    needed = prefill_bytes(request, config, element_size)
    if memory.weights_bytes + needed > memory.budget_bytes:
        raise InvalidRequestError(
            f"a request of {len(request.prompt_ids)} prompt tokens needs {needed} bytes of "
            f"device memory besides the weights to run; the budget of "
            f"{memory.budget_bytes} bytes leaves {memory.budget_bytes - memory.weights_bytes}"
        )
    if request.mode is not DecodeMode.VERICACHE:
        return
    full_bytes = full_kv_bytes(request, config, element_size)
    _check_decoding_fits(request, memory, full_bytes, config, element_size)
    if scheduler.costs.num_load_iterations(full_bytes) > scheduler.config.window - 1:
        raise InvalidRequestError(
            f"loading {full_bytes} bytes of full KV spans more iterations than the scheduler's "
            f"window of {scheduler.config.window}: raise the window or the bandwidth"
        )


def _check_decoding_fits(
    request: Request,
    memory: DeviceMemory,
    full_bytes: int,
    config: ModelConfig,
    element_size: int,
) -> None:
    """The scheduler's own check, run before the prefill with the compressed KV at its bound: a
    request it would refuse after the prefill is refused here."""
    resident = compressed_prefill_bound(request, config, element_size)
    bound = compressed_kv_bound(resident, request, config, element_size)
    needed = memory.weights_bytes + bound + full_bytes
    if needed > memory.budget_bytes:
        raise InvalidRequestError(
            f"a request of {len(request.prompt_ids)} prompt tokens needs up to {needed} bytes "
            f"of device memory with the weights to decode (its compressed KV grown by every "
            f"output token, and its full KV for a verification); the budget is "
            f"{memory.budget_bytes}"
        )
