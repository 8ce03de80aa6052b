"""Per-rank parts of one JSONL output: which rank owns an id, and merging parts into the output.

A job run by several processes writes ``OUT.parts/rank-K.jsonl`` (an :class:`OutputLog` each)
and merges them into ``OUT`` at the end; a job that was killed leaves its parts, and the next run
(any number of ranks, or one process) merges them first. Nothing here needs torch.distributed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from alisa.jobs.io import OutputLog

MARKER = "run"  # names the run that owns the parts folder (the shared-filesystem check)


def parts_dir(output: str | Path) -> Path:
    """The folder of per-rank parts beside ``output`` (``out.jsonl`` -> ``out.jsonl.parts``)."""
    output = Path(output)
    return output.with_name(output.name + ".parts")


def part_path(output: str | Path, rank: int) -> Path:
    """Rank ``rank``'s part of ``output``."""
    return parts_dir(output) / f"rank-{rank}.jsonl"


def owner(identifier: str | int, world: int) -> int:
    """The rank (0 .. world-1) that runs ``identifier``: a stable hash, the same in every process.

    Python's ``hash`` is salted per process; BLAKE2 of the JSON form is not (and keeps the
    integer id 1 apart from the string id "1").
    """
    digest = hashlib.blake2b(json.dumps(identifier).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % world


def merge_parts(log: OutputLog) -> int:
    """Append the rows of every part of ``log`` whose id is not done yet; delete merged parts.

    Safe to interrupt at any point: a part is deleted only after its rows are durably in the
    output, and a repeated merge skips the ids already there. Returns the rows appended.
    """
    folder = parts_dir(log.path)
    if not folder.is_dir():
        return 0
    merged = 0
    for part in sorted(folder.glob("rank-*.jsonl")):
        source = OutputLog(part, keys=log.keys)  # validated; our torn last row cut off
        source.close()
        fresh, seen = [], set(log.done)
        for row in source.rows():
            if "error" not in row and row["id"] not in seen:
                fresh.append(row)
                seen.add(row["id"])
        log.extend(fresh)
        merged += len(fresh)
        part.unlink()
    (folder / MARKER).unlink(missing_ok=True)
    if not any(folder.iterdir()):  # never remove a folder holding files that are not ours
        folder.rmdir()
    return merged
