"""The ``alisa`` command line: ``alisa generate ...`` (subcommands live in ``alisa.commands``).

Exit codes: 0 done; 1 an error (bad input, config or file; nothing written is lost); 2 a usage
error (unknown flag, a value of the wrong type); 3 ``alisa batch`` finished but some rows failed
(a re-run retries them); 130 interrupted.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence

from alisa.commands import COMMANDS
from alisa.commands.options import EXIT_ERROR, EXIT_INTERRUPTED, SIZE_FLAGS, CommandError
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


NEGATIVE = re.compile(r"-\.?\d")  # how a negative number starts


def join_negative_sizes(argv: Sequence[str]) -> list[str]:
    """``argv`` with ``--gpu-memory -5GB`` written ``--gpu-memory=-5GB`` (any of
    :data:`~alisa.commands.options.SIZE_FLAGS`).

    argparse takes a word starting with ``-`` for a flag unless it is a plain number, so a
    negative byte size would be refused as "expected one argument"; joined, it reaches the
    size check, which says what a size must be. Words after ``--`` are left alone.
    """
    words, joined = list(argv), []
    while words:
        word = words.pop(0)
        if word == "--":
            return [*joined, word, *words]
        if word in SIZE_FLAGS and words and NEGATIVE.match(words[0]):
            word = f"{word}={words.pop(0)}"
        joined.append(word)
    return joined


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``alisa`` console script; returns the exit code."""
    args = build_parser().parse_args(join_negative_sizes(sys.argv[1:] if argv is None else argv))
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
