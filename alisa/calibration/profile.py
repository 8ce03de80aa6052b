"""Measure this machine for the scheduler: every cost-model term, with its spread and source.

With a model, the terms the LP uses come from the model's own work at the plan's sizes
(:mod:`alisa.calibration.steps`): decode steps at two batch sizes and two context lengths fit the
step overhead, FLOP rate and KV read rate; tiered steps give the host-read and recompute rates;
retention="host" steps (each selecting) give the selection's sketch rate and constant.
Micro-benchmarks (a square matmul, a memory sweep, a pool-to-pool copy) fill the terms that no
step identifies, and stand in, labelled as fallbacks, when a fit fails twice.
"""

from __future__ import annotations

import itertools
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil
import torch
from tqdm.auto import tqdm

from alisa.calibration.steps import (
    calibrate_selection,
    calibrate_tiers,
    decode_points,
    decode_samples,
    estimated_seconds,
    fit_decode_terms,
    selection_attended,
    selection_contexts,
    smallest_context,
    timings,
)
from alisa.model.adapter import model_shape
from alisa.model.loading import context_length
from alisa.planning.hardware import cpu_model
from alisa.planning.spec import model_spec
from alisa.storage.recompute import KVRecomputer
from scheduler import HardwareProfile
from scheduler.calibrate import FIT_TOLERANCE, Spread

MICRO = "micro-benchmark"
# The plan's default sizes (batch, context tokens) for the largest calibration step.
PLAN_SIZES = (8, 1024)
# Tokens each calibration run decodes past its context: one warm-up step and the 7 timed
# repeats of alisa.calibration.steps.steps_in_turns.
DECODED_PER_RUN = 8


@dataclass(frozen=True)
class ProfileReport:
    """A measured profile and, per measured term, its spread and how it was measured."""

    profile: HardwareProfile
    terms: tuple[Spread, ...]


def _rates(amount: float, work, device: torch.device) -> list[float]:
    """``amount`` per second of each repeat of ``work``."""
    return [amount / max(t, 1e-12) for t in timings(work, device)]


def copy_bandwidth(device: torch.device, megabytes: int = 256) -> tuple[list[float], list[float]]:
    """(host->device, device->host) bytes/s per repeat: pinned copies on CUDA, pool-to-pool on
    CPU."""
    count = megabytes * 2**20 // 2
    host = torch.empty(count, dtype=torch.float16)
    if device.type == "cuda":
        host = host.pin_memory()
    target = torch.empty(count, dtype=torch.float16, device=device)
    h2d = _rates(host.nbytes, lambda: target.copy_(host, non_blocking=True), device)
    d2h = _rates(host.nbytes, lambda: host.copy_(target, non_blocking=True), device)
    return h2d, d2h


def matmul_flops(device: torch.device, dtype: torch.dtype, size: int = 1024) -> list[float]:
    """Dense square matmul throughput per repeat, FLOP/s, in the model's dtype."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    return _rates(2 * size**3, lambda: a @ b, device)


def memory_bandwidth(device: torch.device, megabytes: int = 256) -> list[float]:
    """Bytes/s per repeat of reading a large tensor (a reduction streams it once)."""
    x = torch.ones(megabytes * 2**20 // 4, device=device)
    return _rates(x.nbytes, lambda: x.sum(), device)


def measure(
    model=None, device: torch.device | None = None, dtype: torch.dtype = torch.bfloat16, **kwargs
) -> HardwareProfile:
    """A :class:`HardwareProfile` of this machine (calibrated on ``model`` if given).

    Keyword arguments go to :func:`measure_report`.
    """
    return measure_report(model, device, dtype, **kwargs).profile


def measure_report(
    model=None,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.bfloat16,
    sizes: tuple[int, int] = PLAN_SIZES,
    progress: bool = False,
) -> ProfileReport:
    """Measure every term; with ``model``, calibrate on its real steps at ``sizes``.

    Parameters
    ----------
    model
        A loaded model, or None for micro-benchmarks only.
    device, dtype
        Where and in which dtype to measure without a model (else the model's).
    sizes
        (batch, context tokens) of the largest calibration step: the plan's sizes.
    progress
        Show a progress bar and the estimated time (from the micro-benchmarks).

    Raises
    ------
    ValueError
        A context that the calibration runs would decode past the model's context
        (:func:`context_error`).
    """
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if model is not None:
        error = context_error(model, sizes[1], "sizes[1]")  # before any measuring
        if error is not None:
            raise ValueError(error)
        dtype = next(model.parameters()).dtype
    h2d, d2h = copy_bandwidth(device)
    terms = {
        "h2d_bytes_per_s": Spread.of("h2d_bytes_per_s", h2d, MICRO),
        "d2h_bytes_per_s": Spread.of("d2h_bytes_per_s", d2h, MICRO),
        "device_bytes_per_s": Spread.of("device_bytes_per_s", memory_bandwidth(device), MICRO),
        "device_flops": Spread.of("device_flops", matmul_flops(device, dtype), MICRO),
    }
    misses: dict[str, float] = {}
    if model is not None:
        calibrated, misses = _calibrated_terms(model, device, terms, sizes, progress)
        terms.update(calibrated)
    return ProfileReport(_profile(device, dtype, terms, misses), tuple(terms.values()))


def context_error(model, context: int, name: str) -> str | None:
    """Why calibration runs of ``context`` tokens do not fit ``model``, or None when they do
    (or its context is unknown): each run decodes :data:`DECODED_PER_RUN` tokens past it, and
    past the model's context positions are garbage, as :func:`alisa.generate` refuses them.
    ``name`` is what set ``context`` (a flag or an argument), for the message."""
    known = context_length(model)
    if known is None:
        return None
    limit, source = known
    most = limit - DECODED_PER_RUN
    if context <= most:
        return None
    error = (
        f"{name}={context} plus the {DECODED_PER_RUN} tokens each calibration run decodes after "
        f"it is {context + DECODED_PER_RUN} tokens, more than the model's context of {limit} "
        f"tokens ({source})"
    )
    least = smallest_context()
    if most < least:
        return (
            f"{error}; a calibration needs {name} >= {least}, which this model cannot hold: "
            "calibrate on a model with a longer context, or without a model (micro-benchmarks "
            "only)"
        )
    return f"{error}; give {name} <= {most}"


def _calibrated_terms(
    model, device: torch.device, micro: dict[str, Spread], sizes: tuple[int, int], progress: bool
) -> tuple[dict[str, Spread], dict[str, float]]:
    """The terms real steps give: the fitted decode terms, the tiered rates, then the selection
    cost of retention="host" (costed on top of the others); and how far the decode and the
    selection fits miss their own steps (``decode_miss``, ``select_miss``).

    The progress bar counts estimated milliseconds (:func:`calibration_estimate`), so its
    remaining time is right as soon as the first steps show how fast this machine really is;
    after the first round of decode runs one line says the time left (:func:`time_left`).
    """
    decode, later = calibration_estimate(model, micro, sizes)
    bar = tqdm(
        total=sum(decode) + sum(later),
        disable=not progress,
        bar_format="{desc}{percentage:3.0f}%|{bar}| [{elapsed}<{remaining}]",
    )
    # No seconds announced from the micro-benchmarks: their rates can be far off the model's
    # own (a bfloat16 model on a CPU without bfloat16 arithmetic: 9x too slow an estimate).
    bar.write(
        f"alisa profile: timing {len(decode) + len(later)} calibration runs of up to "
        f"{sizes[0]} x {sizes[1]} tokens; the time they take is announced after the first "
        f"{len(decode)}, at their own pace"
    )
    bar.set_description("alisa profile: decode steps")
    decode_units = itertools.cycle(decode)  # a second round (a fit that missed) repeats them
    start, first_round = time.perf_counter(), itertools.count(1)

    def decode_tick() -> None:
        bar.update(next(decode_units))
        if next(first_round) == len(decode):
            elapsed = time.perf_counter() - start
            left = time_left(elapsed, sum(decode), sum(decode) + sum(later))
            bar.write(
                f"alisa profile: the first {len(decode)} runs took {elapsed:.0f} s; "
                f"about {left:.0f} s left at their pace"
            )

    terms, decode_miss = _fit_decode_twice(model, device, micro, sizes, decode_tick)
    bar.total = bar.n + sum(later)  # a first fit that held skips the second round
    later_units = iter(later)

    def tick() -> None:
        bar.update(next(later_units))

    bar.set_description("alisa profile: tiered steps")
    reads, rebuilds = calibrate_tiers(
        model,
        device,
        micro["h2d_bytes_per_s"].median,
        micro_recompute(model, device),
        *sizes,
        tick=tick,
    )
    terms = {**micro, **terms, "h2d_bytes_per_s": reads, "recompute_flops": rebuilds}
    bar.set_description("alisa profile: retention='host' steps")
    dtype = next(model.parameters()).dtype
    *selection, select_miss = calibrate_selection(
        model, device, _profile(device, dtype, terms), *sizes, tick=tick
    )
    bar.close()
    misses = {"decode_miss": decode_miss, "select_miss": select_miss}
    return {**terms, **{term.field: term for term in selection}}, misses


def time_left(elapsed: float, done: float, total: float) -> float:
    """Seconds left of work ``total`` (estimated units) when ``done`` of it took ``elapsed``
    seconds: the estimates' ratios hold, their scale is this machine's."""
    if done <= 0:
        raise ValueError(f"time_left needs work done; done={done!r}")
    return elapsed * max(total - done, 0.0) / done


def calibration_estimate(
    model, micro: dict[str, Spread], sizes: tuple[int, int]
) -> tuple[list[int], list[int]]:
    """Estimated milliseconds of each calibration run, (decode fit's runs, tiered and selection
    runs), in the order they run, from the micro-benchmarks' FLOP rate and bandwidth
    (:func:`alisa.calibration.steps.estimated_seconds`). The decode fit runs twice when its
    first fit misses; the first list is one round."""
    spec = model_spec(model, model_shape(model))
    rates = (micro["device_flops"].median, micro["device_bytes_per_s"].median)
    batch, context = sizes
    decode = [estimated_seconds(spec, *rates, b, n) for b, n in decode_points(batch, context)]
    tiered = [3 * estimated_seconds(spec, *rates, batch, context)]  # three runs in turns
    selection = [  # each host step in turns with a resident step over what it attends
        estimated_seconds(spec, *rates, batch, n)
        + estimated_seconds(spec, *rates, batch, selection_attended(spec.num_layers, n))
        for n in selection_contexts(spec.num_layers, context)
    ]
    # Whole milliseconds: the bar's counts add up exactly to its total.
    return [round(1000 * s) for s in decode], [round(1000 * s) for s in tiered + selection]


def _fit_decode_twice(
    model,
    device: torch.device,
    micro: dict[str, Spread],
    sizes: tuple[int, int],
    tick: Callable[[], object],
) -> tuple[dict[str, Spread], float]:
    """(fitted decode terms, the fit's largest relative miss on its steps); a fit that misses
    its own steps (noise, a stall) is measured once more and the better fit kept."""
    spec = model_spec(model, model_shape(model))
    weight_seconds = spec.total_weight_bytes / micro["device_bytes_per_s"].median
    fallback = (micro["device_flops"].median, micro["device_bytes_per_s"].median)
    best: tuple[float, dict[str, Spread]] | None = None
    for _ in range(2):
        samples = decode_samples(model, device, *sizes, tick=tick)
        fitted, miss = fit_decode_terms(model, samples, weight_seconds, fallback, sizes[0])
        if best is None or miss < best[0]:
            best = (miss, {t.field: t for t in fitted})
        if miss <= FIT_TOLERANCE:
            break
    return best[1], best[0]


def micro_recompute(model, device: torch.device, tokens: int = 512) -> float:
    """FLOP/s of rebuilding one layer's K/V from stored attention inputs (the ceiling of the
    tiered recompute rate)."""
    recomputer = KVRecomputer(model)
    hidden_size = model.config.hidden_size
    dtype = next(model.parameters()).dtype
    hidden = torch.randn(1, tokens, hidden_size, device=device).to(dtype)
    positions = torch.arange(tokens, device=device).view(1, -1)
    shape = recomputer.adapter.shape
    flops = 2.0 * tokens * hidden_size * 2 * shape.num_kv_heads * shape.head_dim  # K and V
    with torch.inference_mode():
        return statistics.median(_rates(flops, lambda: recomputer(0, hidden, positions), device))


def _profile(
    device: torch.device,
    dtype: torch.dtype,
    terms: dict[str, Spread],
    misses: dict[str, float] | None = None,
) -> HardwareProfile:
    """The profile of the measured medians, tagged with this machine, torch and dtype, and
    with how far its fits miss their own steps (``misses``: none for micro-benchmarks)."""
    if device.type == "cuda":
        device_bytes = torch.cuda.get_device_properties(device).total_memory
    else:
        device_bytes = psutil.virtual_memory().total
    return HardwareProfile(
        name=f"{platform.node() or 'host'} {device.type} "
        f"({torch.get_num_threads()} threads, measured)",
        device_bytes=device_bytes,
        host_bytes=psutil.virtual_memory().total,
        overlap=device.type == "cuda",
        device_type=device.type,
        cpu_model=cpu_model(),
        torch_version=torch.__version__,
        dtype=str(dtype).removeprefix("torch."),
        **{name: term.median for name, term in terms.items()},
        **(misses or {}),
    )
