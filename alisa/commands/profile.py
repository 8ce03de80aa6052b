"""``alisa profile``: measure this machine for the planner and save a JSON profile."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from alisa.commands.options import (
    CommandError,
    add_model_options,
    add_threads_option,
    apply_threads,
    check_minimum,
    check_new_file,
    dtype_from_flag,
    load_for_cli,
)

HELP = "measure the cost-model rates (fitted on a model's real decode steps) and save a profile"


def configure(parser: argparse.ArgumentParser) -> None:
    # Text, not a Path: Path("") is ".", and an empty --output must be refused as typed.
    parser.add_argument("--output", help="where to save (default: the planner's path)")
    parser.add_argument(
        "--force", action="store_true", help="overwrite an existing --output file (else an error)"
    )
    add_model_options(parser, dtype="bfloat16", model_note="; none: no calibration")
    add_threads_option(parser)
    parser.add_argument(
        "--batch", type=int, help="largest calibration batch: the plan's (default 8)"
    )
    parser.add_argument(
        "--context", type=int, help="largest calibration context in tokens (default 1024)"
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from alisa.calibration.profile import PLAN_SIZES, measure_report
    from alisa.calibration.steps import smallest_context
    from alisa.planning.hardware import default_profile_path
    from scheduler.hardware import calibration_error

    dtype_from_flag(args.dtype)
    calibrated = args.model.lower() != "none"
    check_minimum("--batch", args.batch, 1)  # out of range is said first, with a model or not
    check_minimum("--context", args.context, 1)
    for flag in ("--batch", "--context"):
        if getattr(args, flag[2:]) is not None and not calibrated:
            raise CommandError(
                f"{flag}={getattr(args, flag[2:])} has no effect with --model none (no decode "
                "steps are calibrated, only micro-benchmarks run)"
            )
    if args.output is not None:
        check_new_file("--output", args.output, force=args.force)  # before measuring, not after
    apply_threads("profile", args.threads)
    sizes = (
        PLAN_SIZES[0] if args.batch is None else args.batch,
        PLAN_SIZES[1] if args.context is None else args.context,
    )
    model = None
    if calibrated:
        model, _ = load_for_cli(args.model, args.dtype)
        # The model's own context first: a model too short to calibrate at all is said so,
        # rather than asked for a --context it cannot hold.
        _check_context(model, sizes[1], given=args.context is not None)
        if args.context is not None and args.context < smallest_context():
            raise CommandError(
                f"--context={args.context} must be >= {smallest_context()}: the host selection "
                "is timed at three contexts past its budget floor, and a decode fit needs two "
                "contexts"
            )
    device = next(model.parameters()).device if model is not None else None
    default = args.output is None
    path = default_profile_path(device or torch.device("cpu")) if default else Path(args.output)
    if default:  # the saved profile is replaced, but its place must be writable
        check_new_file("the default --output", path, force=True, make_folder=True)
    report = measure_report(model, device, sizes=sizes, progress=True)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        report.profile.save(path)
    except OSError as error:
        raise CommandError(f"cannot save the profile to {str(path)!r}: {error.strerror}") from None
    print(describe(report))
    print(f"saved to {path}")
    error = calibration_error(report.profile)
    if error is not None:  # saved all the same: the user sees its terms and may re-run
        print(f"alisa profile: warning: {error}; `alisa plan` refuses it", file=sys.stderr)
    return 0


def _check_context(model, context: int, *, given: bool) -> None:
    """Refuse, before measuring, a calibration context past the model's (``given``: set by
    ``--context``, else its default)."""
    from alisa.calibration.profile import context_error

    error = context_error(model, context, "--context")
    if error is not None:
        raise CommandError(
            error if given else f"{error}; --context was not given: {context} is its default"
        )


# How each term is printed: label, unit divisor, unit.
UNITS = {
    "h2d_bytes_per_s": ("host->device read", 1e9, "GB/s"),
    "d2h_bytes_per_s": ("device->host copy", 1e9, "GB/s"),
    "device_bytes_per_s": ("memory bandwidth", 1e9, "GB/s"),
    "device_flops": ("decode FLOP rate", 1e9, "GFLOP/s"),
    "kv_bytes_per_s": ("KV read rate", 1e9, "GB/s"),
    "recompute_flops": ("recompute FLOP rate", 1e9, "GFLOP/s"),
    "step_overhead_s": ("decode step overhead", 1e-3, "ms"),
    "select_bytes_per_s": ("host selection rate", 1e9, "GB/s"),  # key-sketch bytes selected over
    "select_overhead_s": ("host select overhead", 1e-3, "ms"),
}


def describe(report) -> str:
    """The profile's header and one line per measured term: min / median / max and source."""
    profile = report.profile
    lines = [
        f"{profile.name}",
        f"  {profile.cpu_model}, torch {profile.torch_version}, {profile.dtype}",
        f"  {'term':<22} {'min':>9} {'median':>9} {'max':>9}  unit      measured by",
    ]
    for term in report.terms:
        label, divisor, unit = UNITS[term.field]
        values = " ".join(f"{v / divisor:9.3f}" for v in (term.low, term.median, term.high))
        lines.append(f"  {label:<22} {values}  {unit:<8}  {term.source}")
    for label, miss in (("decode", profile.decode_miss), ("selection", profile.select_miss)):
        if miss is not None:
            lines.append(f"  the {label} fit misses its own steps by up to {miss:.1%}")
    return "\n".join(lines)
