"""`vericache calibrate`: measures a device for the simulator (vericache/calibration/calibrate.py)
and writes its profile, with the measurements behind it, as one small JSON."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from vericache.errors import InvalidRequestError
from vericache.sim.profiles import bundled, datasheet_for, device_profile, model_profile


def add_parser(commands) -> None:
    parser = commands.add_parser("calibrate", help="measure a device profile for the simulator")
    parser.add_argument("--device", choices=("cpu", "cuda"), required=True)
    parser.add_argument(
        "--arch", required=True, help=f"model profile: one of {bundled('models')}, or a JSON file"
    )
    parser.add_argument("--out", type=Path, required=True, help="PROFILE.json to write")
    parser.add_argument(
        "--base", help="datasheet device profile for what one device cannot measure "
        "(default: by the CUDA device's name; none on CPU)",
    )  # fmt: skip
    parser.add_argument("--layers", type=int, help="layers of the deeper slice (default: fit)")
    parser.add_argument(
        "--repeats", type=int, help="timings of each measurement, the median kept (CPU 9, CUDA 5)"
    )
    parser.set_defaults(handler=run)


def run(args) -> int:
    model = model_profile(args.arch)  # the cheap checks first
    base = device_profile(args.base) if args.base else None
    if not args.out.parent.is_dir():
        raise InvalidRequestError(f"no directory {args.out.parent} to write the profile in")
    import torch  # here: the simulator's other commands run without it

    from vericache.calibration.calibrate import CalibrationPlan, calibrate

    if args.device == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError("--device cuda: CUDA is not available here")
    device = torch.device(args.device)
    if base is None and device.type == "cuda":
        base = datasheet_for(torch.cuda.get_device_name(device))
    logging.basicConfig(level=logging.INFO, format="[calibrate] %(message)s")
    plan = CalibrationPlan.for_device(device, model)
    if args.layers is not None:
        plan = dataclasses.replace(plan, num_layers=args.layers)
    if args.repeats is not None:
        plan = dataclasses.replace(plan, repeats=args.repeats)
    result = calibrate(model, device, plan, base)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    profile = result["profile"]
    print(
        f"{args.out}: {profile['hbm_bytes_per_s'] / 1e9:.1f} GB/s, "
        f"{profile['peak_flops'] / 1e12:.2f} TFLOP/s, overhead "
        f"{profile['forward_overhead_s'] * 1e3:.2f} ms + {profile['layer_overhead_s'] * 1e6:.1f} "
        f"us per layer"
    )
    return 0
