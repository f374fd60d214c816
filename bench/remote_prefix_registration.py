"""Registering a remote-prefix run's prefixes (bench/remote_prefix.py): each timed stage by stage,
and the bytes its full KV puts on the link."""

from __future__ import annotations

import time

from vericache.bench.common import compressor_from_label
from vericache.bench.workloads import CONTEXT_PROMPTS
from vericache.client import Client


def register_prefixes(client: Client, contexts, label: str) -> list[dict]:
    """Registers every prefix, timing each stage; one FULL_REMOTE request each (one output
    token) measures the bytes its full KV puts on the link."""
    params = compressor_from_label(label).spec()["params"]
    prefixes = []
    for context in contexts:
        stages, last = {}, time.perf_counter()

        def on_progress(progress, stages=stages):
            nonlocal last
            now = time.perf_counter()
            stages[progress.stage] = now - last
            last = now

        prefix_id = client.put_prefix(
            text=context.text, compressor=label.split("-", 1)[0], ratio=params.get("ratio"),
            bits=params.get("bits"), dtype=params.get("dtype"), on_progress=on_progress,
        )  # fmt: skip
        info = client.get_prefix(prefix_id)
        fetch = client.generate(
            CONTEXT_PROMPTS[0], prefix_id=prefix_id, mode="full_remote", max_tokens=1
        )
        prefixes.append(
            {
                "name": context.name,
                "prefix_id": prefix_id,
                "text": context.text,
                "num_tokens": info.num_tokens,
                "full_kv_bytes": info.full_kv_bytes,
                "compressed_wire_bytes": info.compressed_kv_bytes,
                "full_wire_bytes": fetch.stats["link_bytes"],
                "stage_s": stages,
            }
        )
        print(f"[remote-prefix] registered {context.name}: {info.num_tokens} tokens")
    return prefixes
