"""A simulated worker's batch loop (vericache/sim/batch_loop.py): what its next forward holds, and
which of it sets the worker's pace."""

from __future__ import annotations

from vericache.sim.batch_loop import SimBatchLoop, SimJob, chunked_job
from vericache.sim.cost import Row
from vericache.sim.events import Device, Simulation

KV_BYTES = 1024.0


def test_a_short_prefill_is_no_part_of_the_steady_batch():
    sim = Simulation()
    loop = SimBatchLoop(Device(sim, "worker"), lambda rows: 0.01)
    decode = Row(1, 500, KV_BYTES, is_full_kv=True)
    prefill = Row(24, 500, KV_BYTES, is_full_kv=True)  # as short as a verification of x = 30
    loop.submit(SimJob(lambda: decode, 8, lambda: None))
    loop.submit(chunked_job([prefill], lambda: None))
    assert loop.current_rows() == [decode, prefill]
    assert loop.steady_rows() == [decode]
