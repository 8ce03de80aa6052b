"""Subcommands of the ``alisa`` CLI: name -> (help, configure(parser), run(args) -> exit code)."""

from __future__ import annotations

from alisa.commands import generate, plan, profile

COMMANDS = {
    "generate": (generate.HELP, generate.configure, generate.run),
    "plan": (plan.HELP, plan.configure, plan.run),
    "profile": (profile.HELP, profile.configure, profile.run),
}
