"""Evaluation data, from ``--data-dir``, ``$ALISA_DATA_DIR`` or ``../shared/data`` beside the repo.

Readers return plain Python objects and raise ``ValueError`` naming the file (and line) when the
data is missing or malformed. Nothing is copied into the repository.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from alisa.jsonl import read_jsonl

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA_DIR = REPO_ROOT.parent / "shared" / "data"


def data_dir(path: str | Path | None = None) -> Path:
    """The data directory: explicit path, else ``$ALISA_DATA_DIR``, else ``../shared/data``.

    Raises
    ------
    ValueError
        The chosen path is missing or not a directory (named, with how to give another).
    """
    chosen = Path(path or os.environ.get("ALISA_DATA_DIR") or DEFAULT_DATA_DIR).expanduser()
    if not chosen.is_dir():
        problem = "does not exist" if not chosen.exists() else "is not a directory"
        problem = "is a file, not a directory" if chosen.is_file() else problem
        raise ValueError(
            f"data directory {str(chosen)!r} {problem}: pass --data-dir PATH of the folder "
            "holding the data (or runtime.data_dir in an experiment config) or set "
            "$ALISA_DATA_DIR"
        )
    return chosen


def data_file(root: Path, relative: str) -> Path:
    """A file under the data directory, or a ``ValueError`` naming it."""
    path = root / relative
    if not path.is_file():
        raise ValueError(f"data file {str(path)!r} is missing")
    return path


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


def load_niah(root: Path) -> list[dict]:
    """RULER single-needle prompts: ``input``, ``answer_prefix``, ``outputs``, ``depth``."""
    rows = read_jsonl(data_file(root, "passkey_niah/ruler_niah_single_1_noise.jsonl"))
    for number, row in enumerate(rows, start=1):
        for key in ("input", "answer_prefix", "outputs"):
            if key not in row:
                raise ValueError(f"NIAH row {number} lacks {key!r}")
    return rows


def load_piqa(root: Path) -> list[dict]:
    """PIQA validation: ``goal``, ``choices`` (2), ``label``."""
    rows = read_jsonl(data_file(root, "piqa/valid.jsonl"))
    labels_path = data_file(root, "piqa/valid-labels.lst")
    labels = [line.strip() for line in labels_path.read_text().splitlines() if line.strip()]
    if len(labels) != len(rows):
        raise ValueError(f"{labels_path}: {len(labels)} labels for {len(rows)} PIQA rows")
    return [
        {
            "context": f"Question: {r['goal']}\nAnswer:",
            "choices": [" " + r["sol1"], " " + r["sol2"]],
            "label": int(label),
        }
        for r, label in zip(rows, labels, strict=True)
    ]


def load_copa(root: Path) -> list[dict]:
    """COPA validation in lm-evaluation-harness form: premise + because/therefore + choice."""
    rows = read_jsonl(data_file(root, "copa/superglue_COPA_val.jsonl"))
    examples = []
    for row in rows:
        connector = {"cause": "because", "effect": "therefore"}[row["question"]]
        context = row["premise"].strip().rstrip(".") + f" {connector}"
        choices = [" " + c[0].lower() + c[1:] for c in (row["choice1"], row["choice2"])]
        examples.append({"context": context, "choices": choices, "label": int(row["label"])})
    return examples


def load_xsum(root: Path) -> list[dict]:
    """H2O's 0-shot XSum prompts: ``article`` (ready prompt) and ``summary_gt``."""
    return read_jsonl(data_file(root, "xsum/h2o_xsum_0shot.jsonl"))


def build_prompts(tokenizer, root: Path, count: int, low: int, high: int, path: Path) -> None:
    """Write ``count`` batch-job rows to ``path``: XSum articles cut to lengths spread evenly
    over [low, high] tokens, each followed by ``Summary:``."""
    rows = load_xsum(root)
    with path.open("w") as handle:
        for index in range(count):
            ids = tokenizer(rows[index % len(rows)]["article"])["input_ids"]
            length = low + (high - low) * index // max(1, count - 1)
            prompt = tokenizer.decode(ids[:length]) + "\nSummary:"
            handle.write(json.dumps({"id": index, "prompt": prompt}) + "\n")


def load_text(root: Path | None, path: str | None) -> tuple[str, str]:
    """(text, source): the UTF-8 text file at ``path`` (a user's corpus: a RULER haystack,
    benchmark prompts), else WikiText-2's test split under ``root``.

    Raises
    ------
    ValueError
        The file is missing, unreadable or not UTF-8 (named).
    """
    if path is None:
        if root is None:
            raise ValueError("no text: give a text file or a data directory")
        return load_wikitext2(root), "WikiText-2 (wikitext2/wiki.test.raw)"
    file = Path(path).expanduser()
    try:
        return file.read_text(encoding="utf-8"), str(file)
    except FileNotFoundError:
        raise ValueError(f"text file {str(file)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"text file {str(file)!r} cannot be read: {error}") from None
