"""numba's on-disk kernel cache, keyed by a digest of every kernel source instead of one file.

``numba.njit(cache=True)`` keys a compiled kernel on its own source file only. A kernel that
calls row functions of another module (host retention's one compiled call,
:func:`alisa.ops.cpu.select_and_fetch`, calls kernels of three modules) then runs its stale
machine code after one of those is edited, until someone deletes ``__pycache__`` by hand: a
silent wrong result (numba issue 1833, https://github.com/numba/numba/issues/1833).

:func:`kernel` compiles like ``numba.njit`` and caches each kernel in a directory named by a
digest of every alisa source file that uses numba (and numba's version), under
``$ALISA_CACHE_DIR/numba`` (default ``~/.cache/alisa/numba``). Any edit to any kernel source
gives another digest, so another directory: nothing compiled from other sources can be loaded.
Where that directory cannot be written, the kernel compiles once per process instead.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import numba
from numba.core.caching import CompileResultCacheImpl, FunctionCache, _CacheLocator

PACKAGE = Path(__file__).resolve().parents[1]  # the alisa package: every kernel lives in it
MARK = b"numba"  # a source file that names numba may define or call a kernel


def kernel_sources(root: Path = PACKAGE) -> list[Path]:
    """The Python files under ``root`` whose text names numba, sorted by path."""
    return sorted(path for path in root.rglob("*.py") if MARK in path.read_bytes())


def kernel_digest(root: Path = PACKAGE) -> str:
    """A digest of numba's version and every kernel source under ``root`` (names and bytes).

    Parameters
    ----------
    root
        The package directory to read (alisa's own by default; a test passes a copy).

    Returns
    -------
    str
        16 hexadecimal digits; any changed byte of any kernel source changes it.
    """
    digest = hashlib.sha256(numba.__version__.encode())
    for path in kernel_sources(root):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


@functools.cache
def _package_digest() -> str:
    # Once per process: the sources a process runs are the ones it imported at its start.
    return kernel_digest()


def cache_dir() -> Path:
    """Where this build's kernels are cached: ``$ALISA_CACHE_DIR/numba/<digest>``."""
    override = os.environ.get("ALISA_CACHE_DIR")
    if override:
        root = Path(override).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = (Path(xdg) if xdg else Path.home() / ".cache") / "alisa"
    return root / "numba" / _package_digest()


class _DigestLocator(_CacheLocator):
    """numba's cache locator for alisa's kernels: one directory per digest of their sources."""

    def __init__(self, py_func: Callable, py_file: str) -> None:
        self._lineno = py_func.__code__.co_firstlineno
        self._path = str(cache_dir() / self.get_suitable_cache_subpath(py_file))

    def get_cache_path(self) -> str:
        return self._path

    def get_source_stamp(self) -> str:
        return _package_digest()  # the directory already says it; the index checks it again

    def get_disambiguator(self) -> str:
        return str(self._lineno)

    @classmethod
    def from_function(cls, py_func: Callable, py_file: str) -> _DigestLocator | None:
        locator = cls(py_func, py_file)
        try:
            locator.ensure_cache_path()
        except OSError:  # not writable: numba then compiles in memory only
            return None
        return locator


class _DigestCacheImpl(CompileResultCacheImpl):
    _locator_classes = [_DigestLocator]


class _DigestCache(FunctionCache):
    _impl_class = _DigestCacheImpl


def kernel(**options) -> Callable[[Callable], Callable]:
    """``numba.njit(**options)`` whose compiled code is cached under :func:`cache_dir`.

    Parameters
    ----------
    **options
        numba's options (``parallel``, ``nogil``, ``fastmath`` ...); not ``cache``.

    Returns
    -------
    Callable
        A decorator giving numba's dispatcher for the function.
    """
    if "cache" in options:
        raise ValueError("cache=...: kernel() always caches, under a digest of the sources")

    def compile_(function: Callable) -> Callable:
        dispatcher = numba.njit(**options)(function)
        # No writable directory (RuntimeError): compiled once per process instead.
        with contextlib.suppress(RuntimeError):
            # What njit(cache=True) does (Dispatcher.enable_caching), with our locator; numba is
            # pinned, and tests/test_numba_cache.py checks the files land where this says.
            dispatcher._cache = _DigestCache(function)
        return dispatcher

    return compile_
