"""The ``alisa`` command line: ``alisa generate ...`` (subcommands live in ``alisa.commands``).

Exit codes: 0 done; 1 an error (bad input, config or file; nothing written is lost); 2 a usage
error (unknown flag, a value of the wrong type); 3 ``alisa batch`` finished but some rows failed
(a re-run retries them); 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from alisa.commands import COMMANDS
from alisa.commands.options import EXIT_ERROR, EXIT_INTERRUPTED, CommandError
from alisa.logs import log_to_stderr


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="alisa", description="LLM inference when KV-cache memory is the wall (ALISA runtime)"
    )
    parser.add_argument("--version", action="version", version=f"alisa {_version()}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, configure, _) in COMMANDS.items():
        configure(subparsers.add_parser(name, help=help_text, description=help_text))
    return parser


def _version() -> str:
    """The installed package's version (a source tree that is not installed says so)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("alisa")
    except PackageNotFoundError:
        return "(not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``alisa`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    log_to_stderr()
    run: Callable[[argparse.Namespace], int] = COMMANDS[args.command][2]
    try:
        return run(args)
    except (CommandError, ValueError, OSError) as error:
        message = " ".join(str(error).split())  # one line, whatever the library wrote
        print(f"alisa {args.command}: error: {message}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"alisa {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
