"""One writer at a time: an exclusive ``flock`` on the written file (or folder) itself.

The lock is the file's own, not a ``NAME.lock`` beside the name typed: every name of one file (a
symbolic link, a hard link, ``dir/../out``) is refused while a run writes it, and no file of
the user's is ever taken for a lock. The kernel releases a ``flock`` when its process ends,
however it ends, so a killed run never leaves anything locked.
"""

from __future__ import annotations

import fcntl
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alisa.jobs.io import check_output_file

ATTEMPTS = 10  # tries to lock a path whose file another run removes or replaces meanwhile


class OutputLock:
    """A held output lock (see :func:`output_lock`).

    Attributes
    ----------
    output
        The output, as it was named.
    created
        Whether this lock created the (empty) output file.
    """

    def __init__(self, output: Path, created: bool) -> None:
        self.output = output
        self.created = created
        self.kept = False

    def keep(self) -> None:
        """The run finished: its output stays on release, even if no row was written."""
        self.kept = True


@contextmanager
def output_lock(output: str | Path) -> Iterator[OutputLock]:
    """Hold ``output``'s lock for the ``with`` block: one writer per output file at a time.

    An exclusive ``flock`` on the output file itself (created empty if missing; its folder
    must exist: a typo in it would otherwise start a new tree, and a re-run under the right
    name redo every row). On release, a file this lock created that is still empty is removed
    unless the holder called :meth:`OutputLock.keep`: a run that failed before writing
    anything leaves nothing behind, and a file alisa did not create is never removed.

    Raises
    ------
    ValueError
        Another process holds the lock (the message names the output), the output is not a
        regular file, its folder does not exist, or it cannot be created or opened.
    """
    check_output_file(output)
    path = Path(output).resolve()  # a symbolic link's target: the name a new file gets
    if not path.parent.is_dir():
        raise ValueError(
            f"cannot write output {str(output)!r}: its folder {str(path.parent)!r} does not "
            "exist; make it first (a mistyped folder is not made)"
        )
    held, descriptor = None, None
    try:
        descriptor, created = _lock_output(path, output)
        held = OutputLock(Path(output), created)
        yield held
    finally:
        kept = held is not None and held.kept
        if descriptor is not None:
            if created and not kept:
                _remove_if_unused(path, descriptor)
            os.close(descriptor)  # closing releases the lock


@contextmanager
def locked(path: str | Path, busy: str | None = None) -> Iterator[None]:
    """Hold the exclusive ``flock`` of an existing file or folder for the ``with`` block.

    ``busy`` is the message when another process holds it; None: wait until it is free
    instead (for locks held only for a moment).

    Raises
    ------
    ValueError
        ``busy``, or ``path`` cannot be opened (named).
    """
    path = Path(path)
    for _ in range(ATTEMPTS):
        try:
            descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as error:
            raise ValueError(f"cannot lock {str(path)!r}: {error.strerror}") from None
        if _hold(path, descriptor, busy):
            try:
                yield
            finally:
                os.close(descriptor)
            return
    raise ValueError(f"cannot lock {str(path)!r}: it keeps being replaced")


def _lock_output(path: Path, output: str | Path) -> tuple[int, bool]:
    """(descriptor holding the lock of the file at ``path``, whether this call created it)."""
    busy = (
        f"another alisa run is writing the output {str(output)!r} (the same file, under this "
        "or another name); wait for it to finish or stop it (nothing was changed)"
    )
    for _ in range(ATTEMPTS):
        try:
            descriptor, created = _open_or_create(path)
        except FileExistsError:
            continue  # another run created it between our two opens: lock theirs
        except OSError as error:
            raise ValueError(f"cannot write output {str(output)!r}: {error.strerror}") from None
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):  # swapped since it was checked
            os.close(descriptor)
            check_output_file(output)  # names what it is
            raise ValueError(f"cannot write output {str(output)!r}: not a regular file")
        if _hold(path, descriptor, busy):
            return descriptor, created
    raise ValueError(f"cannot lock the output {str(output)!r}: it keeps being replaced")


def _open_or_create(path: Path) -> tuple[int, bool]:
    """A descriptor of the file at ``path`` and whether it was created (``FileExistsError``:
    created by someone else since it was found missing)."""
    flags = os.O_NONBLOCK | os.O_CLOEXEC  # never blocks: a FIFO swapped in is refused after
    try:
        return os.open(path, os.O_RDONLY | flags), False
    except FileNotFoundError:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | flags, 0o644), True


def _hold(path: Path, descriptor: int, busy: str | None) -> bool:
    """Lock ``descriptor`` (``busy`` None: waiting for it); False (closed) when ``path`` no
    longer names its file (a holder removed or replaced it as we locked it: look again).

    Raises
    ------
    ValueError
        ``busy``: another process holds the lock (``descriptor`` closed).
    """
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | (0 if busy is None else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(descriptor)
        raise ValueError(busy) from None
    if _names(path, descriptor):
        return True
    os.close(descriptor)
    return False


def _names(path: Path, descriptor: int) -> bool:
    """Whether ``path`` names the file open at ``descriptor``."""
    try:
        current = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(descriptor)
    return (current.st_dev, current.st_ino) == (opened.st_dev, opened.st_ino)


def _remove_if_unused(path: Path, descriptor: int) -> None:
    """Remove the file this lock created, if it is still that empty file (still locked by us:
    nobody else wrote to it)."""
    if os.fstat(descriptor).st_size == 0 and _names(path, descriptor):
        path.unlink(missing_ok=True)
