"""Per-rank parts of one JSONL output: which rank owns an id, and merging parts into the output.

A job run by several processes writes ``OUT.parts/rank-K.jsonl`` (an :class:`OutputLog` each)
and merges them into ``OUT`` at the end; a job that was killed leaves its parts, and the next run
(any number of ranks, or one process) merges them first. Nothing here needs torch.distributed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from alisa.jobs.io import OutputLog

T = TypeVar("T")
MARKER = "run"  # names the run that owns the parts folder (the shared-filesystem check)


def parts_dir(output: str | Path) -> Path:
    """The folder of per-rank parts beside ``output`` (``out.jsonl`` -> ``out.jsonl.parts``)."""
    output = Path(output)
    return output.with_name(output.name + ".parts")


def part_path(output: str | Path, rank: int) -> Path:
    """Rank ``rank``'s part of ``output``."""
    return parts_dir(output) / f"rank-{rank}.jsonl"


def _digest(identifier: str | int) -> bytes:
    # Python's ``hash`` is salted per process; BLAKE2 of the JSON form is not (and keeps the
    # integer id 1 apart from the string id "1").
    return hashlib.blake2b(json.dumps(identifier).encode("utf-8"), digest_size=8).digest()


def share(
    items: Sequence[T],
    world: int,
    rank: int,
    *,
    key: Callable[[T], str | int],
    cost: Callable[[T], float] = lambda item: 0.0,
) -> list[T]:
    """Rank ``rank``'s share of ``items``: the same split in every process, balanced.

    Items are sorted by ``cost`` (largest first; ties by a stable hash of ``key``) and dealt to
    the ranks in snake order (0, 1, .., w-1, w-1, .., 0, ...), so every rank gets the same count
    within one and about the same total cost: a job's slowest rank sets its time. Every rank
    computes the split from the same pending items, so a re-run with another world size splits
    what is left.
    """
    order = sorted(items, key=lambda item: (-cost(item), _digest(key(item))))
    mine = []
    for index, item in enumerate(order):
        turn, place = divmod(index, world)
        if (place if turn % 2 == 0 else world - 1 - place) == rank:
            mine.append(item)
    return mine


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
