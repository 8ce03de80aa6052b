"""``alisa experiment``: the experiment runner (same as ``python -m experiments.run``)."""

from __future__ import annotations

import argparse

HELP = "run an experiment sweep from a TOML config (resumable)"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="experiments/configs/NAME.toml")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override, e.g. sweep.policy=swa,h2o or runtime.threads=1",
    )
    parser.add_argument("--data-dir", help="evaluation data (same as --set runtime.data_dir=PATH)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from experiments.run import main

    argv = ["--config", args.config] + [f"--set={item}" for item in args.set]
    if args.data_dir is not None:
        argv.append(f"--data-dir={args.data_dir}")
    return main(argv + (["--no-progress"] if args.no_progress else []))
