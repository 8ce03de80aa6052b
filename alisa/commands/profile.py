"""``alisa profile``: measure this machine for the planner and save a JSON profile."""

from __future__ import annotations

import argparse
from pathlib import Path

from alisa.commands.options import add_model_options, check_minimum, check_new_file, load_for_cli

HELP = "measure copy/matmul/memory rates (calibrated on a model) and save a hardware profile"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", type=Path, help="where to save (default: the planner's path)")
    add_model_options(parser, dtype="bfloat16", model_note="; none: no calibration")
    parser.add_argument(
        "--threads", type=int, help="torch threads while measuring (default: torch's choice)"
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from alisa.planning import default_profile_path
    from alisa.profiling import measure

    check_minimum("--threads", args.threads, 1)
    if args.output is not None:
        check_new_file("--output", args.output)  # before measuring, not after
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model = None
    if args.model.lower() != "none":
        model, _ = load_for_cli(args.model, args.dtype)
    device = next(model.parameters()).device if model is not None else None
    profile = measure(model, device)
    path = args.output or default_profile_path(device or torch.device("cpu"))
    path.parent.mkdir(parents=True, exist_ok=True)
    profile.save(path)
    print(
        f"{profile.name}\n"
        f"  host->device {profile.h2d_bytes_per_s / 1e9:.2f} GB/s, "
        f"device->host {profile.d2h_bytes_per_s / 1e9:.2f} GB/s\n"
        f"  matmul {profile.device_flops / 1e12:.3f} TFLOP/s, "
        f"memory {profile.device_bytes_per_s / 1e9:.1f} GB/s, "
        f"recompute {profile.recompute_flops / 1e12:.3f} TFLOP/s\n"
        f"  decode step overhead {1000 * profile.step_overhead_s:.1f} ms\n"
        f"saved to {path}"
    )
    return 0
