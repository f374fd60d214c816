"""What drafters and verifiers share: how they load the model, and their sessions' grammars.

Workers are plain classes (`Verifier`, `Drafter`) that tests run in-process and Ray runs as actors.
Their state is per session: one session is one request's caches on that worker, opened by the
coordinator, fed by it round after round, and closed when the request ends or is cancelled. Their
forwards go through the engine's forward loop (serve/workers/batching.py); what crosses with each
call is in worker_api.py.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from vericache.engine.constraint import SessionGrammars
from vericache.engine.device_memory import slot_bytes
from vericache.errors import VeriCacheError
from vericache.kv.codec import model_fingerprint
from vericache.model.loader import LoadedModel, load_model
from vericache.model.runner import ModelRunner
from vericache.serve.config import WorkerConfig
from vericache.serve.workers.worker_api import ModelInfo, WorkerStartup
from vericache.sim.profiles import ModelProfile


class SessionNotFoundError(VeriCacheError):
    """A worker was asked about a session it does not hold (never opened, or closed)."""


class DraftFailedError(VeriCacheError):
    """The draft call a verification waited for failed. The coordinator reports the draft call's
    own error instead, which it gets from that call (a dead drafter is the drafter's to report,
    not the verifier's)."""


@dataclass(frozen=True)
class WorkerModel:
    """A worker's model, loaded, and how long its stages of the start took."""

    loaded: LoadedModel
    runner: ModelRunner
    info: ModelInfo
    started_at: float  # time.perf_counter() when the load began
    model_s: float
    kernels_s: float

    def startup(self) -> WorkerStartup:
        """The worker's start so far: call once the rest of it is ready."""
        rest_s = time.perf_counter() - self.started_at - self.model_s - self.kernels_s
        process = f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}"
        return WorkerStartup(self.model_s, self.kernels_s, rest_s, process)


def load_worker_model(config: WorkerConfig) -> WorkerModel:
    started_at = time.perf_counter()
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    loaded = load_model(config.model, dtype=config.dtype, device=device)
    model_s = time.perf_counter() - started_at
    runner = ModelRunner(loaded.config, loaded.weights, device)  # loads the CPU kernels
    kernels_s = time.perf_counter() - started_at - model_s
    info = ModelInfo(
        model=config.model,
        fingerprint=model_fingerprint(loaded.config, config.model),
        max_positions=loaded.config.max_position_embeddings,
        vocab_size=loaded.config.vocab_size,
        eos_token_ids=tuple(loaded.config.eos_token_ids),
        full_kv_bytes_per_token=slot_bytes(loaded.config, runner.dtype.itemsize),
        numerics=_numerics(runner.device, runner.dtype),
        shape=_shape(loaded, config.model, runner.weights.nbytes // runner.dtype.itemsize),
        weight_element_size=runner.dtype.itemsize,
        memory_system=_memory_system(runner.device),
    )
    return WorkerModel(loaded, runner, info, started_at, model_s, kernels_s)


def session_grammars(model: WorkerModel) -> SessionGrammars:
    """The grammar state of a worker's constrained sessions (engine/constraint.py)."""
    return SessionGrammars(
        model.loaded.tokenizer, model.runner.config.vocab_size, model.info.eos_token_ids
    )


def _shape(loaded: LoadedModel, name: str, num_params: int) -> ModelProfile:
    """The model as the cost model sees it (vericache/sim/profiles.py)."""
    config = loaded.config
    return ModelProfile(
        name=name, source="the served model's config", num_layers=config.num_layers,
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        vocab_size=config.vocab_size, num_params=num_params,
        max_positions=config.max_position_embeddings,
    )  # fmt: skip


def _memory_system(device: torch.device) -> str:
    """`ModelInfo.memory_system`: a GPU's UUID; a CPU worker's machine (its boot's id, which two
    containers of one host share, else its host name), digested: the coordinator only compares
    them."""
    if device.type == "cuda":
        identity = str(torch.cuda.get_device_properties(device).uuid)
    else:
        boot_id = Path("/proc/sys/kernel/random/boot_id")
        identity = boot_id.read_text().strip() if boot_id.exists() else socket.gethostname()
    return f"{device.type}:" + hashlib.sha256(identity.encode()).hexdigest()[:16]


def _numerics(device: torch.device, dtype: torch.dtype) -> str:
    """`ModelInfo.numerics`: the CPU kernels are built per vector width, which orders their sums;
    on CUDA, the device's model and compute capability."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        kind = f"cuda:{torch.cuda.get_device_name(device)}:sm{major}{minor}"
    else:
        kind = f"{device.type}:{torch.backends.cpu.get_cpu_capability()}"
    return f"{kind}:{str(dtype).removeprefix('torch.')}"
