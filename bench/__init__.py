"""Benchmarks, run as `vericache bench NAME`; see vericache/cli/bench.py for the module contract."""

BENCHMARKS = {
    "acceptance": "vericache.bench.acceptance",
    "decode-speed": "vericache.bench.decode_speed",
}
