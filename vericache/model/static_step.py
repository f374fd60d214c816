"""The buffers of one static shape (static_shape.py), and its KV access on CUDA.

Rows are laid out group by group, each group's sequences one after another with the padding
sequences last: row = group's first row + index * tokens + offset, a sequence's own tokens
first, then its padding tokens. Every input of a step lives in one int64
tensor, [token ids | positions | tables], so that on CUDA a step's inputs reach the device in one
copy, from a pinned host buffer (a ring of two, each reused only once its last copy is done).
"""

from __future__ import annotations

import numpy as np
import torch

from vericache.kernels import triton_kv_table
from vericache.kernels.triton_kv_table import TABLE_WIDTH, TableEntry
from vericache.kv.cache import DenseLayerKV
from vericache.kv.prefixed import PrefixedLayerKV
from vericache.kv.quantized import QuantizedLayerKV
from vericache.kv.slots import aligned
from vericache.model.linear import zero_row
from vericache.model.static_shape import LayerKind, StepShape, new_slots

HOST_RING = 2


class StepBuffers:
    """One shape's inputs (token ids, positions, tables), padding, staging and, on CUDA, graph."""

    def __init__(self, runner, shape: StepShape, with_tables: bool):
        self.shape = shape
        self.device = runner.device
        c = runner.config
        self.num_rows = runner.rows_for(shape.num_tokens, shape.invariant)
        self._first_rows, self._first_seqs = [], []
        row = seq = 0
        for g in shape.groups:
            self._first_rows.append(row)
            self._first_seqs.append(seq)
            row, seq = row + g.batch * g.tokens, seq + g.batch
        tables = c.num_layers * shape.num_sequences * TABLE_WIDTH if with_tables else 0
        size = 2 * self.num_rows + tables
        # Host buffers go with numpy views of them, made once: a step's small writes through
        # them cost little host time. On CPU the inputs are a numpy array's (no tensor is read on
        # the host).
        if self.device.type == "cpu":
            view = np.zeros(size, dtype=np.int64)
            self.inputs = torch.from_numpy(view)
            self._inputs_host = (self.inputs, view)
        else:
            self.inputs = torch.zeros(size, dtype=torch.int64, device=self.device)
        self.token_ids = self.inputs[: self.num_rows]  # [R]
        self.positions = self.inputs[self.num_rows : 2 * self.num_rows]  # [R]
        self.tables = self.inputs[2 * self.num_rows :].view(c.num_layers, -1, TABLE_WIDTH)
        row_seq, row_offset = self._row_owners()
        self.row_seq, self.row_offset = row_seq.to(self.device), row_offset.to(self.device)
        # Padding: token 0 at offsets 0.. over the scratch layer (CUDA), which it writes itself.
        self._pad = torch.zeros(size, dtype=torch.int64)
        self._pad[self.num_rows : self.num_rows + len(row_offset)] = row_offset
        self.graph = None
        self.output: torch.Tensor | None = None  # the graph's [logit rows, vocab]
        if with_tables:
            pad_tables = self._pad[2 * self.num_rows :].view(c.num_layers, -1, TABLE_WIDTH)
            pad_tables[:] = torch.tensor(self._scratch_entry(runner), dtype=torch.int64)
        if with_tables and self.device.type == "cuda":
            pinned = [self._pad.clone().pin_memory() for _ in range(HOST_RING)]
            self._host = [(buffer, buffer.numpy()) for buffer in pinned]
            self._copied = [None] * HOST_RING
            self._turn = 0

    def _scratch_entry(self, runner) -> TableEntry:
        """The table entry of every padding sequence: a scratch layer with room for a group's
        tokens, zeroed (finite: the padding rows attend over it), over no prefix (its fields
        point at the scratch too, never read: P = 0)."""
        c = runner.config
        self._scratch = DenseLayerKV(
            c.num_kv_heads, c.head_dim, runner.dtype, self.device, aligned(self.shape.num_tokens)
        )
        keys, values, positions, _ = self._scratch.reserve(self._scratch.capacity)
        for buffer in (keys, values, positions):
            buffer.zero_()
        self.like = keys.transpose(0, 1)  # [capacity, H, D]: the caches' dtype and heads
        return TableEntry(
            keys.data_ptr(), values.data_ptr(), positions.data_ptr(), keys.stride(0), 0,
            keys.data_ptr(), values.data_ptr(), keys.stride(0), 0,
        )  # fmt: skip

    def _row_owners(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[R] int32 each: every row's sequence (over all groups) and its offset within it."""
        seqs, offsets = [], []
        for g, first_seq in zip(self.shape.groups, self._first_seqs):
            seqs.append(torch.arange(first_seq, first_seq + g.batch).repeat_interleave(g.tokens))
            offsets.append(torch.arange(g.tokens).repeat(g.batch))
        return torch.cat(seqs).to(torch.int32), torch.cat(offsets).to(torch.int32)

    def first_row(self, group: int, index: int) -> int:
        return self._first_rows[group] + index * self.shape.groups[group].tokens

    def rows(self, group: int, index: int, seq) -> tuple[int, int]:
        """The rows of a sequence's own tokens (its padding tokens follow)."""
        start = self.first_row(group, index)
        return start, start + seq.token_ids.numel()

    def stage(self, batch, placed) -> None:
        """The batch's token ids and positions into the buffers (CPU: the host's own)."""
        self.inputs.copy_(self._pad)
        self._write_rows(*self._inputs_host, batch, placed)

    def _write_rows(self, host_tensor: torch.Tensor, host: np.ndarray, batch, placed) -> list:
        """Writes token ids held on the host and positions into a host buffer shaped as `inputs`
        (the tensor, and a numpy view of it); returns the (rows, ids) whose ids lie on the device
        (a deferred draft's last choice). Ids by tensor copies: reading a tensor's values on the
        host (numpy) would be a wait on a device."""
        on_device = []
        for seq, (group, index) in zip(batch, placed):
            start, end = self.rows(group, index, seq)
            first, tokens = seq.cache.num_tokens, self.shape.groups[group].tokens
            # Padding tokens go on at the positions after its own: inside the model's context.
            host[self.num_rows + start : self.num_rows + start + tokens] = np.arange(
                first, first + tokens
            )
            if seq.token_ids.device.type == "cpu":
                host_tensor[start:end].copy_(seq.token_ids)
            else:
                on_device.append((start, end, seq.token_ids))
        return on_device

    def stage_with_tables(self, batch, placed) -> None:
        """As `stage`, and every layer's table entries; on CUDA into the next pinned host buffer,
        then to the device in one copy. Reserves the new slots in each cache (the kernels write
        them)."""
        on_cuda = self.device.type == "cuda"
        if on_cuda:
            turn = self._turn
            self._turn = (turn + 1) % HOST_RING
            if self._copied[turn] is not None:
                self._copied[turn].synchronize()  # its last copy has left it
            host_tensor, host = self._host[turn]
        else:
            host_tensor, host = self._inputs_host
        host_tensor.copy_(self._pad)
        on_device = self._write_rows(host_tensor, host, batch, placed)
        tables = host[2 * self.num_rows :].reshape(len(self.tables), -1, TABLE_WIDTH)
        for seq, (group, index) in zip(batch, placed):
            entry = self._first_seqs[group] + index
            n = seq.token_ids.numel()
            # One numpy write a sequence, not one a layer: a row's write costs more than the
            # Python that makes it.
            tables[:, entry] = [_entry(layer, n) for layer in seq.cache.layers]
        if not on_cuda:
            return
        self.inputs.copy_(host_tensor, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        self._copied[turn] = copied
        for start, end, ids in on_device:
            self.token_ids[start:end].copy_(ids)

    def group_rows(self, group: int) -> tuple[int, int]:
        g = self.shape.groups[group]
        first = self._first_rows[group]
        return first, first + g.batch * g.tokens

    def group_sequences(self, group: int) -> tuple[int, int]:
        first = self._first_seqs[group]
        return first, first + self.shape.groups[group].batch


def _entry(layer, num_new: int) -> tuple[int, ...]:
    """A layer's table entry (`TableEntry`'s fields), its num_new slots reserved: the kernels
    write them, and its padding tokens' KV past them (`split` saw to the room), where no row of
    its own looks and the next step overwrites."""
    keys, values, positions, first = new_slots(layer).reserve(num_new)  # [H, capacity, D]
    own = (keys.data_ptr(), values.data_ptr(), positions.data_ptr(), keys.stride(0), first)
    no_prefix, no_packed = (0, 0, 0, 0), (0,) * 7
    if type(layer) is PrefixedLayerKV:
        prefix_keys, prefix_values, _ = layer.shared.buffers()  # [H, P', D]
        prefix = (prefix_keys.data_ptr(), prefix_values.data_ptr(), prefix_keys.stride(0))
        return (*own, *prefix, layer.shared.num_slots, *no_packed)
    if type(layer) is QuantizedLayerKV:
        addresses = tuple(t.data_ptr() for t in layer.packed_tensors())  # contiguous
        return (*own, *no_prefix, *addresses, layer.num_quantized)
    return (*own, *no_prefix, *no_packed)


class TableAttention:
    """`LayerKVAccess` of a static step on CUDA: the store and attention kernels find each
    sequence's cache through the step's tables, so the captured graph serves any caches."""

    def __init__(self, step: StepBuffers):
        self.step = step

    def store(self, index: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        step, rows = self.step, self.step.shape.num_tokens  # not a lone row's spare (CPU)
        triton_kv_table.store_kv(
            keys[:rows], values[:rows], step.positions, step.tables[index], step.row_seq,
            step.row_offset,
        )  # fmt: skip

    def attend(self, index: int, q: torch.Tensor) -> torch.Tensor:
        step, parts = self.step, []
        for group, shape in enumerate(step.shape.groups):
            rows, seqs = step.group_rows(group), step.group_sequences(group)
            table, group_q = step.tables[index, seqs[0] : seqs[1]], q[rows[0] : rows[1]]
            if shape.kind is LayerKind.PACKED:
                parts.append(
                    triton_kv_table.packed_attention(
                        group_q, table, shape.tokens, step.like, *shape.packing
                    )
                )
                continue
            prefixed = shape.kind is LayerKind.PREFIXED
            parts.append(
                triton_kv_table.attention(group_q, table, shape.tokens, step.like, prefixed)
            )
        if step.num_rows > step.shape.num_tokens:  # a lone row's spare (CPU)
            parts.append(zero_row(parts[0]))
        return parts[0] if len(parts) == 1 else torch.cat(parts)
