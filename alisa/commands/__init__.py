"""Subcommands of the ``alisa`` CLI: name -> (help, configure(parser), run(args) -> exit code)."""

from __future__ import annotations

from alisa.commands import generate

COMMANDS = {
    "generate": (generate.HELP, generate.configure, generate.run),
}
