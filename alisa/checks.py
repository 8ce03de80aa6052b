"""Checks shared by the frozen settings dataclasses (``AlisaConfig``, the KV policies).

Each raises ``ValueError`` naming the field and the value, as every config of the project does.
"""

from __future__ import annotations

import math
import types
from dataclasses import fields
from functools import cache
from typing import Union, get_args, get_origin, get_type_hints

_TYPE_NAMES = {
    bool: "a bool",
    int: "an integer",
    float: "a number",
    str: "a string",
    type(None): "None",
}


def check_number(name: str, value: object) -> None:
    """``value`` is a finite int or float (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r} must be a finite number")


def check_optional_int(name: str, value: object, *, minimum: int) -> None:
    """``value`` is ``None`` or an int (not a bool) of at least ``minimum``."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")


def check_field_types(settings: object) -> None:
    """Every dataclass field of ``settings`` holds a value of its annotated type.

    Ints must be ints (not floats or bools), bools bools, strings strings; a float field also
    takes an int; ``X | None`` also takes ``None``.
    """
    for name, allowed in _field_types(type(settings)):
        value = getattr(settings, name)  # a declared dataclass field, read by name
        if not any(_is_instance(value, kind) for kind in allowed):
            wanted = " or ".join(_TYPE_NAMES.get(kind, kind.__name__) for kind in allowed)
            raise ValueError(f"{name}={value!r} must be {wanted}")


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
        return isinstance(value, bool)
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, kind) and not isinstance(value, bool)
