"""Calibrate the cost model's terms on the model's own decode steps (resident and tiered)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import numpy as np
import torch

from alisa.config import AlisaConfig
from alisa.kv.cache import AlisaCache
from alisa.model.adapter import model_shape
from alisa.ops.products import SETTLING
from alisa.planning.spec import model_spec
from alisa.runtime.engine import DecodeState, Engine, device_clock
from scheduler import (
    HardwareProfile,
    ModelSpec,
    activation_bytes,
    gathered_layers,
    mean_kept,
)
from scheduler.calibrate import (
    CHOOSE,
    FIT_TOLERANCE,
    Spread,
    StepSample,
    fit_decode,
    fit_selection,
    fit_selection_constant,
)

PICKS = ("min", "median", "max")  # fastest, median, slowest repeats: the spread of a term
FITTED = "fitted from real decode steps"
TIERED = "real tiered decode step"
SELECTED = "fitted from real retention='host' steps"
# retention="host" as a typical plan runs it, but selecting at every step: each timed step pays
# for one selection, so the fit is per selection (the cost model divides it by the plan's
# reselect_every). The selection's cost per seen token hardly depends on the ratio: every seen
# token's sketch is scored whatever the budget.
SELECTION_CONFIG = AlisaConfig(policy="swa", caching_ratio=0.2, retention="host", reselect_every=1)
# Contexts the selection is timed at, evenly spaced: three for its two unknowns, a least-squares
# fit, so one noisy point (another job on the machine, a page being coded) bends the line
# instead of setting it.
SELECTION_CONTEXTS = 3


def timings(
    work: Callable[[], object], device: torch.device, repeats: int = 5, *, warm_up: int = 1
) -> list[float]:
    """Seconds of each of ``repeats`` runs of ``work``, after ``warm_up`` untimed runs (the first
    runs pay for allocation, compiling and caches); on CUDA each is read once the device drained."""
    for _ in range(warm_up):
        work()
    times = []
    for _ in range(repeats):
        start = device_clock(device)
        work()
        times.append(device_clock(device) - start)
    return times


def half_offload_budget(spec, batch: int, tokens: int) -> int:
    """A device budget (bytes) that leaves about half of ``batch`` x ``tokens`` KV off-device.

    ``spec`` is a :class:`scheduler.ModelSpec`. The terms are the planner's: weights, one
    step's activations, half the KV, and the gathered off-device share of the attending (and
    prefetched) layer.
    """
    kv = spec.kv_bytes_per_token() * batch * tokens
    gathered = gathered_layers(spec.num_layers) * 0.5 * kv / spec.num_layers
    return int(spec.total_weight_bytes + activation_bytes(spec, batch) + 0.5 * kv + gathered)


def decode_step(
    model,
    device: torch.device,
    batch: int,
    context: int,
    config: AlisaConfig | None = None,
    repeats: int = 7,
) -> tuple[list[float], AlisaCache]:
    """(seconds of each repeat of one decode step of ``batch`` x ``context`` tokens, cache)."""
    [(seconds, cache)] = steps_in_turns(model, device, batch, [(context, config)], repeats)
    return seconds, cache


def steps_in_turns(
    model,
    device: torch.device,
    batch: int,
    runs: list[tuple[int, AlisaConfig | None]],
    repeats: int = 7,
) -> list[tuple[list[float], AlisaCache]]:
    """Decode steps of several (context, config) runs of ``batch`` sequences, timed in turns:
    every run's first step, then every run's second, ... (after one warm-up step each).

    Two runs compared by their difference (a host step and a resident step over the tokens it
    attends) are then timed under the same conditions: on a shared or throttling machine the
    speed moves between minutes by more than the difference (±20 % on the 2-core EPYC), and
    repeats taken one run after the other would carry that drift into it.

    Returns
    -------
    list
        Per run, in order: (seconds of each repeat, its cache).
    """
    vocab = model.get_input_embeddings().num_embeddings
    engine = Engine(model)  # generate()'s own step (mask, positions, forward, pick)
    steps, caches = [], []
    with torch.inference_mode():
        for context, config in runs:
            shape = (batch, context)
            ids = torch.randint(min(10, vocab - 1), min(1000, vocab), shape, device=device)
            cache = AlisaCache(model, config, max_new_tokens=repeats + SETTLING + 8)
            state = DecodeState.start(ids, torch.ones_like(ids))

            def step(state: DecodeState = state, cache: AlisaCache = cache) -> None:
                state.advance(engine.step(state, cache))

            step()  # the prefill
            step()  # warm-up: allocation, kernels, caches
            engine.settle(batch, step)  # both weight-product forms tried first
            steps.append(step)
            caches.append(cache)
        times: list[list[float]] = [[] for _ in runs]
        for _ in range(repeats):
            for step, run in zip(steps, times, strict=True):
                start = device_clock(device)
                step()
                run.append(device_clock(device) - start)
    return list(zip(times, caches, strict=True))


def decode_points(batch: int, context: int) -> list[tuple[int, int]]:
    """Two batch sizes x two context lengths, the largest being the plan's (batch, context)."""
    small_batch = 1 if batch > 1 else 2
    return [(b, n) for b in sorted({small_batch, batch}) for n in (small_context(context), context)]


def smallest_context() -> int:
    """The least plan context a calibration can fit: two distinct decode contexts, and
    :func:`selection_contexts` past the budget floor (a step that keeps every token does not
    select)."""
    floor = max(rule.floor for rule in SELECTION_CONFIG.keep_rules(1))
    return 2 * floor + 2


def small_context(context: int) -> int:
    """The shorter of the two calibration contexts (tokens)."""
    return max(16, context // 8)


def decode_samples(
    model, device: torch.device, batch: int, context: int, tick: Callable[[], object] = lambda: None
) -> list[StepSample]:
    """Timed resident decode steps at :func:`decode_points`; ``tick`` after each one."""
    samples = []
    for size, tokens in decode_points(batch, context):
        seconds, _ = decode_step(model, device, size, tokens)
        samples.append(StepSample(batch=size, context=tokens, seconds=tuple(seconds)))
        tick()
    return samples


def fit_decode_terms(
    model,
    samples: list[StepSample],
    weight_seconds: float,
    fallback: tuple[float, float],
    anchor: int | None = None,
) -> tuple[list[Spread], float]:
    """(overhead, FLOP rate and KV read rate fitted to real decode steps with their spreads,
    the median fit's largest relative miss on a step).

    ``fallback``: micro-benchmark (FLOP/s, bytes/s) for a rate the steps do not identify,
    labelled as such in the spread's source; ``anchor``: the plan's batch size, whose steps
    the overhead is fitted on (:func:`scheduler.calibrate.fit_decode`).
    """
    spec = model_spec(model, model_shape(model))
    fits = [
        fit_decode(
            samples,
            spec.decode_flops_per_token(),
            spec.kv_bytes_per_token(),
            weight_seconds=weight_seconds,
            pick=pick,
            fallback=fallback,
            device_type=next(model.parameters()).device.type,
            anchor=anchor,
        )
        for pick in PICKS
    ]
    miss = fits[1].worst_miss
    fitted = FITTED if miss <= FIT_TOLERANCE else f"{FITTED} (misses a step by {miss:.0%})"
    unfitted = "micro-benchmark (fallback: the steps do not identify it)"

    def source(field: str) -> str:
        return fitted if all(field in f.fitted for f in fits) else unfitted

    spreads = [
        Spread.of("step_overhead_s", [f.step_overhead_s for f in fits], fitted),
        Spread.of("device_flops", [f.flops for f in fits], source("device_flops")),
        Spread.of("kv_bytes_per_s", [f.kv_bytes_per_s for f in fits], source("kv_bytes_per_s")),
    ]
    return spreads, miss


def calibrate_tiers(
    model,
    device: torch.device,
    h2d: float,
    rebuild: float,
    batch: int = 4,
    context: int = 1024,
    tick: Callable[[], object] = lambda: None,
) -> tuple[Spread, Spread]:
    """Host-read bytes/s and recompute FLOP/s as the tiered cache really achieves them.

    Copy and matmul micro-benchmarks miss the per-layer gathers, small copies and the extra
    attention parts of a tiered step. Real decode steps (all resident, about half on the host,
    about half recomputed) give the effective rates, timed in turns (:func:`steps_in_turns`):
    each rate is a difference of two steps, and a resident step timed minutes earlier (the
    decode fit's) would carry the machine's drift into it. The host read only ever lowers
    the micro-benchmark figure ``h2d`` (copies hidden behind compute on CUDA would otherwise
    read as free; a tiered step no slower than the resident one, noise, keeps the
    micro-benchmark); the recompute rate is :func:`rebuild_rate`'s, ``rebuild`` where the steps
    do not tell. ``tick`` is called once the three runs are timed (a progress bar).
    """
    spec = model_spec(model, model_shape(model))
    bits = torch.finfo(next(model.parameters()).dtype).bits
    budget = half_offload_budget(spec, batch, context + 16)
    runs = [
        (context, None),
        (context, AlisaConfig(gpu_memory=budget, recompute="never")),
        (context, AlisaConfig(gpu_memory=budget, recompute="always")),
    ]
    (resident, _), (hosted, hosting), (rebuilt, rebuilding) = steps_in_turns(
        model, device, batch, runs
    )
    base = _picks(resident)
    host_bytes = hosting.tier_tokens()["host"] * spec.kv_bytes_per_token() / spec.num_layers
    reads = [_rate(host_bytes, t - r, h2d) for t, r in zip(_picks(hosted), base, strict=True)]
    tokens = rebuilding.tier_tokens()["recompute"] / spec.num_layers  # per layer, as the model
    # The hidden states are read like host KV (at the median read rate), then projected.
    read = tokens * spec.hidden_bytes_per_token(bits) / statistics.median(reads)
    flops = tokens * spec.recompute_flops_per_token()
    tick()
    return (
        Spread.of("h2d_bytes_per_s", reads, _source(reads, h2d)),
        rebuild_rate(flops, rebuilt, resident, read, rebuild),
    )


def rebuild_rate(
    flops: float, rebuilt: list[float], resident: list[float], read: float, ceiling: float
) -> Spread:
    """The recompute FLOP rate of real steps: ``flops`` rebuilt per step in the extra time of
    the ``rebuilt`` steps' repeats over the ``resident`` ones', less ``read`` seconds of reading
    the hidden states.

    A rebuild measurably slower than the resident step (its median by more than the resident
    step's own spread) gives the real rate, even above the micro-benchmark's ``ceiling``: the
    model's projections run as one batched matmul, which the micro-benchmark may underrate
    (bfloat16 on a CPU without native support: the real steps ran ~1.4x its 9.4 GFLOP/s). One
    within noise keeps at most the ceiling, labelled a fallback when it reaches it.
    """
    extra = statistics.median(rebuilt) - statistics.median(resident) - read
    measured = extra > max(resident) - min(resident)
    rates = [
        _rate(flops, t - r - read, ceiling, capped=not measured)
        for t, r in zip(_picks(rebuilt), _picks(resident), strict=True)
    ]
    return Spread.of("recompute_flops", rates, _source(rates, ceiling, measured=measured))


def calibrate_selection(
    model,
    device: torch.device,
    profile: HardwareProfile,
    batch: int = 4,
    context: int = 1024,
    tick: Callable[[], object] = lambda: None,
) -> tuple[Spread, Spread, float]:
    """The selection cost of ``retention="host"``: ``select_bytes_per_s`` and
    ``select_overhead_s`` with their spreads, from real host steps, and the median pick's fit's
    largest relative miss on those steps (``HardwareProfile.select_miss``).

    :data:`SELECTION_CONFIG` steps (each one selects) of ``batch`` sequences are timed at
    :data:`SELECTION_CONTEXTS` evenly spaced contexts, each in turns with a resident step over
    as many tokens as the host step attends (:func:`steps_in_turns`). The host step's time
    beyond that step and its fetch (the bytes really fetched over ``h2d_bytes_per_s``, as the
    cost model charges them) is the selection's, fitted by
    :func:`scheduler.calibrate.fit_selection` once per repeat pick (fastest, median, slowest:
    the same pick of both runs); picks whose fit fails are left out. When every fit fails (the
    steps did not grow with the tokens seen) the formula's rate, the KV read rate, is kept and
    the constant alone is fitted (:func:`scheduler.calibrate.fit_selection_constant`), both
    labelled as a fallback. ``tick`` is called after each context's runs (a progress bar).

    Until stop 61 the base was the cost model's own time of that resident step, fitted
    minutes earlier: its error at the calibration's sizes, and the machine's drift since, went
    into the selection's terms (a 43 ms constant in one run, 10-29 ms between the repeat picks
    of another: docs/host-speed.md, "The planner's cost of a host step").
    """
    spec = model_spec(model, model_shape(model))
    samples, resident, fetches = [], [], []
    for tokens in selection_contexts(spec.num_layers, context):
        attended = selection_attended(spec.num_layers, tokens)
        runs = [(tokens, SELECTION_CONFIG), (attended, None)]
        (seconds, cache), (base, _) = steps_in_turns(model, device, batch, runs)
        samples.append(StepSample(batch=batch, context=tokens, seconds=tuple(seconds)))
        resident.append(base)
        # Per selection: every decode step selected and fetched, the warm-up and the timed ones
        # (the prefill's selection holds its tokens and fetches none).
        fetches.append(fetched_bytes(cache, spec) / (len(seconds) + 1) / profile.h2d_bytes_per_s)
        tick()

    def bases(pick: str) -> list[float]:
        """The resident steps' picked seconds plus the fetch, as the cost model adds them."""
        steps = [CHOOSE[pick](times) for times in resident]
        if profile.overlap:  # copies beside the compute
            return [max(step, fetch) for step, fetch in zip(steps, fetches, strict=True)]
        return [step + fetch for step, fetch in zip(steps, fetches, strict=True)]

    sketch = spec.sketch_bytes_per_token()
    fits = []
    for pick in PICKS:
        # One noisy repeat (the slowest step may be the one that codes a page of new tokens)
        # must not discard the fits of the others.
        try:
            fits.append(fit_selection(samples, bases(pick), sketch, pick, profile.device_type))
        except ValueError:
            continue
    if not fits:
        rate = profile.kv_bytes_per_s or profile.device_bytes_per_s
        why = "(fallback: the host steps did not grow with the tokens seen)"
        fits = [fit_selection_constant(samples, bases(pick), sketch, rate, pick) for pick in PICKS]
        return (
            Spread.of("select_bytes_per_s", [rate], f"KV read rate {why}"),
            Spread.of(
                "select_overhead_s", [f.overhead_s for f in fits], f"fitted at that rate {why}"
            ),
            fits[1].worst_miss,
        )
    return (
        Spread.of("select_bytes_per_s", [f.bytes_per_s for f in fits], SELECTED),
        Spread.of("select_overhead_s", [f.overhead_s for f in fits], SELECTED),
        _middle_miss(fits),
    )


def _middle_miss(fits: list) -> float:
    """The worst miss of the middle fit of those that held (the median pick's when all did):
    the fit the profile's medians come closest to."""
    return sorted(fit.worst_miss for fit in fits)[(len(fits) - 1) // 2]


def selection_attended(num_layers: int, context: int) -> int:
    """Tokens a :data:`SELECTION_CONFIG` step attends to per sequence at ``context`` tokens
    seen: its budget, averaged over the layers (rounded up)."""
    rules = SELECTION_CONFIG.keep_rules(num_layers)
    return int(mean_kept(rules, np.array([context]))[0])


def selection_contexts(num_layers: int, context: int) -> list[int]:
    """The contexts (tokens) :func:`calibrate_selection` times, evenly spaced up to ``context``.

    Both ends lie past the budget floor (twice it when the plan's context allows): a step that
    keeps every token it has seen does not select, and would hide the selection's constant.
    """
    floor = max(rule.floor for rule in SELECTION_CONFIG.keep_rules(num_layers))
    short = min(max(small_context(context), 2 * floor), context // 2)
    steps = SELECTION_CONTEXTS - 1
    return [short + (context - short) * i // steps for i in range(steps + 1)]


def estimated_seconds(
    spec: ModelSpec, flops: float, bytes_per_s: float, batch: int, context: int, repeats: int = 7
) -> float:
    """Rough seconds of one :func:`decode_step` call: the prefill's matmuls (and its causal
    attention) at ``flops``, then ``repeats`` + 1 steps reading the weights and the KV at
    ``bytes_per_s``. Only the ratios between calls need to be right: a progress bar weighted by
    them shows a remaining time that corrects itself as steps finish."""
    attention = 2.0 * spec.num_layers * spec.num_heads * spec.head_dim * context  # per token
    prefill = batch * context * (spec.decode_flops_per_token() + attention) / flops
    read = spec.total_weight_bytes + batch * context * spec.kv_bytes_per_token()
    return prefill + (repeats + 1) * read / bytes_per_s


def fetched_bytes(cache: AlisaCache, spec: ModelSpec) -> float:
    """Bytes a ``retention="host"`` cache has fetched from its host regions so far."""
    config = cache.config
    tokens = sum(layer.keeper.fetched for layer in cache.layers)
    per_head = spec.kv_bytes_per_token(config.host_bits) / (spec.num_layers * spec.num_kv_heads)
    return tokens * per_head


def _picks(times: list[float]) -> list[float]:
    """Fastest, median and slowest of a step's repeats."""
    return [min(times), statistics.median(times), max(times)]


def _rate(amount: float, seconds: float, ceiling: float, *, capped: bool = True) -> float:
    """``amount / seconds``, never above the micro-benchmark ``ceiling`` unless not
    ``capped`` (``ceiling`` when no time)."""
    if amount <= 0 or seconds <= 0:
        return ceiling
    return min(ceiling, amount / seconds) if capped else amount / seconds


def _source(estimates: list[float], ceiling: float, *, measured: bool = False) -> str:
    if measured or statistics.median(estimates) < ceiling:
        return TIERED
    # The real steps' rate is at or above the micro-benchmark's (which caps it): no slower
    # than the micro-benchmark predicts, or not measurably slower than the resident step.
    return "micro-benchmark (fallback: the real tiered steps ran no slower than it predicts)"
