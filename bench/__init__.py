"""Benchmarks, run as `vericache bench NAME`; see vericache/cli/bench.py for the module contract."""

BENCHMARKS = {
    "acceptance": "vericache.bench.acceptance",
    "codec": "vericache.bench.codec",
    "decode-speed": "vericache.bench.decode_speed",
    "lossy-quality": "vericache.bench.lossy_quality",
}
