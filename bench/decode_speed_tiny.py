"""`vericache bench decode-speed --tiny`: the engine's host overhead per step, measured where it can
be, on a CPU: a random-weight Llama of the embedded model's kind (grouped-query attention, tied
embeddings) so small (2 layers, hidden 64, a 512-token vocabulary) that a step's kernels take
microseconds, so that a step's time is what the host spends around them: Python, dispatch,
allocations, synchronisations.

For a full-KV decode step, a draft step over StreamingLLM 4x (of a 30-step draft, one job whose
tokens stay on the device until its last step, as a worker drafts) and a 31-token verification,
at batch 1 and 8, over a 64-token context:
- host microseconds per step: the median of the forward loop's steps (engine/forward_loop.py:
  the runner's forward and the choice of tokens); and the engine's whole decode per token
  (`Engine.generate` in full mode, its sequences' bookkeeping and stop checks included);
- operators per step: the aten operators the torch profiler records in one step, and per layer
  (the 2-layer model's count less the 1-layer one's);
- synchronisations per step: the calls that make the host wait for the device's values (`item`,
  `tolist`, `cpu`, `numpy`, and a tensor read as a Python int, float or bool).
Beside them, `transformers` generate on the same model (its own decode loop, greedy, a cache of its
own), host microseconds per token. Summary: `tiny_host_us_per_full_step` (the engine's, batch 1),
`tiny_host_over_hf` (that over transformers' per token), `syncs_per_draft_step`.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from vericache.bench.common import compressor_from_label, environment
from vericache.engine.engine import Engine, EngineConfig
from vericache.engine.forward_loop import ForwardLoop, Job
from vericache.engine.request import DecodeMode, Request, SamplingParams

TINY = {
    "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
}  # fmt: skip
CONTEXT, VERIFIED, STEPS, BATCHES, ROUNDS = 64, 31, 60, (1, 8), 5
DRAFT_LEN = 30  # a worker's whole draft is one job of this many steps (forward_loop.py)
SYNCING = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


def tiny_model(path: Path, num_layers: int) -> Path:
    """A random-weight Llama of TINY's shapes, `num_layers` deep, saved at `path`."""
    import transformers

    config = transformers.LlamaConfig(**TINY, num_hidden_layers=num_layers)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


@contextlib.contextmanager
def counted_syncs():
    """Counts, by name, the tensor methods that wait for a tensor's values on the host."""
    counts: Counter[str] = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in SYNCING}

    def counting(name, original):
        def method(self, *args, **kwargs):
            counts[name] += 1
            return original(self, *args, **kwargs)

        return method

    for name, original in originals.items():
        setattr(torch.Tensor, name, counting(name, original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def _jobs(engine: Engine, kind: str, batch: int) -> list[Job]:
    """`batch` jobs of one kind of step over caches of a CONTEXT-token prompt."""
    prompt = tuple(range(3, 3 + CONTEXT))
    full = engine.prefix_kv(prompt)
    if kind == "draft":
        compressed = engine.compressed_prefix_kv(prompt, compressor_from_label("streamingllm-4x"))
        return [
            Job(compressed.clone(CONTEXT + STEPS + 8), [7], DRAFT_LEN, defers_choices=True)
            for _ in range(batch)
        ]
    fed = [7] * (VERIFIED if kind == "verify" else 1)
    capacity = CONTEXT + STEPS + VERIFIED
    return [
        Job(full.clone(capacity), list(fed), num_logits=len(fed), is_full_kv=True)
        for _ in range(batch)
    ]


def time_steps(engine: Engine, kind: str, batch: int) -> dict:
    """Host microseconds per step (median), synchronisations and operators per step."""
    loop = ForwardLoop(engine.runner)
    jobs = _jobs(engine, kind, batch)
    starts = [(job.cache.num_tokens, list(job.feed)) for job in jobs]

    def reset() -> None:  # each step from the same context, outside what is measured
        for job, (num_tokens, feed) in zip(jobs, starts):
            job.cache.truncate(num_tokens)
            job.restart(feed)

    def one_step() -> float:
        reset()
        return loop.step(jobs)

    one_step()  # warm-up: first-call allocations and dispatch caches
    durations = [one_step() for _ in range(STEPS)]
    reset()
    with counted_syncs() as syncs:
        loop.step(jobs)
    reset()
    with counted_syncs() as syncs_to_done:  # a draft's whole run, its last step included
        while not all(job.is_done for job in jobs):
            loop.step(jobs)
    reset()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        loop.step(jobs)
    operators = sum(1 for event in profile.events() if event.name.startswith("aten::"))
    quartiles = statistics.quantiles(durations, n=4)
    return {
        "host_us": 1e6 * statistics.median(durations),
        "host_us_quartiles": [1e6 * quartiles[0], 1e6 * quartiles[2]],
        "syncs": sum(syncs.values()),
        "syncs_by_call": dict(syncs),
        "syncs_to_done": sum(syncs_to_done.values()),
        "operators": operators,
    }


def engine_us_per_token(engine: Engine, batch: int) -> float:
    """The engine's whole full-mode decode: microseconds per token of one sequence (the
    decode's time over its tokens, its prefill left out), the median of the batch's."""
    params = SamplingParams(max_new_tokens=STEPS, ignore_eos=True)
    prompt = tuple(range(3, 3 + CONTEXT + 1))
    requests = [
        Request(prompt, CONTEXT, params, DecodeMode.FULL, request_id=str(i)) for i in range(batch)
    ]
    engine.generate(requests)  # warm-up
    outputs = engine.generate(requests)
    return statistics.median(1e6 / out.stats.tokens_per_s for out in outputs)


def hf_us_per_token(path: Path, batch: int) -> float:
    """transformers generate, greedy, on the same model: microseconds per decoded token, its
    prefill's time left out (a one-token generate's)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.arange(3, 3 + CONTEXT).repeat(batch, 1)

    def generate(num_tokens: int) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(
                ids, max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False,
                pad_token_id=0, attention_mask=torch.ones_like(ids),
            )  # fmt: skip
        return time.perf_counter() - start

    generate(4)  # warm-up
    decode_s = statistics.median(generate(STEPS) for _ in range(3))
    prefill_s = statistics.median(generate(1) for _ in range(3))
    return 1e6 * (decode_s - prefill_s) / (STEPS - 1)


def run_tiny(args) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        models = {n: tiny_model(Path(folder) / f"layers{n}", n) for n in (1, 2)}
        engines = {n: Engine.from_pretrained(str(path)) for n, path in models.items()}
        steps = {
            f"{kind}_batch{batch}": time_steps(engines[2], kind, batch)
            for kind in ("full", "draft", "verify")
            for batch in BATCHES
        }
        one_layer = time_steps(engines[1], "full", 1)["operators"]
        # Static forwards (model/static_forward.py), run eagerly here as on any CPU: what their
        # staging costs the host where no CUDA graph takes the steps off it.
        static = Engine.from_pretrained(str(models[2]), config=EngineConfig(static_shapes=True))
        static_steps = {
            f"{kind}_batch{batch}": time_steps(static, kind, batch)
            for kind in ("full", "draft", "verify")
            for batch in BATCHES
        }
        # Alternated, so that the machine's drift falls on both alike.
        static_over_dynamic = [
            time_steps(static, "full", 1)["host_us"] / time_steps(engines[2], "full", 1)["host_us"]
            for _ in range(ROUNDS)
        ]
        # Alternated, ROUNDS times: a shared machine's drift falls on both alike.
        engine_runs = {f"batch{b}": [] for b in BATCHES}
        hf_runs = {f"batch{b}": [] for b in BATCHES}
        for _ in range(ROUNDS):
            for b in BATCHES:
                engine_runs[f"batch{b}"].append(engine_us_per_token(engines[2], b))
                hf_runs[f"batch{b}"].append(hf_us_per_token(models[2], b))
    engine_us = {key: statistics.median(runs) for key, runs in engine_runs.items()}
    hf_us = {key: statistics.median(runs) for key, runs in hf_runs.items()}
    per_layer = steps["full_batch1"]["operators"] - one_layer
    return {
        "benchmark": "decode-speed-tiny",
        "summary": {
            "tiny_host_us_per_full_step": engine_us["batch1"],
            "tiny_host_over_hf": engine_us["batch1"] / hf_us["batch1"],
            "syncs_per_draft_step": steps["draft_batch1"]["syncs"],
            "syncs_per_draft": steps["draft_batch1"]["syncs_to_done"],
            "syncs_per_verification": steps["verify_batch1"]["syncs"],
            "operators_per_layer": per_layer,
            "operators_outside_layers": one_layer - per_layer,
            "tiny_static_over_dynamic_full_step": statistics.median(static_over_dynamic),
            "syncs_per_static_draft_step": static_steps["draft_batch1"]["syncs"],
        },
        "definitions": {
            "tiny_host_us_per_full_step": "the engine's full-mode decode, microseconds per token "
            "at batch 1, the median of 5 runs alternated with transformers' (target: at most "
            "0.5x transformers')",
            "tiny_host_over_hf": "that over transformers generate's per token (median of 5), "
            "same model",
            "syncs_per_draft_step": "host waits for a tensor's values in one draft step, not its "
            "last (target 0)",
            "syncs_per_draft": "host waits over a whole draft of DRAFT_LEN steps, batch 1: its "
            "tokens read once, after its last step",
            "tiny_static_over_dynamic_full_step": "a static forward's full step (eager, on CPU) "
            "over the dynamic forward's, host microseconds, batch 1: the median of 5 alternated "
            "pairs (all in `static_over_dynamic_full_step`)",
        },
        "config": {"model": TINY, "context_tokens": CONTEXT, "steps": STEPS},
        "environment": environment(),
        "steps": steps,
        "static_steps": static_steps,
        "static_over_dynamic_full_step": static_over_dynamic,
        "engine_us_per_token": engine_runs,
        "transformers_us_per_token": hf_runs,
    }
