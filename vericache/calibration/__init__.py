"""Measurements of the engine on a device, for the simulator's device profiles: `vericache
calibrate` (calibrate.py), the co-runner slowdown of workers sharing a machine (co_runner.py), and
the random-weight models both time (random_weights.py). It needs torch; vericache/sim reads only
the JSON profiles it writes and imports no torch."""
