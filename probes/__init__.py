"""Probes: one-question measurements and diagnostics, run from a checkout (``python -m
probes.NAME``), not installed with alisa (pyproject's ``packages.find`` leaves them out). Each one
says in its docstring what it measures; the docs cite its figures with the command."""
