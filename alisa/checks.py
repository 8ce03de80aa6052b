"""Checks shared by the frozen settings dataclasses (``AlisaConfig``, the KV policies).

Each raises ``ValueError`` naming the field and the value, as every config of the project does.
A number is any ``numbers.Integral`` / ``numbers.Real`` (numpy's scalars included), never a bool;
a bool is Python's or numpy's (``numpy.bool_``, what a comparison of arrays gives).
"""

from __future__ import annotations

import math
import sys
import types
from collections.abc import Mapping, Set
from dataclasses import fields
from functools import cache
from numbers import Integral, Real
from typing import Union, get_args, get_origin, get_type_hints

_TYPE_NAMES = {
    bool: "a bool",
    int: "an integer",
    float: "a number",
    str: "a string",
    type(None): "None",
}


def check_number(name: str, value: object) -> None:
    """``value`` is a finite real number (not a bool)."""
    if not _is_real(value) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r} must be a finite number")


# The largest count a setting may hold (4 Ei): past any context, batch or byte size, and far
# enough below 2**63 that sums of such counts stay within the 64-bit integers numpy and torch
# compute with (a larger one ended in numpy's OverflowError deep in a step).
LARGEST_INT = 2**62


def check_int(name: str, value: object, *, minimum: int) -> None:
    """``value`` is an integer (not a bool) from ``minimum`` to :data:`LARGEST_INT`."""
    if not _is_integral(value) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")
    if (error := too_large(name, value)) is not None:
        raise ValueError(error)


def too_large(name: str, value: int) -> str | None:
    """Why integer ``value`` is refused as past :data:`LARGEST_INT`, or None."""
    if value <= LARGEST_INT:
        return None
    return f"{name}={value!r} is too large: give at most 2**62 ({LARGEST_INT})"


def check_share(name: str, value: object, *, zero: bool = False) -> None:
    """``value`` is a finite number in (0, 1], or in [0, 1] with ``zero`` (a ratio, a share)."""
    check_number(name, value)
    if not (0.0 <= value <= 1.0 if zero else 0.0 < value <= 1.0):
        raise ValueError(f"{name}={value!r} must be in {'[0, 1]' if zero else '(0, 1]'}")


def check_optional_int(name: str, value: object, *, minimum: int) -> None:
    """``value`` is ``None`` or an integer (not a bool) of at least ``minimum``."""
    if value is not None:
        check_int(name, value, minimum=minimum)


def check_bool(name: str, value: object) -> None:
    """``value`` is True or False: a string such as ``"no"`` or None would be read by its
    truth, often the opposite of what it says."""
    if not is_bool(value):
        raise ValueError(f"{name}={value!r} must be True or False")


def is_bool(value: object) -> bool:
    """Whether ``value`` is True or False: Python's bool or numpy's ``bool_`` (which is no
    ``bool`` subclass, nor registered with :mod:`numbers`, but means the same)."""
    if isinstance(value, bool):
        return True
    numpy = sys.modules.get("numpy")  # not imported: no numpy value can exist
    return numpy is not None and isinstance(value, numpy.bool_)


def unordered(value: object) -> str | None:
    """What ``value`` is, said for a message, when it is a dict or a set given where a sequence
    (prompts, token ids) is wanted; else None. Both iterate, so they would be read silently:
    a dict as its keys, a set in an arbitrary order."""
    if isinstance(value, Mapping):
        return "a dict (iterating it gives its keys)"
    if isinstance(value, Set):
        return "a set (its order is arbitrary)"
    return None


def check_text(value: str, field: str) -> None:
    """Refuse a string holding a lone UTF-16 surrogate (``"\\ud800"``).

    A JSON ``\\ud800`` escape without its pair, or an undecodable byte of a command line, gives
    Python such a string; no tokenizer can encode it and no UTF-8 file can hold it, so it is
    refused where it is read rather than deep in a library.

    Parameters
    ----------
    value
        The text to check.
    field
        How messages name it (``"'prompt'"``, ``"prompts[0]"``).

    Raises
    ------
    ValueError
        Naming ``field``, the surrogate and its position (a character index).
    """
    try:
        value.encode("utf-8")  # in C: only a lone surrogate fails to encode
    except UnicodeEncodeError as error:
        raise ValueError(
            f"{field} holds a lone surrogate {value[error.start]!r} at character {error.start} "
            "(half of a UTF-16 pair: not valid Unicode text)"
        ) from None


def check_field_types(settings: object) -> None:
    """Every dataclass field of ``settings`` holds a value of its annotated type.

    Ints must be integers (not floats or bools), bools bools, strings strings; a float field
    also takes an integer; ``X | None`` also takes ``None``. A number or bool of another type
    (numpy's ``float32(0.5)``, ``int64(2)``, ``bool_(True)``) is stored as the Python int,
    float or bool it equals, so the settings compare, print and serialize as if it had been
    written in Python (``settings`` is a dataclass, frozen or not, checked in its
    ``__post_init__``).
    """
    for name, allowed in _field_types(type(settings)):
        value = getattr(settings, name)  # a declared dataclass field, read by name
        if not any(_is_instance(value, kind) for kind in allowed):
            wanted = " or ".join(_TYPE_NAMES.get(kind, kind.__name__) for kind in allowed)
            raise ValueError(f"{name}={value!r} must be {wanted}")
        plain = _plain(value)
        if plain is not value:
            object.__setattr__(settings, name, plain)  # frozen: set once, while validating


def _plain(value: object) -> object:
    """The Python bool, int or float a numpy scalar equals; ``value`` itself otherwise."""
    if type(value) in (bool, int, float):
        return value
    if is_bool(value):
        return bool(value)
    if _is_real(value):
        return int(value) if isinstance(value, Integral) else float(value)
    return value


@cache
def _field_types(cls: type) -> tuple[tuple[str, tuple[type, ...]], ...]:
    hints = get_type_hints(cls)
    result = []
    for item in fields(cls):
        hint = hints[item.name]
        union = get_origin(hint) in (Union, types.UnionType)
        result.append((item.name, get_args(hint) if union else (hint,)))
    return tuple(result)


def _is_instance(value: object, kind: type) -> bool:
    if kind is type(None):
        return value is None
    if kind is bool:
        return is_bool(value)
    if kind is float:
        return _is_real(value)
    if kind is int:
        return _is_integral(value)
    return isinstance(value, kind) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _is_integral(value: object) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)
