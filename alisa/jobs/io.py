"""Batch-job files: validated JSONL requests in, atomically appended JSONL results out."""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from alisa.checks import check_text
from alisa.jsonl import iter_jsonl, parse_jsonl

logger = logging.getLogger(__name__)

ROW_OPTIONS = {
    "max_new_tokens": int,
    "do_sample": bool,
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "seed": int,
}
OPTION_KEYS = ("chat", *ROW_OPTIONS)  # what a row may set besides its id and prompt
ROW_KEYS = ("id", "prompt", *OPTION_KEYS)


@dataclass(frozen=True, kw_only=True)
class Request:
    """One prompt of a job, with its optional generation options."""

    id: str | int
    prompt: str
    options: dict = field(default_factory=dict)
    line: int = 0
    chat: bool | None = None  # the row's "chat": wrap in the chat template; None: the job's choice


STDIN = "-"  # the input name that reads the rows from standard input


def input_name(path: str | Path) -> str:
    """How messages name an input: its path, or ``stdin`` for ``-``."""
    return "stdin" if str(path) == STDIN else str(path)


def read_requests(path: str | Path) -> list[Request]:
    """Parse and validate an input JSONL file; every problem names the file, the line and the id.

    The input (``-``: standard input) is read once, line by line as it comes, so a pipe, a
    FIFO or ``/dev/stdin`` gives its rows like a file.

    Raises
    ------
    ValueError
        Malformed JSON, a row that is not an object or gives a key twice, a ``prompt`` that is
        not a non-empty string, a ``chat`` that is not a boolean, a missing ``id`` or one that
        is not a string or integer (or an empty or blank string), a duplicate ``id``, an
        ``id`` or ``prompt`` holding a lone surrogate (a ``\\ud800`` escape without its pair),
        an unknown, mistyped or out-of-range option (same rules as the matching flag).
    """
    name = input_name(path)
    rows = parse_jsonl(sys.stdin.buffer, name) if str(path) == STDIN else iter_jsonl(path)
    requests, seen = [], {}
    for number, row in rows:
        where = f"{name}:{number}"
        if "id" not in row:
            raise ValueError(f"{where}: missing 'id' (a string or an integer){_unknown_keys(row)}")
        identifier = row["id"]
        if isinstance(identifier, bool) or not isinstance(identifier, str | int):
            raise ValueError(f"{where}: 'id' must be a string or an integer, got {identifier!r}")
        if isinstance(identifier, str):  # written back to the UTF-8 output: must be valid text
            if not identifier.strip():  # a row no one could find in the output, or resume
                raise ValueError(
                    f"{where}: 'id' is {'empty' if not identifier else 'blank'} "
                    f"({identifier!r}); give every row a non-empty id (a string or an integer)"
                )
            _check_row_text(identifier, "'id'", where, "")
        if identifier in seen:
            raise ValueError(
                f"{where}: duplicate id {identifier!r} (first on line {seen[identifier]})"
            )
        seen[identifier] = number
        prompt = row.get("prompt")
        if "prompt" in row and not isinstance(prompt, str):
            raise ValueError(
                f"{where}: 'prompt' must be a string, got {prompt!r} for id {identifier!r}"
            )
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(
                f"{where}: missing or empty 'prompt' for id {identifier!r}{_unknown_keys(row)}"
            )
        _check_row_text(prompt, "'prompt'", where, f" (id {identifier!r})")
        chat = row.get("chat")
        if chat is not None and not isinstance(chat, bool):
            raise ValueError(
                f"{where}: 'chat' must be true or false, got {chat!r} (id {identifier!r})"
            )
        options = {k: v for k, v in row.items() if k not in ("id", "prompt", "chat")}
        _check_options(options, where, f" (id {identifier!r})")
        requests.append(
            Request(id=identifier, prompt=prompt, options=options, line=number, chat=chat)
        )
    return requests


def _unknown_keys(row: dict) -> str:
    """A note naming ``row``'s unknown keys, for a message about a missing one: ``"ID"`` or
    ``"Prompt"`` is the key the user meant, spelt otherwise."""
    unknown = [key for key in row if key not in ROW_KEYS]
    if not unknown:
        return ""
    names = ", ".join(map(repr, unknown))
    verb = "is an unknown key" if len(unknown) == 1 else "are unknown keys"
    return f"; {names} {verb} (keys are case-sensitive; known: {', '.join(ROW_KEYS)})"


def _check_row_text(text: str, key: str, where: str, which: str) -> None:
    """:func:`~alisa.checks.check_text` of a row's ``key``, its message saying where."""
    try:
        check_text(text, key)
    except ValueError as error:
        raise ValueError(f"{where}: {error}{which}") from None


def defaulted(requests: list[Request]) -> list[Request]:
    """The requests that set no ``max_new_tokens`` of their own: they take the job's."""
    return [r for r in requests if "max_new_tokens" not in r.options]


SAMPLING_KEYS = ("temperature", "top_k", "top_p", "seed")


def warn_ignored_sampling(requests: list[Request], path: str | Path) -> None:
    """One log line for the rows whose sampling options (their own or the job's) greedy
    decoding ignores: rows with no ``"do_sample": true`` of their own nor from the job."""
    greedy = [
        r
        for r in requests
        if not r.options.get("do_sample") and any(k in r.options for k in SAMPLING_KEYS)
    ]
    if greedy:
        first = greedy[0]
        logger.warning(
            '%s: %d row(s) set %s (in the row or by the job\'s flags) without "do_sample": true; '
            "they decode greedily and ignore them (first: line %d, id %r)",
            input_name(path),
            len(greedy),
            "/".join(SAMPLING_KEYS),
            first.line,
            first.id,
        )


def _check_options(options: dict, where: str, which: str) -> None:
    """Types and ranges of a row's options, with the rules of the flags they override."""
    from alisa.runtime.generate import SamplingOptions

    for key, value in options.items():
        if key not in ROW_OPTIONS:
            raise ValueError(
                f"{where}: unknown option {key!r}{which}; known: {', '.join(OPTION_KEYS)}"
            )
        kind = ROW_OPTIONS[key]
        if not _is_kind(value, kind):
            raise ValueError(f"{where}: option {key}={value!r} must be {kind.__name__}{which}")
    new_tokens = options.get("max_new_tokens", 1)
    if new_tokens < 1:  # as --max-new-tokens: a row must generate something
        raise ValueError(f"{where}: option max_new_tokens={new_tokens!r} must be >= 1{which}")
    try:
        SamplingOptions(**{k: v for k, v in options.items() if k != "max_new_tokens"})
    except ValueError as error:
        raise ValueError(f"{where}: option {error}{which}") from None


def _is_kind(value, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    return isinstance(value, int | float) if kind is float else isinstance(value, kind)


# Every row we write starts like this (json.dumps of a dict whose first key is "id").
ROW_START = b'{"id": '


class OutputLog:
    """Append-only JSONL results that survive ``kill -9``.

    Each row is one ``write`` of a whole line on an ``O_APPEND`` descriptor, then ``fsync``: a
    killed process leaves complete lines (a write to a regular file is not interrupted by a
    signal). On reopening, every complete line must be a JSON object with ``keys`` (else the
    file is not ours and is left untouched); a torn last line (power loss, a full disk) is cut
    off only when it provably is our partial row: it starts as our rows do and follows at least
    one complete row of ours (a file holding only an unterminated line is nobody's proven output:
    refused, never cut). So resuming never duplicates or corrupts a row and never deletes
    anything else. Ids of rows without an ``"error"`` are done; failed rows are retried.
    """

    def __init__(
        self, path: str | Path, keys: tuple[str, ...] = ("id",), settings: dict | None = None
    ) -> None:
        self.path = Path(path)
        self.keys = keys
        self.done: set = set()
        # What decides the tokens of every row (``job_settings``), written into each row
        # appended with the row's own (``own_settings``), and the settings each done row
        # already there was made with, by id (older rows: none).
        self.settings = settings
        self.made: dict = {}
        self.cut_bytes = 0  # of our torn last row, cut off on opening (said by the summary)
        check_output_file(self.path)
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
        complete, tail = data[: data.rfind(b"\n") + 1], data[data.rfind(b"\n") + 1 :]
        for number, line in enumerate(complete.split(b"\n")[:-1], start=1):
            if line.strip():
                self._add(self._row(line, number))
        if not tail.strip():
            return
        last = complete.count(b"\n") + 1  # the tail's line number
        if _parses(tail):  # a whole line that only lacks its newline: keep it
            self._add(self._row(tail, last))
            with self.path.open("ab") as handle:
                handle.write(b"\n")
        elif tail.startswith(ROW_START) and complete.strip():
            # Our torn row (the rows before it are ours): drop it, it will be redone.
            with self.path.open("r+b") as handle:
                handle.truncate(len(complete))
            self.cut_bytes = len(tail)
        elif tail.startswith(ROW_START):
            # Nothing before it proves the file ours: a user's line may start like our rows.
            raise ValueError(
                f"{self.path}:{last}: an unterminated line that is not a "
                "whole JSON row, and no complete results row before it proves the file is an "
                "alisa output; if alisa was writing it when it stopped, delete the file "
                "(nothing was changed)"
            )
        else:
            self._row(tail, last)  # raises: not ours, nothing changed

    def _row(self, line: bytes, number: int) -> dict:
        where = f"{self.path}:{number}"
        if not _parses(line):
            raise ValueError(
                f"{where}: not a JSON line; is this the right output file? (nothing was changed)"
            )
        row = json.loads(line.decode("utf-8"))
        if not isinstance(row, dict) or any(key not in row for key in self.keys):
            raise ValueError(
                f"{where}: not a results row (a JSON object with {', '.join(map(repr, self.keys))}"
                "); is this the right output file? (nothing was changed)"
            )
        return row

    def _add(self, row: dict) -> None:
        if "error" not in row:
            self.done.add(row["id"])
            made = row.get("settings")
            if isinstance(made, dict):
                self.made[row["id"]] = made

    @property
    def made_with(self) -> list[dict]:
        """The distinct settings the done rows were made with."""
        distinct: list[dict] = []
        for made in self.made.values():
            if made not in distinct:
                distinct.append(made)
        return distinct

    def record(self, settings: dict) -> None:
        """Write ``settings`` into every row appended from now on (:meth:`append`)."""
        self.settings = settings

    def append(self, row: dict, own: dict | None = None) -> None:
        """Write one result row durably (``ValueError`` naming the path when it fails), with
        the log's ``settings`` and the row's ``own`` (``alisa.jobs.runner.own_settings``; both
        plain JSON values) when the log has settings and the row has none (a merged part's row
        keeps its own)."""
        if self.settings is not None and "settings" not in row:
            row = {**row, "settings": {**self.settings, **(own or {})}}
        self._write(_line(row))
        self._add(row)

    def _write(self, data: bytes) -> None:
        try:
            while data:  # a short write (a full disk) must not leave half a row behind silently
                data = data[os.write(self.fd, data) :]
            os.fsync(self.fd)
        except OSError as error:
            raise ValueError(
                f"cannot write output {str(self.path)!r}: {error.strerror}; the complete rows "
                "already there are kept and a re-run resumes after them"
            ) from None

    def extend(self, rows: list[dict], chunk_bytes: int = 1 << 20) -> None:
        """Write many rows durably, a chunk of whole lines per ``write`` + ``fsync``.

        A kill mid-chunk leaves complete lines and at most one torn row of ours (cut off on
        reopening), so a caller that skips ids already :attr:`done` can simply redo the rest.
        """
        lines = [_line(row) for row in rows]
        start = 0
        while start < len(lines):
            end, size = start, 0
            while end < len(lines) and (end == start or size < chunk_bytes):
                size, end = size + len(lines[end]), end + 1
            self._write(b"".join(lines[start:end]))
            for row in rows[start:end]:
                self._add(row)
            start = end

    def rows(self) -> list[dict]:
        """Every complete row of the file, in order (the file as repaired on opening)."""
        data = self.path.read_bytes()
        return [json.loads(line) for line in data.split(b"\n") if line.strip()]

    def close(self) -> None:
        os.close(self.fd)


def failures_path(output: str | Path) -> Path:
    """Where a batch job lists the rows that failed (``out.jsonl`` -> ``out.jsonl.failed``)."""
    output = Path(output)
    return output.with_name(output.name + ".failed")


# Every row of a failures file has these (alisa writes nothing else there).
FAILURE_KEYS = ("id", "finish_reason", "error")


def check_failures_file(output: str | Path) -> None:
    """Refuse when ``output``'s failures file exists but is not one alisa wrote.

    A run replaces or removes that file; only alisa's own list may be.

    Raises
    ------
    ValueError
        Naming the file: it is not a list of failed rows (nothing was changed).
    """
    path = failures_path(output)
    if not path.exists() or _is_failures_file(path):
        return
    raise ValueError(
        f"{str(path)!r} exists and is not a failures list alisa wrote (a run replaces or removes "
        "that file); move it away or choose another output (nothing was changed)"
    )


def _is_failures_file(path: Path) -> bool:
    try:
        data = path.read_bytes()
    except OSError:
        return False
    if not data.endswith(b"\n"):  # written whole, atomically: never torn
        return False
    for line in data.split(b"\n")[:-1]:
        if not _parses(line):
            return False
        row = json.loads(line.decode("utf-8"))
        if not isinstance(row, dict) or any(key not in row for key in FAILURE_KEYS):
            return False
    return True


def write_failures(output: str | Path, rows: list[dict]) -> Path:
    """Replace the failures file of ``output`` with ``rows`` (atomically); none: remove it.

    The list is of the last run only: the rows a re-run will retry. A file of that name that
    alisa did not write is never replaced nor removed.

    Raises
    ------
    ValueError
        The failures file exists but is not one alisa wrote.
    """
    path = failures_path(output)
    check_failures_file(output)
    if not rows:
        path.unlink(missing_ok=True)
        return path
    # A temporary name of our own: never a user's file that happens to be called OUT.failed.tmp.
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(b"".join(_line(row) for row in rows))
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def check_output_file(output: str | Path) -> None:
    """Refuse (``ValueError`` naming the path) an output that is not a regular file: results are
    appended, synced and re-read to resume, which a directory or ``/dev/null`` cannot do."""
    path, typed = Path(output), str(output)
    if path.is_dir():
        raise ValueError(
            f"cannot write output {typed!r}: it is a directory; give a file path, e.g. "
            f"{os.path.join(typed, 'out.jsonl')!r}"
        )
    if os.path.basename(typed) in ("", ".", ".."):  # "out/": Path() would drop the slash
        raise ValueError(
            f"cannot write output {typed!r}: a path ending in '/', '.' or '..' names a "
            f"directory; give a file path, e.g. {os.path.join(typed, 'out.jsonl')!r}"
        )
    if path.exists() and not path.is_file():
        raise ValueError(
            f"cannot write output {str(output)!r}: not a regular file (results are appended, "
            "synced and re-read to resume); give a file path"
        )


def _line(row: dict) -> bytes:
    return (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8")


def _parses(line: bytes) -> bool:
    try:
        json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    return True


def same_file(first: str | Path, second: str | Path) -> bool:
    """Whether two paths name one file (links and ``..`` resolved; a missing file is new)."""
    one, two = Path(first), Path(second)
    if one.exists() and two.exists():
        return one.samefile(two)
    return one.resolve() == two.resolve()
