"""Fit the cost model's decode terms from timed real decode steps (least squares, no torch).

A decode step of ``batch`` sequences holding ``context`` tokens each costs, in the model of
``scheduler.cost``::

    seconds = overhead + batch * flops_per_token / flops + batch * context * kv_bytes / kv_rate

Timing the model's own steps at two batch sizes and two context lengths identifies all three
terms (one column each in a least-squares system); micro-benchmarks of a square matmul or a
memory sweep can be several times off on another CPU because their shape, dtype and kernel path
differ from the model's. ``retention="host"`` steps at two context lengths identify, on top
of that, the selection's constant and the rate at which it goes over the key sketch
(:func:`fit_selection`).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import numpy as np

from scheduler.hardware import CEILINGS

# A fitted step that misses a calibration step by more than this is not trusted.
FIT_TOLERANCE = 0.25


@dataclass(frozen=True, kw_only=True)
class StepSample:
    """Repeated timings of one real decode step.

    Attributes
    ----------
    batch, context
        Sequences in the step and KV tokens each one attends to.
    seconds
        Wall time of every repeat (at least one).
    """

    batch: int
    context: int
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.seconds or not all(math.isfinite(s) and s > 0 for s in self.seconds):
            raise ValueError(f"seconds={self.seconds!r} must be positive finite timings")

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


@dataclass(frozen=True, kw_only=True)
class DecodeFit:
    """Rates fitted from decode steps.

    ``fitted``: the rate fields the steps identified (the others are the fallbacks);
    ``worst_miss``: the largest relative miss of the fitted step on a sample (of the anchor
    batch, where :func:`fit_decode` was given one).
    """

    step_overhead_s: float
    flops: float
    kv_bytes_per_s: float
    fitted: tuple[str, ...]
    worst_miss: float


RATE_COLUMNS = {1: "device_flops", 2: "kv_bytes_per_s"}  # design column -> profile field
CHOOSE = {"min": min, "median": statistics.median, "max": max}  # which repeat of a sample


def fit_decode(
    samples: list[StepSample],
    flops_per_token: float,
    kv_bytes_per_token: float,
    weight_seconds: float = 0.0,
    pick: str = "median",
    fallback: tuple[float, float] | None = None,
    device_type: str = "",
    anchor: int | None = None,
) -> DecodeFit:
    """Least-squares fit of overhead, FLOP rate and KV read rate to decode step timings.

    Parameters
    ----------
    samples
        At least three steps spanning two batch sizes and two context lengths.
    flops_per_token, kv_bytes_per_token
        The model's matmul FLOPs and KV bytes per token (``ModelSpec``), as the cost model uses.
    weight_seconds
        Time to read the weights once (weights / memory bandwidth): the cost model charges
        max(that, FLOP time), so the overhead is fitted against exactly that formula.
    pick
        Which repeat of each sample to fit: ``"min"``, ``"median"`` or ``"max"`` (the spread).
    fallback
        (FLOP/s, KV bytes/s) from micro-benchmarks, fixed in place of a rate the steps do not
        identify (tiny steps bound by weight reads or Python); the rest is refitted.
    device_type
        ``"cpu"``, ``"cuda"``, ...: a fitted rate above the device's physical bound
        (``scheduler.hardware.CEILINGS``) counts as not identified.
    anchor
        The batch size the profile is for (the plan's, the largest calibrated): the overhead is
        fitted on its steps alone, and the miss measured there. A CPU's step is not linear in
        the batch (at one row the BLAS multiplies on one thread, alisa's row kernel takes up to
        sixteen rows, oneDNN's bfloat16 product at one row cost as much as at eight: stop 90),
        so an overhead fitted over every batch missed the plan's step by 22-35 %. None: every
        step.

    Raises
    ------
    ValueError
        The samples do not span the sizes, or (without ``fallback``) a fitted rate is zero,
        negative, infinite or beyond physical bounds: the step did not grow with batch or
        context.
    """
    if len({s.batch for s in samples}) < 2 or len({s.context for s in samples}) < 2:
        raise ValueError("decode samples must span two batch sizes and two context lengths")
    choose = CHOOSE[pick]
    design = np.array(
        [
            [1.0, s.batch * flops_per_token, s.batch * s.context * kv_bytes_per_token]
            for s in samples
        ]
    )
    times = np.array([choose(s.seconds) for s in samples])
    bytes_ceiling, flops_ceiling = CEILINGS.get(device_type, CEILINGS[""])
    seconds_per, fitted = _slopes(design, times, fallback, (flops_ceiling, bytes_ceiling))
    variable = np.maximum(weight_seconds, design[:, 1] * seconds_per[1])
    variable = variable + design[:, 2] * seconds_per[2]
    at = np.array([anchor is None or s.batch == anchor for s in samples])
    if not at.any():
        raise ValueError(f"anchor={anchor!r} is none of the samples' batch sizes")
    overhead = max(0.0, float(np.mean((times - variable)[at])))
    return DecodeFit(
        step_overhead_s=overhead,
        flops=1.0 / seconds_per[1],
        kv_bytes_per_s=1.0 / seconds_per[2],
        fitted=fitted,
        worst_miss=float(np.max(np.abs((overhead + variable[at]) / times[at] - 1.0))),
    )


def _slopes(
    design: np.ndarray,
    times: np.ndarray,
    fallback: tuple[float, float] | None,
    ceilings: tuple[float, float],
) -> tuple[dict[int, float], tuple[str, ...]]:
    """(seconds per unit of each rate column, the fields fitted); a column the steps do not
    identify is fixed at its fallback rate and the others refitted."""
    fixed: dict[int, float] = {}
    while True:
        free = [c for c in RATE_COLUMNS if c not in fixed]
        rest = times - sum((design[:, c] * v for c, v in fixed.items()), np.zeros_like(times))
        columns = design[:, [0, *free]]
        scale = np.abs(columns).max(axis=0)  # columns of very different size: unit scale
        solution = np.linalg.lstsq(columns / scale, rest, rcond=None)[0] / scale
        found = dict(zip(free, (float(v) for v in solution[1:]), strict=True))
        bad = {c: v for c, v in found.items() if not v > 0 or 1.0 / v > ceilings[c - 1]}
        if not bad:
            return {**found, **fixed}, tuple(RATE_COLUMNS[c] for c in free)
        if fallback is None:
            column, value = next(iter(bad.items()))
            raise ValueError(
                f"decode fit gave {RATE_COLUMNS[column]}={1 / value if value > 0 else math.inf:.3g}"
                " (not positive or beyond physical bounds): the step did not grow with "
                "batch/context"
            )
        fixed.update({c: 1.0 / fallback[c - 1] for c in bad})


@dataclass(frozen=True, kw_only=True)
class SelectionFit:
    """The selection cost of ``retention="host"`` fitted from real host steps.

    ``overhead_s``: fixed seconds per selection; ``bytes_per_s``: key-sketch bytes selected over per
    second (``select_bytes_per_s``); ``worst_miss``: the largest relative miss on a sample.
    """

    overhead_s: float
    bytes_per_s: float
    worst_miss: float


def fit_selection(
    samples: list[StepSample],
    base_seconds: list[float],
    sketch_bytes_per_token: float,
    pick: str = "median",
    device_type: str = "",
) -> SelectionFit:
    """Least-squares fit of the selection's constant and sketch rate to host steps.

    A ``retention="host"`` step that selects costs what the cost model charges without the selection
    (``base_seconds``) plus ``overhead + batch * context * sketch_bytes_per_token / rate``:
    scoring every seen token's sketch, the top-k and the slot swaps grow with the tokens seen.

    Parameters
    ----------
    samples
        Timed retention="host" steps, each selecting, spanning two context lengths
        (``context``: tokens seen per sequence).
    base_seconds
        The cost model's time of each sample without the selection (overhead, weights,
        attention over the kept tokens, the fetch), in the order of ``samples``.
    sketch_bytes_per_token
        Key-sketch bytes of one token over all layers (``ModelSpec.sketch_bytes_per_token``).
    pick, device_type
        As :func:`fit_decode`: which repeat to fit, and the device whose bound caps the rate.

    Raises
    ------
    ValueError
        The samples do not span two sizes, or the fitted rate is not positive or beyond the
        device's physical bound (the selection did not grow with the tokens seen).
    """
    sketch, times, base = _selection_arrays(samples, base_seconds, sketch_bytes_per_token, pick)
    if len(set(sketch.tolist())) < 2:
        raise ValueError("selection samples must span two context lengths")
    extra = times - base
    scale = sketch.max()  # unit scale: bytes are ~1e7 times a constant in seconds
    design = np.stack([np.ones_like(sketch), sketch / scale], axis=1)
    constant, slope = np.linalg.lstsq(design, extra, rcond=None)[0]
    slope /= scale
    if constant < 0:  # no negative step time: refit through the origin
        constant, slope = 0.0, float(sketch @ extra / (sketch @ sketch))
    bytes_ceiling = CEILINGS.get(device_type, CEILINGS[""])[0]
    if not slope > 0 or 1.0 / slope > bytes_ceiling:
        rate = 1.0 / slope if slope > 0 else math.inf
        raise ValueError(
            f"selection fit gave select_bytes_per_s={rate:.3g} (not positive or beyond physical "
            "bounds): the host step did not grow with the tokens seen"
        )
    predicted = base + constant + sketch * slope
    return SelectionFit(
        overhead_s=float(constant),
        bytes_per_s=float(1.0 / slope),
        worst_miss=float(np.max(np.abs(predicted / times - 1.0))),
    )


def _selection_arrays(
    samples: list[StepSample], base_seconds: list[float], sketch_bytes_per_token: float, pick: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sketch bytes, picked seconds, base seconds) per sample, for the selection fits."""
    if len(base_seconds) != len(samples):
        raise ValueError(f"base_seconds has {len(base_seconds)} entries for {len(samples)} samples")
    sketch = np.array([s.batch * s.context * sketch_bytes_per_token for s in samples], float)
    times = np.array([CHOOSE[pick](s.seconds) for s in samples])
    return sketch, times, np.array(base_seconds, float)


def fit_selection_constant(
    samples: list[StepSample],
    base_seconds: list[float],
    sketch_bytes_per_token: float,
    bytes_per_s: float,
    pick: str = "median",
) -> SelectionFit:
    """The selection's constant alone, its rate given: for host steps that did not grow with
    the tokens seen (:func:`fit_selection` then has no slope to fit), whose selection still
    costs what they take beyond ``base_seconds``.

    The constant is the mean of each sample's time beyond its base and its sketch bytes at
    ``bytes_per_s`` (the least-squares constant with the slope fixed), never below zero.
    Parameters as :func:`fit_selection`'s; ``bytes_per_s`` is the rate kept (e.g. the KV read
    rate).
    """
    if not samples:
        raise ValueError("no host steps to fit the selection's constant to")
    if not bytes_per_s > 0:
        raise ValueError(f"bytes_per_s={bytes_per_s!r} must be positive")
    sketch, times, base = _selection_arrays(samples, base_seconds, sketch_bytes_per_token, pick)
    rest = base + sketch / bytes_per_s
    constant = max(0.0, float(np.mean(times - rest)))
    return SelectionFit(
        overhead_s=constant,
        bytes_per_s=float(bytes_per_s),
        worst_miss=float(np.max(np.abs((rest + constant) / times - 1.0))),
    )


@dataclass(frozen=True, kw_only=True)
class Spread:
    """One profile term measured several ways: lowest, median and highest estimate.

    Attributes
    ----------
    field
        The :class:`~scheduler.hardware.HardwareProfile` field.
    low, median, high
        Estimates from the fastest, median and slowest repeats (sorted).
    source
        How it was measured (``"fitted from real decode steps"``, ``"micro-benchmark"``, ...).
    """

    field: str
    low: float
    median: float
    high: float
    source: str

    @classmethod
    def of(cls, field: str, estimates: list[float], source: str) -> Spread:
        """The spread of a list of estimates (min / median / max)."""
        return cls(
            field=field,
            low=min(estimates),
            median=statistics.median(estimates),
            high=max(estimates),
            source=source,
        )
