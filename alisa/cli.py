"""The ``alisa`` command line: ``alisa generate ...`` (more subcommands register here)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from alisa.config import AlisaConfig
from alisa.models import DEFAULT_MODEL, DTYPES


class CommandError(Exception):
    """A user-facing error: printed as one line, exit code 1, no traceback."""


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """``--model`` and ``--dtype``, shared by every command that loads a model."""
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"built-in name, HF directory, .gguf file or hub id (default: {DEFAULT_MODEL})",
    )
    parser.add_argument(
        "--dtype", default="auto", help=f"weights dtype: {', '.join(DTYPES)} (default: auto)"
    )


def add_cache_options(parser: argparse.ArgumentParser) -> None:
    """The ``AlisaConfig`` fields as flags (``--policy``, ``--caching-ratio``, ...)."""
    group = parser.add_argument_group("KV cache")
    group.add_argument(
        "--policy", default="dense", help="dense, swa, h2o, tova, streaming, local, strided"
    )
    group.add_argument("--caching-ratio", type=float, default=1.0, help="r in (0, 1] (default 1.0)")
    group.add_argument("--budget-tokens", type=int, help="fixed tokens kept per sequence")
    group.add_argument(
        "--recent-fraction", type=float, help="share of the budget for recent tokens"
    )
    group.add_argument("--sink-tokens", type=int, help="first tokens always kept")
    group.add_argument(
        "--score-window", type=int, help="SWA: decode steps whose attention is summed"
    )
    group.add_argument("--stride", type=int, help="strided: keep every N-th token")
    group.add_argument("--dense-layers", type=int, default=0, help="first N layers keep everything")
    group.add_argument("--layer-schedule", default="uniform", help="uniform or pyramid")
    group.add_argument("--per-head", action="store_true", help="select tokens per KV head")
    group.add_argument("--kv-bits", type=int, default=16, help="16, 8 or 4")
    group.add_argument("--quant-group-size", type=int, help="values per scale (default head_dim)")
    group.add_argument(
        "--residual-tokens", type=int, default=64, help="recent tokens kept in full precision"
    )
    tiers = parser.add_argument_group("memory tiers")
    tiers.add_argument(
        "--gpu-memory", help="device byte budget, e.g. 2GiB (KV beyond it is offloaded)"
    )
    tiers.add_argument("--host-memory", help="host tier byte budget (default: what is available)")
    tiers.add_argument("--recompute", default="auto", help="auto, never or always")
    tiers.add_argument("--profile", help="hardware profile JSON from `alisa profile`")


def cache_config_from_args(args: argparse.Namespace) -> AlisaConfig:
    """Build the validated ``AlisaConfig`` the cache flags describe."""
    return AlisaConfig(
        policy=args.policy,
        caching_ratio=args.caching_ratio,
        budget_tokens=args.budget_tokens,
        recent_fraction=args.recent_fraction,
        sink_tokens=args.sink_tokens,
        score_window=args.score_window,
        stride=args.stride,
        dense_layers=args.dense_layers,
        layer_schedule=args.layer_schedule,
        per_head=args.per_head,
        kv_bits=args.kv_bits,
        quant_group_size=args.quant_group_size,
        residual_tokens=args.residual_tokens,
        gpu_memory=args.gpu_memory,
        host_memory=args.host_memory,
        recompute=args.recompute,
        profile=args.profile,
    )


def load_for_cli(spec: str, dtype: str):
    """Load a model quietly (HF's per-load bars off) after any one-time GGUF conversion."""
    from transformers.utils import logging as hf_logging

    from alisa.models import load_model, resolve_dtype, resolve_model_path

    resolve_dtype(dtype)  # fail on a bad dtype before any slow work
    path = resolve_model_path(spec)  # converts a GGUF once, with its progress bar
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    return load_model(path, dtype=dtype)


def build_parser() -> argparse.ArgumentParser:
    from alisa.commands import COMMANDS

    parser = argparse.ArgumentParser(
        prog="alisa", description="LLM inference when KV-cache memory is the wall (ALISA runtime)"
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, configure, _) in COMMANDS.items():
        configure(subparsers.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``alisa`` console script; returns the exit code."""
    from alisa.commands import COMMANDS

    args = build_parser().parse_args(argv)
    run: Callable[[argparse.Namespace], int] = COMMANDS[args.command][2]
    try:
        return run(args)
    except (CommandError, ValueError, OSError) as error:
        message = " ".join(str(error).split())  # one line, whatever the library wrote
        print(f"alisa {args.command}: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"alisa {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
