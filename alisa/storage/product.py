"""The key sketch's product on a CPU as one compiled pass (numba), for CPUs without a fast
bfloat16 product.

Host retention scores every stored token against each step's queries through the key sketch
(:class:`~alisa.storage.sketch.KeySketch`): per (sequence, KV head), G query heads against W
kept channels of every position, a (G, W) x (W, N) product with W = 32 and G = 3-4 on the
models users run. On a CPU without AVX-512 BF16 PyTorch has no fast bfloat16 product, and
widening the sketch to float32 for its product costs a copy of it per layer and step; a GEMM
library also does poorly with three rows. :func:`sketch_logits` reads the bfloat16 bits (or the
INT8 codes) in place, widens them in registers and accumulates over the channels in order, a
block of positions at a time in float32 vectors: on an AVX2 AMD EPYC (rows split over 2 threads,
:mod:`alisa.kernel_threads`) 1.3-3 times faster than the widened PyTorch product at 2,080
positions and 2.7-14 times at 8,000 (``python -m experiments.bench_sketch``).

The arithmetic is fixed: each product of two bfloat16 values is exact in float32, the sum runs
over the channels in order from 0 (so a fused multiply-add gives the same bits), an INT8 code's
product is then multiplied by its position's scale, and the result is rounded to the nearest
bfloat16, ties to even. A GEMM that sums its inner dimension in order gives the same bits
(PyTorch's float32 product on the (W, N) layout did on the machines measured);
``tests/test_sketch.py`` checks the kernel against that sum written out in NumPy.
InfiniGen (https://arxiv.org/abs/2406.19707) ranks tokens by partial channels the same way.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from alisa.ops.numba_cache import kernel

# Positions per block: the G running sums of a block (G x 16 KB of float32) stay in the L2
# cache, and each channel's codes are read in runs of up to 8 KB, long enough for the hardware
# prefetcher to follow (512-position blocks, 1 KB runs, were 1.1-1.3 times slower from memory).
BLOCK = 4096


@intrinsic
def _bfloat16_value(typingctx, bits):
    """float32 of a bfloat16 given as its uint16 bits (exact: the bits are the top half)."""

    def codegen(context, builder, signature, args):
        word = ir.IntType(32)
        shifted = builder.shl(builder.zext(args[0], word), ir.Constant(word, 16))
        return builder.bitcast(shifted, ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def _float_bits(typingctx, value):
    """The uint32 bits of a float32."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


def _widen(code):  # pragma: no cover - typed by the overload below, never called from Python
    raise NotImplementedError


@overload(_widen)
def _widen_overload(code):
    """A sketch element as float32: bfloat16 bits (uint16) or an INT8 code."""
    if code == types.uint16:
        return lambda code: _bfloat16_value(code)
    if code == types.int8:
        return lambda code: np.float32(code)
    return None


@numba.njit(inline="always")
def _round_bfloat16(value: np.float32) -> np.uint16:
    """The bits of ``value`` rounded to the nearest bfloat16, ties to even; NaN becomes the
    all-ones NaN, as PyTorch's vectorised conversion writes it (it ranks below every number)."""
    bits = _float_bits(value)
    rounded = np.uint16((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16)
    return np.uint16(0xFFFF) if value != value else rounded


@kernel(parallel=True, nogil=True)
def sketch_logits(
    query: np.ndarray,
    channels: np.ndarray,
    keys: np.ndarray,
    scales: np.ndarray,
    out: np.ndarray,
    parts: int,
) -> None:
    """Estimated logits of every position: ``query @ keys`` per row, rounded to bfloat16.

    Parameters
    ----------
    query
        (R, G, D) float32: each row's G queries, every channel (the kernel takes the sketch's
        channels and rounds them to bfloat16 as ``Tensor.to(torch.bfloat16)`` does: in the
        kernel, where a gather and a conversion were two dispatched operators per layer).
    channels
        (R, W) int64: the sketch's channels of each row, in the sketch's order.
    keys
        (R, W, N) the sketch, channel-major: uint16 bfloat16 bits or int8 codes.
    scales
        (R, N) float32 each position's scale (INT8 codes), or (R, 0) for none.
    out
        (R, G, M) uint16, M <= N, written: the bfloat16 bits of the logits of positions
        [0, M) (the positions a caller ranks; later ones are not read).
    parts
        Rows are split into this many parts, run in parallel
        (:func:`alisa.kernel_threads.kernel_parts`); the results do not depend on it.
    """
    rows = query.shape[0]
    size = (rows + parts - 1) // parts
    for part in numba.prange(parts):
        logits_rows(query, channels, keys, scales, out, part * size, min(rows, (part + 1) * size))


@numba.njit(inline="always", error_model="numpy", fastmath={"contract"})
def _add_four(total, picked, group, groups, channel, k0, k1, k2, k3, size):
    """Add four channels' products to the running sums of query heads ``group`` to ``group +
    groups`` (1-3; each its own loop, so that it vectorises) over a block of ``size``
    positions. The heads of one loop share the widened codes, and their sums are independent
    chains: one head's sum alone is a chain of dependent multiply-adds whose latency, not the
    arithmetic, set the pace (1.4-1.7 times slower, ``docs/host-speed.md``, stop 59)."""
    a = picked[group, channel : channel + 4]
    first = total[group]
    if groups == 1:
        for index in range(size):
            first[index] = (
                ((first[index] + a[0] * _widen(k0[index])) + a[1] * _widen(k1[index]))
                + a[2] * _widen(k2[index])
            ) + a[3] * _widen(k3[index])
        return
    b = picked[group + 1, channel : channel + 4]
    second = total[group + 1]
    if groups == 2:
        for index in range(size):
            w0, w1 = _widen(k0[index]), _widen(k1[index])
            w2, w3 = _widen(k2[index]), _widen(k3[index])
            first[index] = (((first[index] + a[0] * w0) + a[1] * w1) + a[2] * w2) + a[3] * w3
            second[index] = (((second[index] + b[0] * w0) + b[1] * w1) + b[2] * w2) + b[3] * w3
        return
    c = picked[group + 2, channel : channel + 4]
    third = total[group + 2]
    for index in range(size):
        w0, w1 = _widen(k0[index]), _widen(k1[index])
        w2, w3 = _widen(k2[index]), _widen(k3[index])
        first[index] = (((first[index] + a[0] * w0) + a[1] * w1) + a[2] * w2) + a[3] * w3
        second[index] = (((second[index] + b[0] * w0) + b[1] * w1) + b[2] * w2) + b[3] * w3
        third[index] = (((third[index] + c[0] * w0) + c[1] * w1) + c[2] * w2) + c[3] * w3


@kernel(nogil=True, error_model="numpy", fastmath={"contract"})
def logits_rows(
    query: np.ndarray,
    channels: np.ndarray,
    keys: np.ndarray,
    scales: np.ndarray,
    out: np.ndarray,
    low: int,
    high: int,
) -> None:
    """:func:`sketch_logits` of rows [low, high) (also called per row by :mod:`alisa.kv.fused`)."""
    groups = query.shape[1]
    width = channels.shape[1]
    positions = out.shape[2]  # positions [0, M) are scored
    scaled = scales.shape[1] > 0
    total = np.empty((groups, BLOCK), dtype=np.float32)
    picked = np.empty((groups, width), dtype=np.float32)  # this row's queries, sketched
    for row in range(low, high):
        for group in range(groups):
            for channel in range(width):
                value = query[row, group, channels[row, channel]]
                picked[group, channel] = _bfloat16_value(_round_bfloat16(value))
        for begin in range(0, positions, BLOCK):
            size = min(BLOCK, positions - begin)
            end = begin + size
            total[:, :size] = 0.0
            channel = 0
            # Four channels per pass over the block: the sum keeps the channel order (each step
            # adds one product to the running sum), with a quarter of the loads and stores.
            while channel + 4 <= width:
                k0 = keys[row, channel, begin:end]
                k1 = keys[row, channel + 1, begin:end]
                k2 = keys[row, channel + 2, begin:end]
                k3 = keys[row, channel + 3, begin:end]
                group = 0
                while group < groups:
                    # Three heads a pass, or two (four heads are two passes of two, not 3 + 1).
                    left = groups - group
                    step = 2 if left in (2, 4) else min(3, left)
                    _add_four(total, picked, group, step, channel, k0, k1, k2, k3, size)
                    group += step
                channel += 4
            while channel < width:
                k0 = keys[row, channel, begin:end]
                for group in range(groups):
                    q0 = picked[group, channel]
                    running = total[group]
                    for index in range(size):
                        running[index] = running[index] + q0 * _widen(k0[index])
                channel += 1
            for group in range(groups):
                running = total[group]
                target = out[row, group, begin:end]
                if scaled:
                    scale = scales[row, begin:end]
                    for index in range(size):
                        target[index] = _round_bfloat16(running[index] * scale[index])
                else:
                    for index in range(size):
                        target[index] = _round_bfloat16(running[index])
