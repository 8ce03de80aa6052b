"""Evaluation data, from ``--data-dir``, ``$ALISA_DATA_DIR`` or ``../shared/data`` beside the repo.

Readers return plain Python objects and raise ``ValueError`` naming the file (and line) when the
data is missing or malformed. Nothing is copied into the repository.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA_DIR = REPO_ROOT.parent / "shared" / "data"


def data_dir(path: str | Path | None = None) -> Path:
    """The data directory: explicit path, else ``$ALISA_DATA_DIR``, else ``../shared/data``."""
    chosen = Path(path or os.environ.get("ALISA_DATA_DIR") or DEFAULT_DATA_DIR).expanduser()
    if not chosen.is_dir():
        raise ValueError(f"data directory {str(chosen)!r} does not exist (set --data-dir)")
    return chosen


def data_file(root: Path, relative: str) -> Path:
    """A file under the data directory, or a ``ValueError`` naming it."""
    path = root / relative
    if not path.is_file():
        raise ValueError(f"data file {str(path)!r} is missing")
    return path


def read_jsonl(path: Path) -> list[dict]:
    """Rows of a JSONL file; a malformed line is reported with file and line number."""
    rows = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: malformed JSON ({error.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object")
            rows.append(row)
    return rows


def load_wikitext2(root: Path) -> str:
    """WikiText-2 raw test split as one string (CRLF normalised)."""
    text = data_file(root, "wikitext2/wiki.test.raw").read_text(encoding="utf-8")
    return text.replace("\r\n", "\n")


def load_passkey(root: Path) -> list[dict]:
    """Passkey prompts (landmark-attention format): ``prompt``, ``answer``, ``depth``, ..."""
    rows = read_jsonl(data_file(root, "passkey_niah/passkey_landmark_format.jsonl"))
    for number, row in enumerate(rows, start=1):
        for key in ("prompt", "answer"):
            if key not in row:
                raise ValueError(f"passkey row {number} lacks {key!r}")
    return rows
