"""Subcommands of the ``alisa`` CLI: name -> (help, configure(parser), run(args) -> exit code)."""

from __future__ import annotations

from alisa.commands import batch, experiment, generate, plan, profile, serve

COMMANDS = {
    "batch": (batch.HELP, batch.configure, batch.run),
    "experiment": (experiment.HELP, experiment.configure, experiment.run),
    "generate": (generate.HELP, generate.configure, generate.run),
    "plan": (plan.HELP, plan.configure, plan.run),
    "profile": (profile.HELP, profile.configure, profile.run),
    "serve": (serve.HELP, serve.configure, serve.run),
}
