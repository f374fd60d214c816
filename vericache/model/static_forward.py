"""Static shapes: decode, draft and verification forwards over preallocated buffers, in buckets.

At batch 1 a GPU step of a small model is bound by its host: Python, kernel launches,
allocations (bench/results/decode_speed_cuda.json: 51 ms a step of the embedded model's
architecture on an H200, whose kernels need a fraction of a millisecond). vLLM and SGLang capture
their decode steps in CUDA graphs; this does the same for every forward whose sequences feed alike:
- it serves forwards that want every new token's logits: decode and draft steps (one token),
  verifications (1 + drafts); prefills go dynamic;
- a forward's sequences fall into groups by new tokens, rounded up to a bucket (BUCKETS), and
  attention (exact, or fast); a verification of 5 tokens feeds 3 padding tokens after its own,
  whose KV lands past its slots and whose rows no real row sees (causal) nor is read;
- each group's sequence count is rounded up to a bucket too; the padding sequences feed token 0
  over a scratch cache and their rows are never read;
- a `StepShape` (the groups' buckets) has its own buffers: token ids, positions and, on CUDA, a
  table per layer of each sequence's cache buffers (addresses, capacity, first new slot), so that
  one graph serves whichever caches a step holds, as vLLM's block tables do;
- on CUDA the shape's forward is captured once in a CUDA graph and replayed: a step costs one
  copy of its inputs to the device and one launch. A new graph's first replay is checked on one
  sequence of each exact group against the dynamic forward, bit for bit; a capture that fails or
  differs undoes its step and turns static forwards off (lossless first, fast second). The
  attention and the KV store read the tables (kernels/triton_kv_table.py). Captured rather than
  `torch.compile(mode="reduce-overhead")`: the forward's kernels are already the
  batch-invariant set, which a compiler's fusions would change, and a graph keeps their bits
  (the identity tests run with graphs on and off);
- on CPU the same forward runs eagerly over the same buffers, its attention and store by
  sequence_attention.py (the CPU kernels, which take each cache's slots as they are).
Caches of full-precision slots (full KV, a dropper's kept slots, over a shared prefix or not) and
KIVI's packed ones take static steps. A forward that fits no shape (prefill, online compressors
that observe, KVQuant's outliers, sliding windows, a cache with no room left) runs the runner's
dynamic forward.

Exactness: every kernel of the batch-invariant set computes a row apart from the rows beside it,
so an exact row (a verification's, a full decode step's) has in a static forward, padding and
all, the bits it has in the dynamic forward: VeriCache's output is full decoding's either way
(tests/test_static_forward.py checks it on CPU, tests/test_cuda_graphs.py under capture). Fast
rows (drafts) need only be deterministic, and differ on CUDA: the static forward attends them by
the exact kernel (the dynamic one by library attention), and padding gives their products other
shapes. On CPU they match up to linear.SMALL_BATCH_ROWS rows.

Shapes: static_shape.py; a shape's buffers, staging and kernel calls: static_step.py.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import OrderedDict

import torch

from vericache.kernels import triton_ops
from vericache.model.sequence_attention import SequenceAttention
from vericache.model.static_shape import (
    BUCKETS,
    GroupKey,
    GroupShape,
    LayerKind,
    StaticSplit,
    StepShape,
    bucket,
    layer_form,
    new_slots,
)
from vericache.model.static_step import StepBuffers, TableAttention

logger = logging.getLogger(__name__)

MAX_SHAPES = 32  # shapes whose buffers (and graphs) are kept, least recently used dropped
# Rows of a static forward, at most: larger steps (16 verifications of 32 tokens and up) are
# bound by their kernels, not the host, and each shape's graph keeps its logits [rows, vocab].
MAX_ROWS = 512


class CaptureFailed(RuntimeError):
    """A step's CUDA graph could not be captured; the step's caches are as before it."""


class StaticForward:
    """The runner's forwards of static shape (see the module docstring)."""

    def __init__(self, runner, tables: bool | None = None):
        self.runner = runner
        # The KV through tables (the Triton kernels): on CUDA, and in tests of them on CPU under
        # Triton's interpreter; captured in graphs on CUDA only.
        self.tables = runner.device.type == "cuda" if tables is None else tables
        self.captures = self.tables and runner.device.type == "cuda"
        self._windowless = all(w is None for w in runner.config.layer_windows)
        self._steps: OrderedDict[StepShape, StepBuffers] = OrderedDict()
        self._pool = torch.cuda.graph_pool_handle() if self.captures else None
        if self.tables and runner.device.type == "cuda" and not triton_ops.available():
            raise ValueError("static forwards on CUDA need Triton (their KV kernels)")
        self.failed = False  # a capture failed: no forward is static any more
        self._lock = threading.Lock()
        self.num_forwards = 0  # forwards run static, captured or eager
        self.num_captured = 0  # graphs captured

    def split(self, batch, invariant: bool) -> StaticSplit | None:
        """The sequences of `batch` it serves, their shape and places in it (the others run in a
        dynamic forward beside it: an exact row's bits are its own either way), or None where it
        serves none of them."""
        if self.failed or not self._windowless or (self.captures and not triton_ops.available()):
            return None  # (Triton switched off: a benchmark's torch baseline)
        members: dict[GroupKey, list[int]] = {}
        for i, seq in enumerate(batch):
            key = self._group_key(seq, invariant)
            if key is not None:
                members.setdefault(key, []).append(i)
        groups, placement, rows = [], {}, 0  # placement: batch index -> (group, index in it)
        for key, indices in sorted(members.items()):
            indices = indices[: BUCKETS[-1]]  # the rest go dynamic
            tokens, size = key[0], bucket(len(indices))
            if rows + size * tokens > MAX_ROWS:
                continue
            rows += size * tokens
            placement.update((i, (len(groups), place)) for place, i in enumerate(indices))
            groups.append(GroupShape(*key, size))
        if not groups:
            return None
        chosen = sorted(placement)
        shape = StepShape(tuple(groups), invariant)
        return StaticSplit(shape, chosen, [placement[i] for i in chosen])

    def _group_key(self, seq, invariant: bool) -> GroupKey | None:
        """The group of a sequence that a static forward serves, else None."""
        n = seq.token_ids.numel()
        tokens = bucket(n)
        if seq.observe is not None or seq.num_logits != n or tokens is None:
            return None
        if seq.cache.num_tokens + tokens > self.runner.config.max_position_embeddings:
            return None  # its padding tokens' positions
        form = layer_form(seq.cache.layers[0], self.runner.dtype)
        for layer in seq.cache.layers:  # one form throughout, and room: a step grows no buffer
            if form is None or layer_form(layer, self.runner.dtype) != form:
                return None
            slots = new_slots(layer)
            if slots.num_slots + tokens > slots.capacity:
                return None
        kind, packing = form
        exact = invariant and not seq.fast_attention
        if exact and kind is LayerKind.PACKED:
            return None  # (no exact row reads lossy KV: the dynamic forward's dequantized path)
        return tokens, exact, kind, packing

    @torch.no_grad()
    def forward(self, batch, split: StaticSplit) -> list[torch.Tensor]:
        """The dynamic forward's logits for `batch`, the sequences `split` chose (in its order),
        over the buffers of its shape."""
        with self._lock:  # a shape's buffers serve one forward at a time
            return self._forward(batch, split.shape, split.placed)

    def _forward(self, batch, shape: StepShape, placed) -> list[torch.Tensor]:
        step = self._buffers(shape)
        if self.captures:
            probes = self._probes_or_give_up(step, batch, placed) if step.graph is None else []
            step.stage_with_tables(batch, placed)
            if step.graph is None:
                self._capture_or_give_up(step, batch)
            step.graph.replay()
            logits = step.output.clone()  # the next replay overwrites the graph's
            if probes:
                self._check_or_give_up(step, batch, placed, probes, logits)
        elif self.tables:
            step.stage_with_tables(batch, placed)
            logits = self._body(step, TableAttention(step))
        else:
            step.stage(batch, placed)
            logits = self._eager(step, batch, placed)
        for seq in batch:
            seq.cache.advance(seq.token_ids.numel())
        self.num_forwards += 1
        spans = (step.rows(group, index, seq) for seq, (group, index) in zip(batch, placed))
        return [logits[start:end] for start, end in spans]

    def _buffers(self, shape: StepShape) -> StepBuffers:
        step = self._steps.get(shape)
        if step is None:
            if len(self._steps) >= MAX_SHAPES:
                self._steps.popitem(last=False)
            step = self._steps[shape] = StepBuffers(self.runner, shape, self.tables)
        self._steps.move_to_end(shape)
        return step

    def _eager(self, step: StepBuffers, batch, placed) -> torch.Tensor:
        """The shape's forward on CPU: the caches read and written by the CPU kernels, padding
        rows attended as zeros."""
        runner, shape = self.runner, step.shape
        ordered = sorted(range(len(batch)), key=lambda i: step.first_row(*placed[i]))
        spans = [step.rows(*placed[i], batch[i]) for i in ordered]
        kv = SequenceAttention(
            runner, [batch[i] for i in ordered], spans, step.positions, shape.invariant,
            step.num_rows,
        )  # fmt: skip
        return self._body(step, kv)

    def _body(self, step: StepBuffers, kv) -> torch.Tensor:  # [logit rows, vocab] float32
        runner, invariant = self.runner, step.shape.invariant
        hidden = runner.embed(step.token_ids, step.num_rows)
        hidden = runner.layers(hidden, step.positions, kv, invariant)
        return runner.head(hidden[: step.shape.num_tokens], invariant)

    def _capture_or_give_up(self, step: StepBuffers, batch) -> None:
        """Captures the step's graph; where that fails (device memory, a kernel's compile, an
        operator capture refuses), the batch's caches are rolled back to before the step, no
        later forward is static, and `CaptureFailed` tells the runner to run this one dynamic."""
        try:
            self._capture(step)
        except Exception as error:
            self._give_up(batch, f"CUDA graph capture failed ({error})")
            raise CaptureFailed from error

    def _check_or_give_up(self, step: StepBuffers, batch, placed, probes, logits) -> None:
        """A new graph's first replay, checked where bits are promised: each probed sequence's
        rows against the dynamic forward over the copy of its cache from before the step. They
        differ only where capture broke something this machine's GPU does not show on CPU: then
        the step is undone and `CaptureFailed` raised, as for a failed capture."""
        for index, before in probes:
            seq = batch[index]
            (expected,) = self.runner.forward_dynamic(
                [dataclasses.replace(seq, cache=before)], step.shape.invariant
            )
            start, end = step.rows(*placed[index], seq)
            if not torch.equal(logits[start:end], expected):
                self._give_up(batch, "a captured step's exact rows differ from the dynamic forward")
                raise CaptureFailed

    def _probes_or_give_up(self, step: StepBuffers, batch, placed) -> list:
        """`_probes`; where copying a cache fails (device memory), a new graph cannot be checked,
        so none is captured: `CaptureFailed` before anything is staged."""
        try:
            return _probes(step, batch, placed)
        except Exception as error:
            self._give_up([], f"no copy of a cache to check a new CUDA graph against ({error})")
            raise CaptureFailed from error

    def _give_up(self, batch, reason: str) -> None:
        """The step's caches as before it (the slots staging reserved dropped), and no static
        forward from now on."""
        for seq in batch:
            for layer in seq.cache.layers:
                layer.drop_last(seq.token_ids.numel())
        self._steps.clear()
        self.failed = True
        logger.warning("%s: dynamic forwards from now on", reason)

    def _capture(self, step: StepBuffers) -> None:
        """Captures the shape's forward over its staged inputs. Warm-up runs first (Triton's
        compiles, cuBLAS's workspaces), on a side stream as capture wants: they compute this
        step's KV into the caches, which the replay then writes again, the same bits."""
        kv = TableAttention(step)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._body(step, kv)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a worker's other threads (KV loads to the device) go on during capture.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            step.output = self._body(step, kv)
        step.graph = graph
        self.num_captured += 1


def _probes(step: StepBuffers, batch, placed) -> list[tuple[int, object]]:
    """(index in `batch`, copy of its cache as it is before the step) for the first sequence of
    each exact group: what a new graph's first replay is checked against."""
    probes, seen = [], set()
    for index, (group, _) in enumerate(placed):
        shape = step.shape.groups[group]
        if shape.exact and group not in seen:
            seen.add(group)
            cache = batch[index].cache
            probes.append((index, cache.clone(cache.num_tokens + shape.tokens)))
    return probes
