"""What experiments/ needs beyond alisa, pyproject's ``bench`` extra (matplotlib, SciPy,
rouge-score): imported inside the function that needs it, so alisa and the other experiments run
without it, and a missing one is an error that says how to install it."""

from __future__ import annotations

import importlib
from types import ModuleType

INSTALL = "pip install -e '.[bench]'"


def bench_module(name: str) -> ModuleType:
    """The module ``name`` (e.g. ``"scipy.stats"``) of a package of the bench extra.

    Raises
    ------
    ModuleNotFoundError
        Its package is not installed: the message names it and the extra. A module missing
        inside an installed package is re-raised as it is (not the extra's to explain).
    """
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] != name.split(".")[0]:
            raise
        message = f"{name} is not installed: this experiment needs the bench extra ({INSTALL})"
        raise ModuleNotFoundError(message, name=error.name) from None


def pyplot() -> ModuleType:
    """matplotlib's pyplot, drawing to files (the Agg backend: no display needed)."""
    bench_module("matplotlib").use("Agg")
    return bench_module("matplotlib.pyplot")


def save_figure(figure, path, dpi: int = 110):
    """Lay ``figure`` out tight, write it to the PNG ``path`` and close it; returns ``path``."""
    figure.tight_layout()
    figure.savefig(path, dpi=dpi)
    pyplot().close(figure)
    return path
