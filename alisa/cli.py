"""The ``alisa`` command line: ``alisa generate ...`` (subcommands live in ``alisa.commands``).

Exit codes: 0 done; 1 an error (bad input, config or file; nothing written is lost); 2 a usage
error (unknown flag, a value of the wrong type); 3 ``alisa batch`` finished but some rows failed
(a re-run retries them); 130 interrupted (Ctrl-C); 141 the output's reader stopped early (`| head`,
quietly, as a tool SIGPIPE ends); 143 stopped by SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import NoReturn

from alisa.commands import COMMANDS
from alisa.commands.options import (
    EXIT_BROKEN_PIPE,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    SIZE_FLAGS,
    CommandError,
)
from alisa.logs import log_to_stderr


class CommandParser(argparse.ArgumentParser):
    """A subcommand's parser (``alisa generate``): its usage errors say how to pass a prompt
    argparse misread, a word of several unquoted or one starting with ``-``."""

    def error(self, message: str) -> NoReturn:
        super().error(message + prompt_hint(self.prog, message))


def prompt_hint(prog: str, message: str) -> str:
    """What to do where a usage error of ``prog`` is likely a prompt argparse misread ("" if
    none): ``-hi`` reads as ``-h`` given ``i``, ``hi there`` unquoted as two arguments."""
    if prog != "alisa generate":
        return ""
    unknown = message.removeprefix("unrecognized arguments: ").split()
    if "ignored explicit argument" in message or (
        message.startswith("unrecognized") and any(re.match(r"-[^-]", word) for word in unknown)
    ):
        return (
            "; a prompt that starts with '-' goes after '--' (alisa generate -- '-hi'), in "
            "--prompt-file or on stdin"
        )
    if message.startswith("unrecognized") and not unknown[0].startswith("-"):
        return '; a prompt of several words goes in quotes (alisa generate "hi there")'
    return ""


def build_parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``alisa`` parser and each subcommand's, by name."""
    # No abbreviated flags: `--prompt hello` was taken as `--prompt-file hello`, a file the
    # user never named (the prompt is the positional argument).
    parser = argparse.ArgumentParser(
        prog="alisa",
        description="LLM inference when KV-cache memory is the wall (ALISA runtime)",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"alisa {_version()}")
    subparsers = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=CommandParser
    )
    commands = {}
    for name, (help_text, configure, _) in COMMANDS.items():
        commands[name] = subparsers.add_parser(
            name, help=help_text, description=help_text, allow_abbrev=False
        )
        configure(commands[name])
    return parser, commands


def build_parser() -> argparse.ArgumentParser:
    """The ``alisa`` parser."""
    return build_parsers()[0]


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
    parser, commands = build_parsers()
    words = join_negative_sizes(sys.argv[1:] if argv is None else argv)
    args, unknown = parser.parse_known_args(words)
    if unknown:  # said by the subcommand's parser: its usage, not the top-level one
        commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    log_to_stderr()
    run: Callable[[argparse.Namespace], int] = COMMANDS[args.command][2]
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {}
    if main_thread:
        previous = {
            signal.SIGINT: signal.signal(signal.SIGINT, _stop),
            signal.SIGTERM: signal.signal(signal.SIGTERM, _stop),
        }
    try:
        return run(args)
    except BrokenPipeError:  # stdout's reader stopped early (`| head`): not an error of ours
        _detach_stdout()
        return EXIT_BROKEN_PIPE
    except (CommandError, ValueError, OSError) as error:
        message = " ".join(str(error).split())  # one line, whatever the library wrote
        print(f"alisa {args.command}: error: {message}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"alisa {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Terminated:
        print(f"alisa {args.command}: stopped by SIGTERM", file=sys.stderr)
        return EXIT_TERMINATED
    finally:
        for number, handler in previous.items():
            # After a stop the process is on its way out: a second Ctrl-C during the exit's own
            # clean-up (atexit, the interpreter's shutdown) stays as quiet as during ours.
            if signal.getsignal(number) is _stop:
                signal.signal(number, handler)


class Terminated(BaseException):
    """SIGTERM, raised where the command runs (as Ctrl-C raises ``KeyboardInterrupt``): its
    ``finally`` blocks close the output and release its lock, and the command says why it
    stopped instead of vanishing. ``alisa serve`` drains on SIGTERM (its own handler)."""


def _stop(signum: int, frame) -> NoReturn:
    """The first Ctrl-C or SIGTERM of a command: raised where it runs, so that its ``finally``
    blocks close the output and release its lock. Another one while those run (an impatient
    second Ctrl-C) would raise out of them, leave the lock behind and print a traceback:
    from here on both signals are only noted, once (Ctrl-\\ still kills)."""
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, _stopping)
    raise KeyboardInterrupt if signum == signal.SIGINT else Terminated


def _stopping(signum: int, frame) -> None:
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, signal.SIG_IGN)
    # os.write, not print: the signal may land inside a print to stderr (a reentrant call).
    os.write(2, b"alisa: stopping already (closing the output); Ctrl-\\ kills at once\n")


def _detach_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush at exit does not fail
    on the closed pipe again (Python's own advice for SIGPIPE)."""
    try:
        descriptor = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (captured): nothing to flush
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, descriptor)
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
