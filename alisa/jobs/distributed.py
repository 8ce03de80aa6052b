"""One job over torchrun's ranks: torch.distributed collectives only (gloo on CPUs, NCCL on GPUs).

Rank 0 checks the files, merges parts a killed run left and tells every rank which ids are done;
each rank runs its share of the ids (:func:`alisa.jobs.parts.share`) into its own part; rank 0
merges the parts into the one output at the end. A rank that dies closes its sockets, so the others
fail at their next collective at once, and torchrun stops the rest of its ranks with SIGTERM, which
ends them with a :class:`RankError`. Ranks that finish early wait for the others on a group without
a deadline, watching each unfinished rank's heartbeat (a counter in torchrun's c10d store, bumped
per batch): a rank silent for ``timeout_s`` fails them, a slow one never does.
"""

from __future__ import annotations

import os
import secrets
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from tqdm.auto import tqdm

from alisa.jobs.parts import MARKER, parts_dir
from alisa.parallel.dist import init_from_env

WAIT_TIMEOUT_S = 1800.0  # a rank silent this long (no batch done) fails the job
NO_DEADLINE = timedelta(days=30)  # the finished ranks' wait: heartbeats bound it instead
RERUN = "rows finished so far are kept: re-run the same command to finish the missing ids"


class RankError(RuntimeError):
    """Another rank stopped (killed, failed) or the launcher stopped this one."""


def launched() -> bool:
    """Whether this process was started by torchrun (or another env:// launcher)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


@dataclass(frozen=True, kw_only=True)
class Ranks:
    """This process's place in the job."""

    rank: int
    world: int
    local_world: int  # ranks on this machine (they share its host memory)
    timeout_s: float  # how long a silent rank is waited for
    waiting: object = field(repr=False)  # gloo group without a deadline, for the final wait
    store: object = field(repr=False)  # torchrun's c10d store: counters without collectives


def _stopped(signum: int, frame) -> None:
    raise RankError(f"stopped by the launcher (signal {signum}): another rank ended first; {RERUN}")


@contextmanager
def process_group(timeout_s: float = WAIT_TIMEOUT_S) -> Iterator[Ranks]:
    """Join torchrun's group for the ``with`` block; SIGTERM then raises :class:`RankError`."""
    rank, world = init_from_env(timeout_s)
    previous = signal.signal(signal.SIGTERM, _stopped)
    try:
        waiting = dist.new_group(backend="gloo", timeout=NO_DEADLINE)
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=timeout_s),
        )
        yield Ranks(
            rank=rank,
            world=world,
            local_world=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
            timeout_s=timeout_s,
            waiting=waiting,
            store=store,
        )
    finally:
        signal.signal(signal.SIGTERM, previous)
        dist.destroy_process_group()


def _collective(function: Callable, *args):
    try:
        return function(*args)
    except RankError:
        raise
    except RuntimeError as error:  # DistBackendError and gloo's connection errors
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise RankError(f"another rank stopped or cannot be reached ({reason}); {RERUN}") from None


def from_rank0(ranks: Ranks, function: Callable[[], object]) -> object:
    """``function()`` run on rank 0, its (picklable) result on every rank.

    Raises
    ------
    ValueError
        On every rank, when ``function`` raised it on rank 0.
    """
    payload: list = [None]
    if ranks.rank == 0:
        try:
            payload = [(True, function())]
        except ValueError as error:
            payload = [(False, str(error))]
    _collective(dist.broadcast_object_list, payload, 0)
    ok, value = payload[0]
    if not ok:
        raise ValueError(value)
    return value


def on_every_rank(ranks: Ranks, function: Callable[[], object]) -> object:
    """``function()`` on every rank; a ValueError on any rank is raised on all, naming it."""
    try:
        outcome = (True, function())
    except ValueError as error:
        outcome = (False, str(error))
    outcomes = gather(ranks, outcome)
    failed = [f"rank {rank}: {value}" for rank, (ok, value) in enumerate(outcomes) if not ok]
    if failed:
        raise ValueError("; ".join(failed))
    return outcome[1]


def gather(ranks: Ranks, value: object) -> list:
    """Every rank's ``value``, in rank order, on every rank."""
    values: list = [None] * ranks.world
    _collective(dist.all_gather_object, values, value)
    return values


def new_parts(ranks: Ranks, output: Path) -> str:
    """Rank 0 makes the parts folder of ``output``; every rank checks that it sees it.

    Returns the run's token (the same on every rank; it names this run's store counters).

    Raises
    ------
    ValueError
        On every rank, when some rank cannot see the folder (the output must be on a
        filesystem every machine shares).
    """

    def make() -> str:
        token = secrets.token_hex(8)
        folder = parts_dir(output)
        try:
            folder.mkdir(exist_ok=True)
            (folder / MARKER).write_text(token)
        except OSError as error:
            raise ValueError(f"cannot write {str(folder)!r}: {error.strerror}") from None
        return token

    token = from_rank0(ranks, make)

    def check() -> None:
        marker = parts_dir(output) / MARKER
        if not marker.is_file() or marker.read_text() != token:
            raise ValueError(
                f"{str(parts_dir(output))!r} written by rank 0 is not visible here: the output "
                "must be on a filesystem every machine shares"
            )

    on_every_rank(ranks, check)
    return token


class RankProgress:
    """Every rank's heartbeat and row count in the c10d store; rank 0's bar over all ranks.

    Rows done / total across ranks without a collective (ranks run different numbers of
    batches, so per-batch collectives would not line up): each rank adds to store counters.
    """

    def __init__(self, ranks: Ranks, token: str, total: int, enabled: bool, desc: str) -> None:
        self.ranks = ranks
        self.store = dist.PrefixStore(f"alisa/{token}/", ranks.store)
        enabled = enabled and ranks.rank == 0
        self.bar = tqdm(total=total, unit="row", disable=not enabled, desc=desc)

    def update(self, count: int) -> None:
        """``count`` more rows done here (per batch): a heartbeat, and rank 0's bar moves."""
        self._store(self.store.add, f"beat/{self.ranks.rank}", 1)
        self._store(self.store.add, "rows", count)
        self.refresh()

    def refresh(self) -> None:
        if not self.bar.disable:
            self.bar.n = min(self.bar.total, self._store(self.store.add, "rows", 0))
            self.bar.refresh()

    def set_postfix(self, **values) -> None:
        self.bar.set_postfix(**values)

    def close(self) -> None:
        """This rank's rows are done; rank 0's bar goes on until :func:`finish_parts`."""

    def _store(self, function: Callable, *args):
        return _collective(function, *args)

    def wait_for_all(self, every_s: float = 0.5) -> None:
        """Wait until every rank is here; fail when an unfinished one is silent too long.

        Raises
        ------
        RankError
            Another rank died (at once: its sockets close) or sent no heartbeat for
            ``timeout_s``.
        """
        self._store(self.store.set, f"done/{self.ranks.rank}", "1")
        work = _collective(dist.barrier, self.ranks.waiting, True)  # group, async_op
        heard: dict[int, tuple[int, float]] = {}  # rank -> (heartbeats, when they last changed)
        while not work.is_completed():
            self.refresh()
            for other in range(self.ranks.world):
                if self._store(self.store.check, [f"done/{other}"]):
                    continue
                beats, now = self._store(self.store.add, f"beat/{other}", 0), time.monotonic()
                if heard.get(other, (None,))[0] != beats:
                    heard[other] = (beats, now)
                elif now - heard[other][1] > self.ranks.timeout_s:
                    raise RankError(
                        f"rank {other} did no work for {self.ranks.timeout_s:.0f} s "
                        f"(--rank-timeout); {RERUN}"
                    )
            time.sleep(every_s)
        _collective(work.wait)

    def finish(self) -> None:
        self.bar.n = self.bar.total
        self.bar.close()


def finish_parts(ranks: Ranks, bar: RankProgress, merge: Callable[[], object]) -> None:
    """Wait for every rank (rank 0 keeps its bar moving), then ``merge()`` on rank 0.

    Raises
    ------
    RankError
        Another rank stopped before it finished.
    ValueError
        On every rank, when the merge failed on rank 0.
    """
    bar.wait_for_all()
    bar.finish()
    from_rank0(ranks, merge)
