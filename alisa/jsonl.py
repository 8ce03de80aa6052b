"""JSON Lines reading with errors that name the file and the line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) for every non-blank line.

    Raises
    ------
    ValueError
        An unreadable file, or a line that is not JSON or not an object (``file:line: ...``).
    """
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8-sig")  # a byte order mark is not part of a row
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"cannot read {str(file)!r}: {error}") from None
    # Lines end at "\n" only: str.splitlines() would also split inside a JSON string at U+2028,
    # U+0085 or a form feed, which JSON allows unescaped there.
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{file}:{number}: malformed JSON ({error.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{file}:{number}: expected a JSON object")
        yield number, row


def read_jsonl(path: str | Path) -> list[dict]:
    """Every object of a JSONL file (see :func:`iter_jsonl` for the errors)."""
    return [row for _, row in iter_jsonl(path)]
