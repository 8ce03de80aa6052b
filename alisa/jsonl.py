"""JSON Lines reading with errors that name the file and the line."""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterable, Iterator
from functools import partial
from pathlib import Path

from alisa.sizes import format_bytes

# The longest line read as a row: an input that never ends a line (``/dev/zero``, a binary
# file) is refused here instead of being read into memory until it runs out.
MAX_LINE_BYTES = 64 * 1024**2


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) for every non-blank line, read line by line as it comes.

    The file is opened once and read once, so a pipe, a FIFO or ``/dev/stdin`` works too.

    Raises
    ------
    ValueError
        An unreadable file, or a line that is not UTF-8, not JSON, not an object or gives a
        key twice (``file:line: ...``).
    """
    file = Path(path)
    try:
        handle = file.open("rb")
    except OSError as error:
        raise ValueError(f"cannot read {str(file)!r}: {error.strerror}") from None
    with handle:
        try:
            yield from parse_jsonl(handle, str(file))
        except OSError as error:  # a read that fails midway (a device error, a directory)
            raise ValueError(f"cannot read {str(file)!r}: {error.strerror}") from None


def parse_jsonl(lines: Iterable[bytes], name: str) -> Iterator[tuple[int, dict]]:
    """(line number, object) for every non-blank line of ``lines`` (the lines of a binary
    stream, each with its ``\\n``, or the stream itself), one at a time; errors say
    ``name:line: ...``.

    Raises
    ------
    ValueError
        A line that is not UTF-8, not JSON, not an object, or that gives a key twice in an
        object (JSON readers keep one of the values silently); from a stream, a line longer
        than :data:`MAX_LINE_BYTES`.
    """
    if hasattr(lines, "readline"):  # a stream: each line read up to the bound, not past it
        lines = iter(partial(lines.readline, MAX_LINE_BYTES + 1), b"")
    # Lines end at "\n" only (a binary stream splits there): str.splitlines() would also split
    # inside a JSON string at U+2028, U+0085 or a form feed, which JSON allows unescaped there.
    for number, data in enumerate(lines, start=1):
        if len(data) > MAX_LINE_BYTES and not data.endswith(b"\n"):
            raise ValueError(
                f"{name}:{number}: a line longer than {format_bytes(MAX_LINE_BYTES)} without a "
                "newline; is this a JSONL file? (one JSON object per line)"
            )
        if number == 1:
            data = data.removeprefix(codecs.BOM_UTF8)  # a byte order mark is not part of a row
        try:
            line = data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(
                f"{name}:{number}: not UTF-8 text ({error.reason} at byte {error.start})"
            ) from None
        if not line.strip():
            continue
        try:
            row, twice = _loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{name}:{number}: {_malformed(line, error)}") from None
        if not isinstance(row, dict):
            raise ValueError(f"{name}:{number}: expected a JSON object")
        if twice:
            raise ValueError(f"{name}:{number}: key {twice[0]!r} given twice{_row_id(row)}")
        yield number, row


def _malformed(line: str, error: json.JSONDecodeError) -> str:
    """Why ``line`` is not JSON: a row that ends at a ``\\r`` with another after it is a file
    whose rows are separated by ``\\r`` alone (old Mac line ends), read as one line."""
    before = line[: error.pos]
    if error.msg == "Extra data" and "\r" in before[len(before.rstrip(" \t\r\n")) :]:
        return (
            "rows are separated by '\\r' only (old Mac line ends); JSONL needs one row per "
            "line ending in '\\n' (convert with: tr '\\r' '\\n' < IN > OUT)"
        )
    return f"malformed JSON ({error.msg})"


def _loads(line: str) -> tuple[object, list[str]]:
    """``json.loads(line)`` and the keys an object of it gives more than once (``json.loads``
    alone keeps the last value of such a key and drops the others unsaid)."""
    twice: list[str] = []

    def as_dict(pairs: list[tuple[str, object]]) -> dict:
        value = dict(pairs)
        if len(value) < len(pairs):
            seen: set[str] = set()
            for key, _ in pairs:
                if key in seen:
                    twice.append(key)
                seen.add(key)
        return value

    return json.loads(line, object_pairs_hook=as_dict), twice


def _row_id(row: dict) -> str:
    """`` (id 'a')`` for a row with a string or integer ``"id"``, to find it by; else ``""``."""
    identifier = row.get("id")
    if isinstance(identifier, bool) or not isinstance(identifier, str | int):
        return ""
    return f" (id {identifier!r})"


def read_jsonl(path: str | Path) -> list[dict]:
    """Every object of a JSONL file (see :func:`iter_jsonl` for the errors)."""
    return [row for _, row in iter_jsonl(path)]
