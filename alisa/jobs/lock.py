"""One writer per output file: an exclusive ``flock`` held for a whole run."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alisa.jobs.io import check_output_file


def lock_path(output: str | Path) -> Path:
    """The lock file beside ``output`` (``out.jsonl`` -> ``out.jsonl.lock``)."""
    output = Path(output)
    return output.with_name(output.name + ".lock")


@contextmanager
def output_lock(output: str | Path) -> Iterator[Path]:
    """Hold ``output``'s lock for the ``with`` block: one writer per output at a time.

    An exclusive ``flock`` on ``OUT.lock``: the kernel releases it when the process ends, however
    it ends, so a killed run never leaves the output locked (its lock file stays, unlocked, and
    the next run takes it over). The file is removed on leaving the block.

    Raises
    ------
    ValueError
        Another process holds the lock (the message names the output), the output is a
        directory, or the lock file cannot be created.
    """
    check_output_file(output)
    path = lock_path(output)
    descriptor = _take_lock(path, output)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)  # while still held: a waiting run then sees a new inode
        os.close(descriptor)  # closing releases the lock


def _take_lock(path: Path, output: str | Path) -> int:
    """A descriptor of ``path`` holding its exclusive lock (retried when the file was replaced)."""
    for _ in range(10):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise ValueError(
                f"cannot write output {str(output)!r} (its lock {str(path)!r}): {error.strerror}"
            ) from None
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            raise ValueError(
                f"another alisa run is writing the output {str(output)!r} (it holds "
                f"{str(path)!r}); wait for it to finish or stop it (nothing was changed)"
            ) from None
        try:
            current = os.stat(path).st_ino
        except FileNotFoundError:
            current = None
        if current == os.fstat(descriptor).st_ino:
            return descriptor
        os.close(descriptor)  # the holder removed the file as we locked it: lock the new one
    raise ValueError(f"cannot lock {str(path)!r}: it keeps being replaced")
