"""The simulator runs without torch: every module of vericache/sim imports with torch blocked, as
on a laptop planning a deployment (calibration, which measures the model, is
vericache/calibration)."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import importlib, pkgutil, sys
sys.modules["torch"] = None  # any import of torch now fails
import vericache.sim
for module in pkgutil.walk_packages(vericache.sim.__path__, "vericache.sim."):
    importlib.import_module(module.name)
print("ok")
"""


def test_every_simulator_module_imports_without_torch():
    done = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"
