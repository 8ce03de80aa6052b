"""``alisa experiment``: the experiment runner (same as ``python -m experiments.run``)."""

from __future__ import annotations

import argparse

HELP = "run an experiment sweep from a TOML config (resumable)"


def configure(parser: argparse.ArgumentParser) -> None:
    from experiments.runconfig import add_run_options

    add_run_options(parser)


def run(args: argparse.Namespace) -> int:
    from experiments.run import run_from_args

    return run_from_args(args, prog="alisa experiment")
