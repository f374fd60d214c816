"""Shared pieces of the benchmarks: compressor labels, environment records, plotting setup."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import time

import torch

# The benchmarks' argument types.
from vericache.cli.parser import int_list, str_list, token_range  # noqa: F401
from vericache.compress import COMPRESSORS, CompressionKind, Compressor, build_compressor
from vericache.compress.base import STORAGE_DTYPES
from vericache.compress.composed import SEPARATOR, Composed
from vericache.errors import InvalidRequestError

_LABEL = re.compile(
    r"^(?P<name>[a-z0-9_]+)-(?P<value>[0-9.]+)(?P<unit>x|bit)(-(?P<storage>[a-z0-9]+))?$"
)
_STORAGE = {short: name for name, (short, _) in STORAGE_DTYPES.items()}


def compressor_from_label(label: str) -> Compressor:
    """`streamingllm-4x` -> StreamingLLM(ratio=4); `snapkv-4x-bf16` -> SnapKV(ratio=4,
    dtype="bfloat16"); `kivi-2bit` -> KIVI(bits=2); `snapkv-4x+kivi-4bit` -> their composition."""
    if SEPARATOR in label:
        dropper, quantizer, *more = label.split(SEPARATOR)
        if more:
            raise InvalidRequestError(f"compressor label {label!r} composes more than two")
        return Composed(compressor_from_label(dropper), compressor_from_label(quantizer))
    match = _LABEL.match(label)
    if match is None or (match["storage"] and match["storage"] not in _STORAGE):
        raise InvalidRequestError(
            f"compressor label {label!r} is not NAME-Nx, NAME-Nx-bf16, NAME-Nx-fp16 or NAME-Nbit"
        )
    dtype = _STORAGE.get(match["storage"])
    if match["unit"] == "x":
        return build_compressor(match["name"], ratio=float(match["value"]), dtype=dtype)
    return build_compressor(match["name"], bits=int(match["value"]), dtype=dtype)


# Strengths compared across methods: ratio for token dropping, bits for quantization (16-bit KV
# at 8/4/2 bits is 2x/4x/8x smaller).
STRENGTHS = ((2, 8), (4, 4), (8, 2))


def compressor_labels(spec: str) -> list[str]:
    """`all`: every registered compressor at 2x/4x/8x (8/4/2 bits); `all-4x`: at 4x (4 bits);
    otherwise a comma-separated list of labels."""
    if spec not in ("all", "all-4x"):
        return [label for label in spec.split(",") if label]
    strengths = STRENGTHS if spec == "all" else STRENGTHS[1:2]
    labels = []
    for name, cls in COMPRESSORS.items():
        quantized = cls.kind is CompressionKind.QUANTIZATION
        labels += [
            f"{name}-{bits}bit" if quantized else f"{name}-{ratio}x" for ratio, bits in strengths
        ]
    return labels


def environment() -> dict:
    """What a reader needs to compare numbers across runs."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git_commit": commit,
        "python": platform.python_version(),
        "torch": torch.__version__,
        # The ratios depend on the CPU's balance of compute and memory bandwidth, not only on
        # its architecture: the model name tells two x86_64 machines apart.
        "cpu": _cpu_model() or platform.processor() or platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def _cpu_model() -> str | None:
    """The CPU's model name, family and model numbers as Linux reports them (None elsewhere): a
    virtual machine may name only the vendor's line ("AMD EPYC")."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return None
    if "model name" not in fields:
        return None
    family, model = fields.get("cpu family"), fields.get("model")
    return f"{fields['model name']} (family {family}, model {model})"


def pyplot():
    """matplotlib's pyplot on a file-only backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure, path, title: str | None = None) -> None:
    """Writes a benchmark's figure as PNG (with `title` above its panels) and frees it."""
    plt = pyplot()
    if title:
        figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def progress(iterable=None, description: str = "", total: int | None = None, unit: str = "it"):
    """A progress bar on stderr for a person waiting at a terminal (silent when stderr is not
    one, e.g. in CI logs); used as tqdm: iterate it, or `update(n)` and `close()` it."""
    from tqdm import tqdm

    return tqdm(
        iterable,
        desc=description,
        total=total,
        unit=unit,
        file=sys.stderr,
        disable=not sys.stderr.isatty(),
        leave=False,
    )
