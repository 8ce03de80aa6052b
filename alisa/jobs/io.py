"""Batch-job files: validated JSONL requests in, atomically appended JSONL results out."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from alisa.jsonl import iter_jsonl

ROW_OPTIONS = {
    "max_new_tokens": int,
    "do_sample": bool,
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "seed": int,
}


@dataclass(frozen=True, kw_only=True)
class Request:
    """One prompt of a job, with its optional generation options."""

    id: str | int
    prompt: str
    options: dict = field(default_factory=dict)
    line: int = 0


def read_requests(path: str | Path) -> list[Request]:
    """Parse and validate an input JSONL file; every problem names the file and the line.

    Raises
    ------
    ValueError
        Malformed JSON, a row that is not an object, a missing/empty ``prompt``, an ``id`` that
        is not a string or integer, a duplicate ``id``, an unknown or mistyped option.
    """
    file = Path(path)
    requests, seen = [], {}
    for number, row in iter_jsonl(file):
        where = f"{file}:{number}"
        identifier = row.get("id")
        if isinstance(identifier, bool) or not isinstance(identifier, str | int):
            raise ValueError(f"{where}: 'id' must be a string or an integer, got {identifier!r}")
        if identifier in seen:
            raise ValueError(
                f"{where}: duplicate id {identifier!r} (first on line {seen[identifier]})"
            )
        seen[identifier] = number
        prompt = row.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"{where}: missing or empty 'prompt' for id {identifier!r}")
        options = {}
        for key, value in row.items():
            if key in ("id", "prompt"):
                continue
            if key not in ROW_OPTIONS:
                raise ValueError(
                    f"{where}: unknown option {key!r}; known: {', '.join(ROW_OPTIONS)}"
                )
            kind = ROW_OPTIONS[key]
            if not _is_kind(value, kind):
                raise ValueError(f"{where}: option {key}={value!r} must be {kind.__name__}")
            options[key] = value
        requests.append(Request(id=identifier, prompt=prompt, options=options, line=number))
    return requests


def _is_kind(value, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    return isinstance(value, int | float) if kind is float else isinstance(value, kind)


class OutputLog:
    """Append-only JSONL results that survive ``kill -9``.

    Each row is one ``write`` of a whole line on an ``O_APPEND`` descriptor, then ``fsync``: a
    killed process leaves complete lines (a write to a regular file is not interrupted by a
    signal). A torn last line (power loss) is cut off when the log is reopened, so resuming
    never duplicates or corrupts a row.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.done: set = set()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._repair()
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as error:
            raise ValueError(f"cannot write output {str(self.path)!r}: {error.strerror}") from None

    def _repair(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        complete = data[: data.rfind(b"\n") + 1]
        if len(complete) != len(data):  # a torn last line: drop it, it will be redone
            with self.path.open("r+b") as handle:
                handle.truncate(len(complete))
        for number, line in enumerate(complete.decode("utf-8").splitlines(), start=1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise ValueError(
                    f"{self.path}:{number}: malformed JSON in the output log"
                ) from None
            self.done.add(row.get("id"))

    def append(self, row: dict) -> None:
        """Write one result row durably."""
        os.write(self.fd, (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))
        os.fsync(self.fd)
        self.done.add(row["id"])

    def close(self) -> None:
        os.close(self.fd)
