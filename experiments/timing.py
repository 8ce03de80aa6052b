"""The experiments' one way to time a call: warm-up calls first, the device drained around each
timed call, the median of the repeats (robust to the odd descheduled call on a shared CPU)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from alisa.calibration.steps import timings


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
