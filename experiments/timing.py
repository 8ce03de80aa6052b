"""The experiments' one way to time a call (warm-up calls first, the device drained around each
timed call, the median of the repeats: robust to the odd descheduled call on a shared CPU) and
the one record of the conditions every benchmark's timings were taken under."""

from __future__ import annotations

import os
import platform
import statistics
from collections.abc import Callable
from datetime import datetime, timezone

import torch

from alisa.calibration.steps import timings
from alisa.record import machine_record

# Variables that change timings without changing results (threads waiting, the allocator).
TIMING_VARIABLES = (
    "OMP_NUM_THREADS",
    "OMP_WAIT_POLICY",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_ARENA_MAX",
)


def median_seconds(
    run: Callable[[], object],
    *,
    repeats: int,
    warm_up: int = 1,
    device: torch.device | str = "cpu",
) -> float:
    """Median wall seconds of one ``run()`` call.

    Parameters
    ----------
    run
        The call to time, with no arguments; its result is ignored.
    repeats
        Timed calls (at least 1).
    warm_up
        Untimed calls first (at least 0): the first calls pay for compiling, allocating and
        dispatching.
    device
        Where ``run`` queues its work: on CUDA the clock is read only once the device has
        finished (``torch.cuda.synchronize``), so a call's time includes its kernels.

    Returns
    -------
    float
        The median of the ``repeats`` timed calls, in seconds.

    Raises
    ------
    ValueError
        ``repeats`` below 1 or ``warm_up`` below 0.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be at least 1")
    if warm_up < 0:
        raise ValueError(f"warm_up={warm_up} must be at least 0")
    return statistics.median(timings(run, torch.device(device), repeats, warm_up=warm_up))


def environment(threads: int | None) -> dict:
    """What a reader needs to reproduce a figure, beside every benchmark's JSON line and every
    experiment run (``env.json``): the machine, its kernels and the versions
    (:func:`alisa.record.machine_record`), the torch threads (None where each row says its own),
    and the variables that change timings without changing results (threads waiting, the
    allocator)."""
    record = machine_record()
    return {
        **record,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cuda": torch.version.cuda if record["gpu"] else None,
        "threads": threads,
        "variables": {name: os.environ[name] for name in TIMING_VARIABLES if name in os.environ},
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
