"""What the simulator knows of models and devices: small JSON files under profiles/.

A model profile is the architecture's shape (layers, heads, KV heads, head size, hidden size,
parameters), copied from the model's config.json; tests check that the parameter count follows
from the shapes. A device profile is memory, HBM bandwidth, dense bf16 compute, the host and
interconnect links, the efficiencies that turn peaks into sustained rates, and the overhead of a
forward. Until `vericache calibrate` has measured a device, its profile comes from the datasheet
times stated efficiencies, and its `source` says so; every result computed from it carries that
source.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, fields
from importlib import resources
from pathlib import Path

from vericache.errors import InvalidRequestError
from vericache.kv import slots

_PROFILES = "profiles"


@dataclass(frozen=True)
class ModelProfile:
    name: str
    source: str  # where the numbers come from
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_params: int
    max_positions: int  # the context: max_position_embeddings

    def __post_init__(self):
        _check_positive(self, ("num_layers", "hidden_size", "num_heads", "num_kv_heads"))
        _check_positive(self, ("head_dim", "vocab_size", "num_params", "intermediate_size"))
        _check_positive(self, ("max_positions",))
        if self.num_heads % self.num_kv_heads:
            raise InvalidRequestError(f"{self.name}: query heads are not a multiple of KV heads")

    def weights_bytes(self, element_size: int = 2) -> int:
        return self.num_params * element_size

    def params_per_layer(self) -> int:
        """One decoder layer's parameters: attention's projections, the MLP's, two norms."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h

    def kv_bytes_per_token(self, element_size: int = 2) -> int:
        """Full KV of one token: keys and values of every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size

    def slot_bytes(self, element_size: int = 2) -> int:
        """One token's slot in a dense cache, as the engine reserves it: its keys, values and
        positions."""
        return slots.slot_bytes(
            self.kv_bytes_per_token(element_size), self.num_layers, self.num_kv_heads
        )


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    source: str  # "datasheet ..." until calibrated, then "measured ..."
    memory_bytes: int
    hbm_bytes_per_s: float  # peak
    peak_flops: float  # dense bf16 (or the device's working dtype), peak
    host_to_device_bytes_per_s: float  # pinned host memory to the device
    interconnect_bytes_per_s: float  # one direction, between the devices of a tensor-parallel group
    bandwidth_efficiency: float  # sustained / peak HBM bandwidth
    compute_efficiency: float  # sustained / peak flops
    forward_overhead_s: float  # a forward's fixed cost (launch, scheduling, sampling)
    layer_overhead_s: float  # and per layer (kernel launches)
    allreduce_latency_s: float = 0.0  # one all-reduce's fixed cost
    # Attention's own sustained rates, where measured (None: the products' rates above)
    attention_bytes_per_s: float | None = None  # KV streamed by the attention kernel
    attention_flops: float | None = None
    # Per row of a batch and per layer: what the engine does for each sequence (its own
    # attention call, its cache's bookkeeping), which a large model's forward hides and a small
    # one's does not (the 135M engine on an H200: about 8 ms a row over its 30 layers).
    row_overhead_s: float = 0.0
    exact_row_overhead_s: float = 0.0  # what a row on the batch-invariant kernels adds, per layer
    # The products' measured seconds per weight byte at each row count, (rows, seconds / byte)
    # with rows rising from 1: a device's kernels do not follow the roofline between its two
    # ends (a CPU's products at 8 to 24 rows take 20-30% longer than max(bytes / bandwidth,
    # flops / peak)). Empty: the roofline.
    product_curve: tuple[tuple[int, float], ...] = ()
    # A forward's time while another worker's forwards run on the same machine, over its time
    # alone (vericache/calibration/co_runner.py): CPU workers of one machine share its memory
    # system; each GPU has its own (1). Measured by `vericache calibrate` on a CPU.
    co_runner_slowdown: float = 1.0

    def __post_init__(self):
        # JSON gives lists; a frozen record keeps tuples.
        object.__setattr__(self, "product_curve", tuple(map(tuple, self.product_curve)))
        _check_product_curve(self)
        _check_positive(self, ("memory_bytes", "hbm_bytes_per_s", "peak_flops"))
        _check_positive(self, ("host_to_device_bytes_per_s", "interconnect_bytes_per_s"))
        for name in ("bandwidth_efficiency", "compute_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise InvalidRequestError(f"{self.name}: {name} must lie in (0, 1]")
        overheads = (
            "forward_overhead_s", "layer_overhead_s", "row_overhead_s", "exact_row_overhead_s",
            "allreduce_latency_s",
        )  # fmt: skip
        for name in overheads:
            if getattr(self, name) < 0:
                raise InvalidRequestError(f"{self.name}: {name} must be >= 0")
        if not self.co_runner_slowdown >= 1:
            raise InvalidRequestError(f"{self.name}: co_runner_slowdown must be >= 1")
        for name in ("attention_bytes_per_s", "attention_flops"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise InvalidRequestError(f"{self.name}: {name} must be > 0 or absent")

    @property
    def bytes_per_s(self) -> float:
        """Sustained HBM bandwidth."""
        return self.hbm_bytes_per_s * self.bandwidth_efficiency

    @property
    def flops(self) -> float:
        """Sustained compute."""
        return self.peak_flops * self.compute_efficiency

    @property
    def attention_read_bytes_per_s(self) -> float:
        return self.attention_bytes_per_s or self.bytes_per_s

    @property
    def attention_flops_per_s(self) -> float:
        return self.attention_flops or self.flops

    def slowdown_beside(self, num_busy: float) -> float:
        """A forward's time beside `num_busy` busy workers on its memory system over alone: each
        adds the measured co-runner slowdown beyond 1 (vericache/calibration/co_runner.py measures
        one; more are taken to add alike, as they share one memory bus)."""
        return 1 + (self.co_runner_slowdown - 1) * max(0.0, num_busy)

    def slowdown_added(self, num_busy: float, num_starting: int) -> float:
        """A forward's time once `num_starting` more workers compute beside it on its memory
        system, over its time beside `num_busy`: what starting them costs it."""
        return self.slowdown_beside(num_busy + num_starting) / self.slowdown_beside(num_busy)

    @property
    def is_measured(self) -> bool:
        return self.source.startswith("measured")


def model_profile(name_or_path: str) -> ModelProfile:
    """A bundled model profile by name (e.g. "llama-3.1-70b"), or a JSON file."""
    return ModelProfile(**_read("models", name_or_path, ModelProfile))


def device_profile(name_or_path: str) -> DeviceProfile:
    """A bundled device profile by name (e.g. "h100-sxm"), or a JSON file (a calibration's)."""
    return DeviceProfile(**_read("devices", name_or_path, DeviceProfile))


# The datasheet profile of a CUDA device, by a marker in its name (most specific first).
_DATASHEETS = (("H200", "h200"), ("H100 NVL", "h100-nvl"), ("H100", "h100-sxm"))


def datasheet_for(device_name: str) -> DeviceProfile | None:
    """The bundled datasheet profile of a CUDA device named `device_name`, if there is one."""
    for marker, name in _DATASHEETS:
        if marker in device_name:
            return device_profile(name)
    return None


def bundled(kind: str) -> list[str]:
    """Names of the bundled profiles of a kind ("models" or "devices")."""
    folder = resources.files(__package__).joinpath(_PROFILES, kind)
    return sorted(entry.name.removesuffix(".json") for entry in folder.iterdir())


def _read(kind: str, name_or_path: str, record: type) -> dict:
    path = Path(name_or_path)
    if path.suffix == ".json":
        try:
            text = path.read_text()
        except OSError as exc:
            reason = exc.strerror
            raise InvalidRequestError(f"cannot read the profile {path.name}: {reason}") from None
    else:
        entry = resources.files(__package__).joinpath(_PROFILES, kind, f"{name_or_path}.json")
        if not entry.is_file():
            known = ", ".join(bundled(kind))
            raise InvalidRequestError(f"no {kind[:-1]} profile {name_or_path!r} (known: {known})")
        text = entry.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"the profile {name_or_path} is not JSON: {exc.msg}") from None
    if isinstance(data, dict) and isinstance(data.get("profile"), dict):
        data = data["profile"]  # a calibration's output: the profile beside its measurements
    if not isinstance(data, dict):
        raise InvalidRequestError(f"the profile {name_or_path} is not a JSON object")
    expected = {field.name for field in fields(record)}
    required = {field.name for field in fields(record) if field.default is MISSING}
    if set(data) - expected or required - set(data):
        unknown, missing = sorted(set(data) - expected), sorted(required - set(data))
        raise InvalidRequestError(
            f"the profile {name_or_path}: unknown fields {unknown}, missing fields {missing}"
        )
    return data


def _check_product_curve(profile: DeviceProfile) -> None:
    rows = [point[0] for point in profile.product_curve]
    valid = all(
        len(point) == 2 and isinstance(point[0], int) and point[1] > 0
        for point in profile.product_curve
    )
    if not valid or (rows and (rows[0] != 1 or rows != sorted(set(rows)))):
        raise InvalidRequestError(
            f"{profile.name}: product_curve must be (rows, seconds per byte > 0) pairs at rising "
            "row counts from 1"
        )


def _check_positive(profile, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(profile, name)
        if not isinstance(value, (int, float)) or not value > 0:
            raise InvalidRequestError(f"{profile.name}: {name} must be > 0, got {value!r}")
