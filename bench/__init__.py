"""Benchmarks, run as `vericache bench NAME`; see vericache/cli/bench.py for the module contract."""

BENCHMARKS = {
    "batching": "vericache.bench.batching",
    "acceptance": "vericache.bench.acceptance",
    "codec": "vericache.bench.codec",
    "decode-speed": "vericache.bench.decode_speed",
    "lossy-quality": "vericache.bench.lossy_quality",
    "remote-prefix": "vericache.bench.remote_prefix",
}
