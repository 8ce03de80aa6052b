"""Byte sizes: ``"16GiB"`` -> bytes and back (no torch here, so config and CLI import fast)."""

from __future__ import annotations

import math
import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "p": 1000**5,
    "pb": 1000**5,
    "pib": 1024**5,
    "e": 1000**6,
    "eb": 1000**6,
    "eib": 1024**6,
}
_SIZE = re.compile(r"^\s*(-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)\s*([a-zA-Z]*)\s*$")
# More bytes than any machine holds (4 EiB): a typo (1e99), refused before any arithmetic
# on it overflows a 64-bit integer.
MOST_BYTES = 2**62


def parse_bytes(value: str | int | float, *, field: str = "size", positive: bool = False) -> int:
    """Parse ``"16GiB"``, ``"512MB"``, ``"1.5g"``, ``"1e9"`` or a plain number into bytes.

    Raises
    ------
    ValueError
        For negative, infinite, non-numeric or unknown-unit values, or more than
        :data:`MOST_BYTES`, naming ``field`` and the value; with ``positive``, for 0 bytes too
        (``"0"``, ``"0.1B"``), every message then asking for ``> 0`` (a user who gives 0 after
        being told ``>= 0`` is not refused again).
    """
    bound = "> 0" if positive else ">= 0"
    if isinstance(value, bool):
        raise ValueError(f"{field}={value!r} is not a byte size")
    if isinstance(value, int | float):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{field}={value!r} must be a finite number of bytes {bound}")
        return _nonzero(_at_most(int(value), value, field), value, field, positive)
    match = _SIZE.match(str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"{field}={value!r} is not a byte size; use a number with an optional unit, "
            "B, KB, MB, GB, TB, PB or EB (powers of 1000; one letter, such as 1.5G, too) or "
            "KiB ... EiB (powers of 1024), any case: 512MB, 2GiB"
        )
    number = float(match.group(1))
    if number < 0:
        raise ValueError(f"{field}={value!r} must be a byte size {bound}")
    size = _at_most(int(number * _UNITS[match.group(2).lower()]), value, field)
    return _nonzero(size, value, field, positive)


def _at_most(size: int, value: object, field: str) -> int:
    if size > MOST_BYTES:
        raise ValueError(f"{field}={value!r} is more bytes than any machine holds (4 EiB)")
    return size


def _nonzero(size: int, value: object, field: str, positive: bool) -> int:
    if positive and size == 0:
        raise ValueError(f"{field}={value!r} must be a byte size > 0")
    return size


def parse_budget(value: str | int | float, *, field: str) -> int:
    """:func:`parse_bytes` for a byte budget, which must leave room for something.

    Raises
    ------
    ValueError
        As :func:`parse_bytes`, and for a budget of 0 bytes (``"0"``, ``"0.1B"``), naming
        ``field`` and the value.
    """
    return parse_bytes(value, field=field, positive=True)


def format_bytes(count: int | float) -> str:
    """Human-readable binary size, e.g. ``1.5 GiB``."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
