"""How many torch threads a command computes with: the CPUs this process may use, less the ones
other work keeps busy.

torch starts one thread per core it sees. On a machine that is busy, or in a container whose
CPU quota is below the cores it can see, those threads wait for each other at every operator's
barrier: the README's quickstart took 3-4.75 min with torch's 2 threads and 25 s with 1 on a
2-core machine running other work. The default therefore counts only the CPUs this process
may run on (affinity and the cgroup's quota) and leaves out what the load average says others
are using; ``--threads`` overrides it.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

CGROUP_V2_QUOTA = Path("/sys/fs/cgroup/cpu.max")
CGROUP_V1_QUOTA = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
CGROUP_V1_PERIOD = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")
# The kernel's limits on the threads a process can start (Linux; elsewhere none is known).
MAX_MAP_COUNT = Path("/proc/sys/vm/max_map_count")
THREADS_MAX = Path("/proc/sys/kernel/threads-max")
CGROUP_PIDS_MAX = Path("/sys/fs/cgroup/pids.max")
# OS threads one torch thread may cost: torch's OpenMP pool and MKL's each start that many
# (measured: set_num_threads(500) then a matmul runs 1000 threads).
POOLS = 2


@dataclass(frozen=True, kw_only=True)
class ThreadChoice:
    """The thread count a command uses and what it was chosen from.

    Attributes
    ----------
    threads
        torch intra-op threads.
    usable_cpus
        CPUs this process may use: its affinity mask, capped by the cgroup's CPU quota.
    load
        One-minute load average (runnable tasks) before the command started computing.
    requested
        ``--threads`` (or ``OMP_NUM_THREADS``), ``None`` when the default was taken.
    """

    threads: int
    usable_cpus: int
    load: float
    requested: int | None = None

    @property
    def oversubscribed(self) -> bool:
        """More runnable work than usable CPUs once this command's threads run."""
        return self.threads + self.load > self.usable_cpus + 0.5

    def warning(self) -> str | None:
        """One line for stderr when the machine is oversubscribed (else ``None``)."""
        if not self.oversubscribed:
            return None
        plural = "s" if self.threads != 1 else ""
        advice = (
            "lower --threads"
            if self.requested is not None and self.requested > 1
            else "expect it to be slow, or stop other work"
        )
        return (
            f"warning: {self.threads} thread{plural} on {self.usable_cpus} usable CPU(s) with a "
            f"load of {self.load:.1f} from other work: the machine is oversubscribed; {advice}"
        )


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup CPU quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    quota = _cgroup_quota()
    return max(1, min(cpus, math.ceil(quota))) if quota is not None else max(1, cpus)


def _cgroup_quota() -> float | None:
    """CPUs' worth of time per period the cgroup grants (``None``: unlimited or unknown)."""
    try:
        if CGROUP_V2_QUOTA.exists():
            quota, period = CGROUP_V2_QUOTA.read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        if CGROUP_V1_QUOTA.exists():
            quota = int(CGROUP_V1_QUOTA.read_text())
            return None if quota <= 0 else quota / int(CGROUP_V1_PERIOD.read_text())
    except (OSError, ValueError):  # an unreadable or odd file: no quota known
        return None
    return None


def max_threads() -> tuple[int, str] | None:
    """The most torch threads this process can start, and the kernel limit that sets it
    (``None``: no limit is known).

    Past such a limit a thread's start fails where no error can be handled (libgomp aborts, or
    the next library loaded finds no room to map itself), so a count over it is refused before
    torch is asked. Each torch thread counts as :data:`POOLS` OS threads, each OS thread as two
    memory mappings (its stack and the guard page below it), and half of every limit is left to
    the rest of the process (libraries, the model's weights, other threads).
    """
    limits = []  # (OS threads the limit allows, the limit)
    maps = _read_limit(MAX_MAP_COUNT)
    if maps is not None:
        limits.append((maps // 2, f"vm.max_map_count={maps}, at two mappings a thread,"))
    threads = _read_limit(THREADS_MAX)
    if threads is not None:
        limits.append((threads, f"kernel.threads-max={threads}"))
    pids = _read_limit(CGROUP_PIDS_MAX)
    if pids is not None:
        limits.append((pids, f"the cgroup's pids.max={pids}"))
    if not limits:
        return None
    allowed, limit = min(limits)
    return max(1, allowed // 2 // POOLS), f"{limit} allows {allowed} threads"


def _read_limit(path: Path) -> int | None:
    """The integer in ``path`` (``None``: no such file, ``max``, or not a number)."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _check_startable(requested: int, name: str, cpus: int) -> None:
    """Refuse a thread count over :func:`max_threads` (``name``: the setting that gave it)."""
    limit = max_threads()
    if limit is None or requested <= limit[0]:
        return
    most, reason = limit
    raise ValueError(
        f"{name}={requested} is more than this machine can start; give at most {most} ({reason}; "
        f"a torch thread may start {POOLS} and half is kept for the rest of the process; with "
        f"{cpus} usable CPU(s), threads beyond {cpus} only wait)"
    )


def choose_threads(requested: int | None, *, environ: dict[str, str] | None = None) -> ThreadChoice:
    """The thread count for ``requested`` (``--threads``), else ``OMP_NUM_THREADS``, else the
    usable CPUs less the load others put on them (at least 1).

    Raises
    ------
    ValueError
        ``threads`` below 1, or an ``OMP_NUM_THREADS`` that is not a positive integer, or
        either more than this machine can start (:func:`max_threads`).
    """
    environ = os.environ if environ is None else environ
    if requested is not None and (
        isinstance(requested, bool) or not isinstance(requested, int) or requested < 1
    ):
        raise ValueError(f"threads={requested!r} must be an integer >= 1")
    name = "threads"
    if requested is None and environ.get("OMP_NUM_THREADS"):
        text = environ["OMP_NUM_THREADS"]
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"OMP_NUM_THREADS={text!r} must be an integer >= 1")
        requested, name = int(text), "OMP_NUM_THREADS"
    cpus = usable_cpus()
    if requested is not None:
        _check_startable(requested, name, cpus)
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this platform
        load = 0.0
    if requested is not None:
        return ThreadChoice(threads=requested, usable_cpus=cpus, load=load, requested=requested)
    # torchrun starts LOCAL_WORLD_SIZE processes on this machine: they share the idle CPUs.
    local_processes = max(1, int(environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    idle = round(cpus - load) // local_processes
    return ThreadChoice(threads=max(1, min(cpus, idle)), usable_cpus=cpus, load=load)


def use_threads(requested: int | None = None, *, warn: bool = True) -> ThreadChoice:
    """Set torch's intra-op threads by :func:`choose_threads` and return the choice.

    What the CLI's commands do before computing; a Python program calls it once (torch's own
    default, a thread per core, is slow on a machine other work keeps busy). ``ThreadChoice``'s
    ``warning()`` says when the machine is oversubscribed even so; ``warn``: a
    ``RuntimeWarning`` when more threads were asked for than there are usable CPUs (False: the
    caller says ``warning()`` in its own words, as the CLI does).
    """
    import torch

    choice = choose_threads(requested)
    torch.set_num_threads(choice.threads)
    if warn and choice.threads > choice.usable_cpus:  # the load's share is the caller's to say
        warnings.warn(
            f"use_threads({requested}): {choice.threads} threads on {choice.usable_cpus} usable "
            f"CPU(s) oversubscribe the machine (threads wait on each other); ask for at most "
            f"{choice.usable_cpus}",
            RuntimeWarning,
            stacklevel=2,
        )
    return choice
