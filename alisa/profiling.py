"""Measure this machine for the scheduler: copy, matmul, memory, recompute rates, step overhead."""

from __future__ import annotations

import platform
import statistics
from collections.abc import Callable

import psutil
import torch

from alisa.architecture import model_shape
from alisa.cache import AlisaCache
from alisa.config import AlisaConfig
from alisa.engine import DecodeState, Engine, device_clock
from alisa.planning import model_spec
from alisa.storage.recompute import KVRecomputer
from scheduler import HardwareProfile, activation_bytes, gathered_layers


def _median_seconds(work: Callable[[], object], device: torch.device, repeats: int = 5) -> float:
    work()  # warm-up: allocation, kernels, caches
    times = []
    for _ in range(repeats):
        start = device_clock(device)
        work()
        times.append(device_clock(device) - start)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, megabytes: int = 256) -> tuple[float, float]:
    """(host->device, device->host) bytes/s: pinned copies on CUDA, pool-to-pool copies on CPU."""
    count = megabytes * 2**20 // 2
    host = torch.empty(count, dtype=torch.float16)
    if device.type == "cuda":
        host = host.pin_memory()
    target = torch.empty(count, dtype=torch.float16, device=device)
    h2d = host.nbytes / _median_seconds(lambda: target.copy_(host, non_blocking=True), device)
    d2h = host.nbytes / _median_seconds(lambda: host.copy_(target, non_blocking=True), device)
    return h2d, d2h


def matmul_flops(device: torch.device, dtype: torch.dtype, size: int = 1024) -> float:
    """Dense matmul throughput, FLOP/s, in the model's dtype."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    return 2 * size**3 / _median_seconds(lambda: a @ b, device)


def memory_bandwidth(device: torch.device, megabytes: int = 256) -> float:
    """Bytes/s of reading a large tensor (a reduction streams it once)."""
    x = torch.ones(megabytes * 2**20 // 4, device=device)
    return x.nbytes / _median_seconds(lambda: x.sum(), device)


def half_offload_budget(spec, batch: int, tokens: int) -> int:
    """A device budget (bytes) that leaves about half of ``batch`` x ``tokens`` KV off-device.

    ``spec`` is a :class:`scheduler.ModelSpec`. The terms are the planner's: weights, one
    step's activations, half the KV, and the gathered off-device share of the attending (and
    prefetched) layer.
    """
    kv = spec.kv_bytes_per_token() * batch * tokens
    gathered = gathered_layers(spec.num_layers) * 0.5 * kv / spec.num_layers
    return int(spec.total_weight_bytes + activation_bytes(spec, batch) + 0.5 * kv + gathered)


def _decode_step(
    model, device: torch.device, batch: int, context: int, config: AlisaConfig | None = None
) -> tuple[float, AlisaCache]:
    """(median seconds of one decode step of ``batch`` sequences at ``context`` tokens, cache)."""
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(min(10, vocab - 1), min(1000, vocab), (batch, context), device=device)
    cache = AlisaCache(model, config, max_new_tokens=16)
    # generate()'s own step (mask, positions, forward, pick): all of it is what a step costs.
    engine = Engine(model)
    state = DecodeState.start(ids, torch.ones_like(ids))
    with torch.inference_mode():

        def step() -> None:
            state.advance(engine.step(state, cache))

        step()  # the prefill
        return _median_seconds(step, device, repeats=7), cache


# The KV-heavy decode step both calibrations use: (batch, context tokens).
HEAVY_STEP = (4, 1024)


def calibrate_decode(
    model, device: torch.device, bandwidth: float, flops: float
) -> tuple[float, float, float]:
    """(fixed seconds per step, KV bytes read per second, seconds of the heavy step).

    Step time = overhead + max(weights / bandwidth, FLOPs / flops) + KV bytes / kv_rate, solved
    from a small step (batch 1, 16 tokens) and a KV-heavy one (:data:`HEAVY_STEP`), which
    :func:`calibrate_tiers` reuses as its all-resident reference.
    """
    spec = model_spec(model, model_shape(model))
    points, seconds = [], 0.0
    for batch, context in ((1, 16), HEAVY_STEP):
        seconds, _ = _decode_step(model, device, batch, context)
        fixed = max(
            spec.total_weight_bytes / bandwidth, batch * spec.decode_flops_per_token() / flops
        )
        points.append((seconds - fixed, batch * context * spec.kv_bytes_per_token(16)))
    (small_time, small_kv), (large_time, large_kv) = points
    per_byte = max(1e-15, (large_time - small_time) / (large_kv - small_kv))
    overhead = max(0.0, small_time - small_kv * per_byte)
    return overhead, 1.0 / per_byte, seconds  # the loop ends on the heavy step


def calibrate_tiers(
    model,
    device: torch.device,
    h2d: float,
    rebuild: float,
    batch: int = HEAVY_STEP[0],
    context: int = HEAVY_STEP[1],
    resident: float | None = None,
) -> tuple[float, float]:
    """(host-read bytes/s, recompute FLOP/s) as the tiered cache really achieves them.

    Copy and matmul micro-benchmarks miss the per-layer gathers, small copies and the extra
    attention parts of a tiered step. Three real decode steps (all resident, about half on the
    host, about half recomputed) give the effective rates; they only ever lower the
    micro-benchmark figures (copies hidden behind compute on CUDA would otherwise read as
    free). ``resident``: seconds of the all-resident step if already measured
    (:func:`calibrate_decode` returns it for :data:`HEAVY_STEP`).
    """
    spec = model_spec(model, model_shape(model))
    bits = torch.finfo(next(model.parameters()).dtype).bits
    budget = half_offload_budget(spec, batch, context + 16)
    if resident is None:  # seconds of the same step with everything on the device
        resident, _ = _decode_step(model, device, batch, context)
    hosted, cache = _decode_step(
        model, device, batch, context, AlisaConfig(gpu_memory=budget, recompute="never")
    )
    host_bytes = cache.tier_tokens()["host"] * spec.kv_bytes_per_token() / spec.num_layers
    if host_bytes > 0:
        h2d = min(h2d, host_bytes / max(hosted - resident, 1e-9))
    rebuilt, cache = _decode_step(
        model, device, batch, context, AlisaConfig(gpu_memory=budget, recompute="always")
    )
    tokens = cache.tier_tokens()["recompute"] / spec.num_layers  # per layer, as the cost model
    if tokens > 0:
        # The hidden states are read like host KV, then projected: the rest is recompute.
        read = tokens * spec.hidden_bytes_per_token(bits) / h2d
        busy = max(rebuilt - resident - read, 1e-9)
        rebuild = min(rebuild, tokens * spec.recompute_flops_per_token() / busy)
    return h2d, rebuild


def recompute_flops(model, device: torch.device, tokens: int = 512) -> float:
    """Effective FLOP/s of rebuilding K/V for one layer from stored attention inputs."""
    recomputer = KVRecomputer(model)
    hidden_size = model.config.hidden_size
    dtype = next(model.parameters()).dtype
    hidden = torch.randn(1, tokens, hidden_size, device=device).to(dtype)
    positions = torch.arange(tokens, device=device).view(1, -1)
    shape = recomputer.adapter.shape
    flops = 2.0 * tokens * hidden_size * 2 * shape.num_kv_heads * shape.head_dim  # K and V
    with torch.inference_mode():
        return flops / _median_seconds(lambda: recomputer(0, hidden, positions), device)


def measure(
    model=None, device: torch.device | None = None, dtype: torch.dtype = torch.bfloat16
) -> HardwareProfile:
    """A :class:`HardwareProfile` of this machine (optionally calibrated on a loaded model)."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    h2d, d2h = copy_bandwidth(device)
    bandwidth = memory_bandwidth(device)
    flops = matmul_flops(device, dtype if model is None else next(model.parameters()).dtype)
    if device.type == "cuda":
        device_bytes, host_bytes = (
            torch.cuda.get_device_properties(device).total_memory,
            psutil.virtual_memory().total,
        )
    else:
        device_bytes = host_bytes = psutil.virtual_memory().total
    overhead, rebuild, kv_rate = 0.0, 0.0, 0.0
    if model is not None:
        overhead, kv_rate, resident = calibrate_decode(model, device, bandwidth, flops)
        rebuild = recompute_flops(model, device)
        h2d, rebuild = calibrate_tiers(model, device, h2d, rebuild, resident=resident)
    return HardwareProfile(
        name=f"{platform.node() or 'host'} {device.type} "
        f"({torch.get_num_threads()} threads, measured)",
        device_bytes=device_bytes,
        host_bytes=host_bytes,
        h2d_bytes_per_s=h2d,
        d2h_bytes_per_s=d2h,
        device_flops=flops,
        device_bytes_per_s=bandwidth,
        overlap=device.type == "cuda",
        step_overhead_s=overhead,
        recompute_flops=rebuild,
        kv_bytes_per_s=kv_rate,
    )
