"""``key=value`` text -> typed dataclass field values: the one parser of every ``--set``.

The value is read by the annotation of the field it sets: ``None``/``none``/``null`` for an
optional field, a byte size (``2GiB``, ``512MB``, via :func:`alisa.sizes.parse_bytes`) for a
field that takes ``int | str`` sizes, ``true``/``false`` for a flag, else an int, a float or the
text. ``alisa:`` system names and run configs' ``--set sweep.FIELD=VALUE`` use it.
"""

from __future__ import annotations

import types
import typing
from dataclasses import fields
from functools import cache

from alisa.sizes import parse_bytes

NONE_WORDS = ("none", "null")
TRUE_WORDS = ("true", "yes", "on", "1")
FALSE_WORDS = ("false", "no", "off", "0")


def parse_field(cls: type, key: str, text: str) -> object:
    """The value of ``cls``'s field ``key`` that ``text`` spells.

    Parameters
    ----------
    cls
        A dataclass (e.g. :class:`~alisa.config.AlisaConfig`) whose annotations type the value.
    key
        The field's name.
    text
        The value as written; surrounding whitespace and, for text fields, quotes are dropped.

    Raises
    ------
    ValueError
        An unknown key (the message lists the valid ones) or a value the field's type cannot
        take (the message names the key and the value).
    """
    kinds = _field_kinds(cls).get(key)
    if kinds is None:
        valid = ", ".join(_field_kinds(cls))
        raise ValueError(f"unknown {cls.__name__} field {key!r}; valid: {valid}")
    raw = text.strip()
    word = raw.lower()
    if word in NONE_WORDS and type(None) in kinds:
        return None
    if int in kinds and str in kinds:  # a byte size: 2GiB, 512MB or a plain count
        return parse_bytes(raw, field=key)
    if bool in kinds:
        if word in TRUE_WORDS or word in FALSE_WORDS:
            return word in TRUE_WORDS
        raise ValueError(f"{key}={raw!r} must be true or false")
    if int in kinds:
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{key}={raw!r} must be an integer") from None
    if float in kinds:
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"{key}={raw!r} must be a number") from None
    if str in kinds:
        return _unquoted(raw)
    raise ValueError(f"{key}={raw!r}: {cls.__name__}.{key} cannot be set from text")


def parse_assignment(cls: type, item: str) -> tuple[str, object]:
    """``"key=value"`` -> ``(key, typed value)`` of a ``cls`` field (see :func:`parse_field`).

    Raises
    ------
    ValueError
        No ``=`` or no key, an unknown key, or a bad value (the message names them).
    """
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"{item!r} must be key=value")
    key = key.strip()
    return key, parse_field(cls, key, text)


def parse_assignments(cls: type, items: list[str]) -> dict[str, object]:
    """Several ``key=value`` items (a later one wins) -> field values of ``cls``."""
    return dict(parse_assignment(cls, item) for item in items)


@cache
def _field_kinds(cls: type) -> dict[str, tuple[type, ...]]:
    """Field name -> the types its annotation admits (``X | None`` -> (X, NoneType))."""
    hints = typing.get_type_hints(cls)
    result = {}
    for item in fields(cls):
        hint = hints[item.name]
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        result[item.name] = typing.get_args(hint) if union else (hint,)
    return result


def _unquoted(text: str) -> str:
    """Text without one pair of surrounding quotes (``'swa'`` as TOML would have read it)."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text
