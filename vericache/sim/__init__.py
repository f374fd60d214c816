"""Evidence at the scale users run, without the hardware.

An event core (events.py: a clock, devices that run one forward at a time, links that move bytes)
charges each forward what the cost model says it takes (cost.py) on the named model and device
(profiles.py: datasheets until `vericache calibrate`, vericache/calibration, has measured one).
Workloads (workload.py) replay recorded acceptance. long_context.py simulates Pipeline 1 on the real
schedulers against full-KV decoding at the same memory; remote_prefix.py Pipeline 2 with
per-request rounds on workers that batch what they hold (batch_loop.py), warm drafter nodes
included, against FULL_LOCAL, FULL_REMOTE and FULL_BOTH on the same devices
(remote_prefix_full.py), with host tiers and recomputed prefixes (host_tier.py);
remote_prefix_auto.py each request's choice of path (`mode: auto`); remote_prefix_compare.py
the paper's baseline and the strongest full-KV one; scenario.py runs one described in a YAML
file (`vericache sim --scenario`). Pure Python: no torch is needed to import or run the simulator
(tests/test_sim_imports.py holds it).
"""
