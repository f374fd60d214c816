"""How long workers take to come back after they die, and so how long a request whose worker died
waits for one.

A killed Ray actor restarts: a new process, its imports, the model, the kernels (loaded, never built
again: vericache/kernels/cpu_build.py) and the worker's store. `Restarts` times each restart from
the moment a call or probe found the worker gone to its first answer from a new process
(`vericache:worker_restart_seconds{kind}`), and logs it with the stages that process reports
(`WorkerStartup`); a worker that answers again from the same process was only slow, and is logged as
back. A migrating request waits `CoordinatorConfig.worker_wait_s`, or RESTART_MARGIN times the
longest start a worker reported, whichever is longer: a model that takes minutes to load still comes
back within the wait, while a node away for long does not lengthen every later wait.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from vericache.serve.backends.metrics import ServeMetrics
from vericache.serve.workers.worker_api import WorkerStartup

log = logging.getLogger(__name__)

# A restart under load took 5.9 s from the kill against 3.1 s of the worker's own start (the rest:
# Ray noticing the death, starting the process, its imports): three times leaves room beyond that.
RESTART_MARGIN = 3.0


@dataclass
class Restarts:
    configured_wait_s: float
    metrics: ServeMetrics | None = None  # None: restarts are logged, not recorded
    longest_start_s: float = 0.0  # the longest start a worker reported, first or after a restart
    _gone_since: dict[str, float] = field(default_factory=dict)  # worker name -> when found gone
    _processes: dict[str, str] = field(default_factory=dict)  # worker name -> its process

    def started(self, name: str, startup: WorkerStartup) -> None:
        """A worker's first start."""
        self._processes[name] = startup.process
        self.longest_start_s = max(self.longest_start_s, startup.total_s)

    def gone(self, name: str) -> None:
        self._gone_since.setdefault(name, time.monotonic())

    def back(self, name: str, kind: str, startup: WorkerStartup) -> None:
        """The worker answers again; `startup` is its process's own account."""
        since = self._gone_since.pop(name, None)
        if since is None:
            return
        seconds = time.monotonic() - since
        if self._processes.get(name) == startup.process:
            log.info("worker %s answers again (the same process) after %.1f s", name, seconds)
            return
        self.started(name, startup)
        if self.metrics is not None:
            self.metrics.worker_restarted(kind, seconds)
        log.info(
            "worker %s is back %.1f s after it was found gone (model %.1f s, kernels %.1f s, "
            "rest %.1f s, the remainder its process's start)", name, seconds, startup.model_s,
            startup.kernels_s, startup.rest_s,
            extra={"worker": name, "kind": kind, "restart_s": round(seconds, 3)},
        )  # fmt: skip

    def wait_s(self) -> float:
        """How long a migrating request waits for a worker of the kind it needs."""
        return max(self.configured_wait_s, RESTART_MARGIN * self.longest_start_s)
