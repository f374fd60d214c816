"""Benchmarks, run as `vericache bench NAME`; see vericache/cli/bench.py for the module contract."""

BENCHMARKS = {
    "adaptive": "vericache.bench.adaptive",
    "agent-turns": "vericache.bench.agent_turns",
    "batching": "vericache.bench.batching",
    "acceptance": "vericache.bench.acceptance",
    "codec": "vericache.bench.codec",
    "coupling": "vericache.bench.coupling",
    "decode-speed": "vericache.bench.decode_speed",
    "exact-attention": "vericache.bench.exact_attention",
    "long-context": "vericache.bench.long_context",
    "lossy-quality": "vericache.bench.lossy_quality",
    "tool-calls": "vericache.bench.tool_calls",
    "openai-load": "vericache.bench.openai_load",
    "paper-repro": "vericache.bench.paper_repro",
    "prefix-sharing": "vericache.bench.prefix_sharing",
    "remote-prefix": "vericache.bench.remote_prefix",
    "serve-stagger": "vericache.bench.serve_stagger",
    "sim-validate": "vericache.bench.sim_validate",
    "soak": "vericache.bench.soak",
    "stagger": "vericache.bench.stagger",
}
