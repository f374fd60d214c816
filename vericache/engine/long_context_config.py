"""Configuration and statistics of long-context decoding (see long_context.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vericache.errors import InvalidRequestError
from vericache.scheduler import SchedulerConfig


@dataclass(frozen=True)
class LongContextConfig:
    # Device memory for the weights, resident compressed KV and loaded full KV; None: the whole
    # device (on CPU, the machine's memory).
    memory_budget_bytes: int | None = None
    # Host -> device bandwidth the loads are held to, bytes/s; None: as fast as the copy goes. It
    # emulates PCIe on CPU (a slower link on CUDA), and is the scheduler's first estimate.
    link_bytes_per_s: float | None = None
    # First estimate of one iteration's time, refined online; None: timed at start-up.
    iteration_s: float | None = None
    scheduler: SchedulerConfig = SchedulerConfig()
    # Set: the lock-step baseline, every running request drafts this many tokens and then all of
    # them verify together (the comparison of `vericache bench stagger`); None: staggered.
    lockstep_draft_len: int | None = None
    # Prefilled requests awaiting their first admission, compressed KV parked in host memory.
    max_parked: int = 1

    def __post_init__(self):
        for name in ("memory_budget_bytes", "link_bytes_per_s", "iteration_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise InvalidRequestError(f"{name} must be > 0, got {value}")
        if self.lockstep_draft_len is not None and self.lockstep_draft_len < 1:
            raise InvalidRequestError(
                f"lockstep_draft_len must be >= 1, got {self.lockstep_draft_len}"
            )
        if self.max_parked < 1:
            raise InvalidRequestError(f"max_parked must be >= 1, got {self.max_parked}")


@dataclass
class LongContextStats:
    num_iterations: int = 0
    num_loads: int = 0
    load_bytes: int = 0
    num_late_loads: int = 0  # loads not complete when their verification came
    stall_s: float = 0.0  # time verifications waited for late loads
    prefill_s: float = 0.0
    decode_s: float = 0.0  # iterations: forwards, and waits for late loads
    num_finished: int = 0  # requests
    num_output_tokens: int = 0
    max_running: int = 0  # most requests decoding at once (their KV on the device)
    peak_device_bytes: int = 0  # the accountant's high-water mark
    peak_full_kv_bytes: int = 0  # high-water mark of the full KV on the device
    peak_compressed_kv_bytes: int = 0  # ... and of the compressed KV (drafts' room included)

    @property
    def elapsed_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tokens_per_s(self) -> float:
        """Output tokens over the whole run, prefills included."""
        return self.num_output_tokens / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Output tokens after each request's first (which its prefill yields) over the time
        spent in iterations."""
        num_decoded = self.num_output_tokens - self.num_finished
        return num_decoded / self.decode_s if self.decode_s else 0.0

    def as_dict(self) -> dict:
        rates = {"tokens_per_s": self.tokens_per_s, "decode_tokens_per_s": self.decode_tokens_per_s}
        return dataclasses.asdict(self) | rates
