"""The one table of compressors every suite draws from: each registered compressor at an easy and a
hard setting, sized for the tiny test models (tests/conftest.py). test_conformance.py holds it to
every name in the registry; suites that cannot afford the whole table pick rows from it.

Add a compressor to the registry and its two rows here, and every suite that runs the table
checks it like the others. Compositions (a dropper, then a quantizer) have rows of their own.
"""

from __future__ import annotations

from vericache.compress import (
    H2O,
    KIVI,
    TOVA,
    Composed,
    Compressor,
    KVQuant,
    KVzip,
    PyramidKV,
    SnapKV,
    StreamingLLM,
)

# Easy, then hard, for each compressor.
TABLE: list[Compressor] = [
    StreamingLLM(ratio=2), StreamingLLM(ratio=8, num_sinks=1, sliding=True),
    SnapKV(ratio=2), SnapKV(ratio=8, window=4, kernel_size=1, pooling="avg"),
    PyramidKV(ratio=2), PyramidKV(ratio=8, beta=4),
    H2O(ratio=2), H2O(ratio=8, recent_fraction=0.1),
    KVzip(ratio=2), KVzip(ratio=8, chunk_size=64),
    TOVA(ratio=2), TOVA(ratio=8),
    KIVI(bits=8, group_size=16, residual_length=32), KIVI(bits=2, group_size=32, residual_length=0),
    KVQuant(bits=4, group_size=16, residual_length=32), KVQuant(bits=2, outlier_fraction=0.05),
    # Compositions (compress/composed.py): a dropper's kept tokens, quantized.
    Composed(SnapKV(ratio=2), KIVI(bits=8, group_size=16, residual_length=32)),
    Composed(
        KVzip(ratio=4, chunk_size=64),
        KVQuant(bits=2, group_size=16, residual_length=0, outlier_fraction=0.05),
    ),
]  # fmt: skip


def row_id(compressor: Compressor) -> str:
    """The row's label and whether it is the compressor's easy or hard setting."""
    index = next(i for i, row in enumerate(TABLE) if row is compressor)
    return f"{compressor.label}-{'hard' if index % 2 else 'easy'}"


def pick(*names: str) -> list[Compressor]:
    """Both rows of each named compressor, in table order."""
    unknown = set(names) - {row.name for row in TABLE}
    if unknown:
        raise KeyError(f"no rows for {sorted(unknown)} in the compressor table")
    return [row for row in TABLE if row.name in names]


def api_arguments(compressor: Compressor) -> dict:
    """The row as the client SDK names it (`put_prefix(compressor=..., ratio=..., ...)`); the
    server builds it with the compressor's defaults for the rest."""
    params = compressor.spec()["params"]
    return {
        "compressor": compressor.name,
        **{key: params[key] for key in ("ratio", "bits", "dtype") if params.get(key) is not None},
    }
