"""Where the library's log records go when a command line runs it.

The library only logs (``logging.getLogger(__name__)``); the ``alisa`` command and the
experiment runners call :func:`log_to_stderr` so that progress notes such as a one-time GGUF
conversion reach the user as before, one ``alisa: ...`` line each.
"""

from __future__ import annotations

import logging
import sys


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (a test's capture, a redirected
    stream), not the stream of when the handler was made."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        """Ignored: the stream is always the current ``sys.stderr``."""


def log_to_stderr(level: int = logging.INFO) -> None:
    """Send the ``alisa`` loggers' records of ``level`` and above to stderr (once)."""
    logger = logging.getLogger("alisa")
    logger.setLevel(level)
    if not any(isinstance(handler, _StderrHandler) for handler in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("alisa: %(message)s"))
        logger.addHandler(handler)
