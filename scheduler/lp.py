"""The LP (pulp/CBC) that places the kept KV on device, host or recompute per step bucket.

Replaces ALISA's greedy search (https://arxiv.org/abs/2403.17312, §IV) by a linear program in
the spirit of FlexGen's (https://arxiv.org/abs/2303.06865, §4): variables per bucket b are the
fractions g_b + c_b + x_b = 1 of the kept KV on the device, on the host and deleted-then-
recomputed, with an epigraph variable T_b >= each side of the overlap model (``scheduler.cost``);
one variable w places weights on the host. Capacity rows bound device and host bytes in every
bucket; moved_b >= c_b K_b - c_{b-1} K_{b-1} charges only newly offloaded tokens. Objective:
total decode time sum_b steps_b * T_b.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import pulp

from scheduler.cost import Bucket, CostModel, Linear, gathered_layers, make_buckets
from scheduler.hardware import HardwareProfile
from scheduler.model import ModelSpec
from scheduler.plan import BucketPlan, Plan
from scheduler.workload import Workload

SOLVER_SLACK = 1e-6  # relative slack on the optimum when breaking ties in the second stage


@dataclass(frozen=True, kw_only=True)
class Options:
    """What the solver may choose.

    Attributes
    ----------
    buckets
        Step buckets (more: finer phases, bigger LP).
    allow_recompute
        False when the model's K/V cannot be rebuilt (unsupported architecture).
    allow_weight_offload
        Let weights move to the host (FlexGen-style) when the device cannot hold them.
    static
        One placement for the whole generation (a FlexGen-style static split).
    """

    buckets: int = 16
    allow_recompute: bool = True
    allow_weight_offload: bool = True
    static: bool = False


def _expr(linear: Linear, variables: dict[str, pulp.LpAffineExpression]):
    return linear.constant + pulp.lpSum(
        k * variables[v] for v, k in linear.coefficients.items() if k
    )


def build_lp(cost: CostModel, buckets: list[Bucket], options: Options, host_limit: bool = True):
    """The pulp problem and its variables; ``host_limit=False`` lifts the host capacity row."""
    problem = pulp.LpProblem("alisa_kv_placement", pulp.LpMinimize)
    weight_host = problem.add_variable("w", 0, 1 if options.allow_weight_offload else 0)
    rows, previous = [], None
    peak_host = problem.add_variable("peak_host", 0)
    for index, bucket in enumerate(buckets):
        name = "static" if options.static else str(index)
        if options.static and rows:
            g, c, x = rows[0]["g"], rows[0]["c"], rows[0]["x"]
        else:
            g = problem.add_variable(f"g_{name}", cost.workload.recent_fraction, 1)
            c = problem.add_variable(f"c_{name}", 0, 1)
            x = problem.add_variable(f"x_{name}", 0, 1 if options.allow_recompute else 0)
            problem += g + c + x == 1, f"split_{index}"
        moved_kv = problem.add_variable(f"moved_kv_{index}", 0)
        moved_hidden = problem.add_variable(f"moved_hidden_{index}", 0)
        step = problem.add_variable(f"T_{index}", 0)
        v = {
            "g": g,
            "c": c,
            "x": x,
            "w": weight_host,
            "moved_kv": moved_kv,
            "moved_hidden": moved_hidden,
        }
        before_c = previous["c"] * previous["kept"] if previous else 0
        before_x = previous["x"] * previous["kept"] if previous else 0
        problem += moved_kv >= c * bucket.max_kept - before_c, f"moved_kv_{index}"
        problem += moved_hidden >= x * bucket.max_kept - before_x, f"moved_hidden_{index}"
        busy = _expr(cost.compute(bucket), v) + _expr(cost.recompute(bucket), v)
        moving = _expr(cost.transfer(bucket), v)
        if cost.hardware.overlap:
            problem += step >= busy, f"compute_{index}"
            problem += step >= moving, f"transfer_{index}"
        else:
            problem += step >= busy + moving, f"serial_{index}"
        problem += (
            _expr(cost.device_bytes(bucket), v) <= cost.hardware.device_bytes,
            f"device_{index}",
        )
        host = _expr(cost.host_bytes(bucket), v)
        problem += peak_host >= host, f"peak_host_{index}"
        if host_limit:
            problem += host <= cost.hardware.host_bytes, f"host_{index}"
        rows.append(
            {
                "g": g,
                "c": c,
                "x": x,
                "T": step,
                "v": v,
                "kept": bucket.max_kept,
                "movement": moving + _expr(cost.recompute(bucket), v),
            }
        )
        previous = rows[-1]
    # Times enter in milliseconds: CBC's absolute tolerances would swallow sub-ms differences.
    decode_ms = pulp.lpSum(
        1000 * bucket.steps * row["T"] for bucket, row in zip(buckets, rows, strict=True)
    )
    movement_ms = pulp.lpSum(
        1000 * bucket.steps * row["movement"] for bucket, row in zip(buckets, rows, strict=True)
    )
    problem += decode_ms if host_limit else peak_host
    problem.decode_ms, problem.movement_ms = decode_ms, movement_ms
    return problem, rows, weight_host


def solve(
    hardware: HardwareProfile,
    model: ModelSpec,
    workload: Workload,
    options: Options | None = None,
) -> Plan:
    """Solve the placement LP and return the :class:`Plan`.

    Raises
    ------
    ValueError
        When the device cannot hold the minimum (weights or one streamed layer, activations and
        the recent window), or the host cannot hold what must leave the device; the message
        gives the shortfall in bytes.
    """
    options = options or Options()
    cost = CostModel(hardware, model, workload)
    buckets = make_buckets(workload, options.buckets)
    _check_device(cost, buckets, options)
    problem, rows, weight_host = build_lp(cost, buckets, options)
    if pulp.LpStatus[problem.solve(_solver())] != "Optimal":
        _raise_host_shortfall(cost, buckets, options)
    # Second stage: among the fastest placements, move the least (when copies hide behind
    # compute, many placements tie; keeping KV on the device is the sensible one).
    best = pulp.value(problem.decode_ms)
    problem += problem.decode_ms <= best * (1 + SOLVER_SLACK) + 1e-9, "fastest"
    problem.setObjective(problem.movement_ms)
    if pulp.LpStatus[problem.solve(_solver())] != "Optimal":
        raise RuntimeError("the tie-breaking stage of a feasible LP failed")
    values = [{name: var.value() or 0.0 for name, var in row["v"].items()} for row in rows]
    return _plan(cost, buckets, values, weight_host.value() or 0.0)


def evaluate(
    hardware: HardwareProfile,
    model: ModelSpec,
    workload: Workload,
    placement: dict[str, float],
    buckets: int = 16,
) -> Plan:
    """Cost a fixed placement (``g``, ``c``, ``x``, ``w``) without solving: baselines, checks."""
    cost = CostModel(hardware, model, workload)
    chosen = make_buckets(workload, buckets)
    values, previous = [], {"c": 0.0, "x": 0.0, "kept": 0}
    for bucket in chosen:
        moved_kv = max(0.0, placement["c"] * bucket.max_kept - previous["c"] * previous["kept"])
        moved_hidden = max(0.0, placement["x"] * bucket.max_kept - previous["x"] * previous["kept"])
        values.append({**placement, "moved_kv": moved_kv, "moved_hidden": moved_hidden})
        previous = {"c": placement["c"], "x": placement["x"], "kept": bucket.max_kept}
    return _plan(cost, chosen, values, placement.get("w", 0.0))


def _plan(cost: CostModel, buckets: list[Bucket], values: list[dict], weight_host: float) -> Plan:
    bucket_plans, device_peak, host_peak, decode = [], 0.0, 0.0, 0.0
    for bucket, value in zip(buckets, values, strict=True):
        step = cost.step_time(bucket, value)
        decode += step * bucket.steps
        device_peak = max(device_peak, cost.device_bytes(bucket).value(value))
        host_peak = max(host_peak, cost.host_bytes(bucket).value(value))
        bucket_plans.append(
            BucketPlan(
                start=bucket.start,
                stop=bucket.stop,
                kept_tokens=bucket.max_kept,
                device_fraction=_clean(value["g"]),
                host_fraction=_clean(value["c"]),
                recompute_fraction=_clean(value["x"]),
                step_time_s=step,
            )
        )
    return Plan(
        hardware=cost.hardware.name,
        model=cost.model.name,
        workload=cost.workload,
        buckets=tuple(bucket_plans),
        weight_host_fraction=_clean(weight_host),
        peak_device_bytes=device_peak,
        peak_host_bytes=host_peak,
        prefill_s=cost.prefill_time(),
        decode_s=decode,
        simulated=cost.hardware.simulated,
        fetch_bytes_per_step=max(cost.retention_terms(b)["fetch_bytes"] for b in buckets),
    )


def _solver():
    """The one place the solver is chosen: CBC as bundled with PuLP, quiet."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # PuLP 3.3 deprecates the bundle name
        return pulp.PULP_CBC_CMD(msg=False)


def _clean(value: float) -> float:
    return 0.0 if abs(value) < 1e-9 else min(1.0, max(0.0, value))


def _check_device(cost: CostModel, buckets: list[Bucket], options: Options) -> None:
    model, wl = cost.model, cost.workload
    weights = model.total_weight_bytes
    resident_weights = weights / model.num_layers if options.allow_weight_offload else weights
    worst = max(buckets, key=lambda b: b.max_kept)
    recent = wl.recent_fraction * worst.max_kept * cost.kv_token
    # The off-device KV of the attending layer and of the prefetched next one.
    streamed = (
        gathered_layers(model.num_layers)
        * (1 - wl.recent_fraction)
        * worst.max_kept
        * cost.kv_token
        / model.num_layers
    )
    need = resident_weights + cost.activation_bytes + recent + streamed
    if need > cost.hardware.device_bytes:
        what = "one streamed layer of weights" if options.allow_weight_offload else "the weights"
        short = need - cost.hardware.device_bytes
        raise ValueError(
            f"device_bytes={cost.hardware.device_bytes} cannot hold {what} "
            f"({resident_weights:.0f} B), activations ({cost.activation_bytes:.0f} B) and the "
            f"recent window ({recent + streamed:.0f} B): short by {short:.0f} bytes"
        )


def _raise_host_shortfall(cost: CostModel, buckets: list[Bucket], options: Options) -> None:
    problem, _, _ = build_lp(cost, buckets, options, host_limit=False)
    if pulp.LpStatus[problem.solve(_solver())] != "Optimal":
        raise ValueError("no placement fits the device budget in every step bucket")
    needed = pulp.value(problem.objective)
    short = needed - cost.hardware.host_bytes
    raise ValueError(
        f"host_bytes={cost.hardware.host_bytes} is too small: the KV that cannot stay "
        f"on the device needs {needed:.0f} bytes, short by {short:.0f} bytes"
    )
