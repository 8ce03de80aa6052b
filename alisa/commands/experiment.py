"""``alisa experiment``: the experiment runner (same as ``python -m experiments.run``)."""

from __future__ import annotations

import argparse

HELP = "run an experiment sweep from a TOML config (resumable)"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="experiments/configs/NAME.toml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    from experiments.run import main

    argv = ["--config", args.config] + [f"--set={item}" for item in args.set]
    return main(argv + (["--no-progress"] if args.no_progress else []))
