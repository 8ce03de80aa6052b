"""The CPU backend (``kernels="cpu"``): host retention's decode step as numba-compiled kernels.

On a CPU each dispatched PyTorch operator of a decode step costs microseconds of fixed work, and
host retention's step is dozens of them per layer over small arrays; each kernel here does one
job in one pass per (sequence, KV head) row. A concept's kernels stay side by side, in sections
(each was a module of its own before, and keeps its notes as a comment), and each has its
PyTorch definition in :mod:`alisa.ops.reference` or next to its caller; ``tests/test_kernels.py``
and ``tests/test_ops.py`` compare them exactly:

* threads: how many parts a kernel splits its rows into (:func:`kernel_parts`);
* the key sketch's product (:func:`sketch_logits`);
* the choice, the slot swap, the history, the new token's slot (:func:`choose`,
  :func:`accumulate`, :func:`place_one`);
* host rows into slots, rows coded, attention over slots (:func:`fetch_rows`,
  :func:`code_rows`, :func:`put_slots`, :func:`slot_logits`, :func:`slot_output`);
* the whole selection in one call (:func:`select_and_fetch`);
* a decode step's attention over a region's slots (:func:`attend_slots`);
* dropping's attention sums and eviction (:func:`add_sums`, :func:`evict`);
* the selection composed from them (:func:`select_rule`, :func:`swapped`, :func:`fused`), which
  :attr:`alisa.ops.backends.Ops.select` binds.

ALISA, https://arxiv.org/abs/2403.17312 (§IV, phase II).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.core import cgutils, config
from numba.extending import intrinsic, overload
from numba.np.ufunc import parallel

from alisa.ops.numba_cache import kernel
from alisa.ops.reference import (
    FREE,
    ChoiceInputs,
    Eviction,
    Incoming,
    Selected,
    SelectionStep,
    taken_by_budget,
)

# =================================================================================================
# Threads: how many parts a kernel splits its rows into (was alisa/kernel_threads.py)
# =================================================================================================

# How many parts a compiled CPU kernel splits its rows into: torch's thread count, where numba's
# parallel loops run on OpenMP as torch's operators do, else one.
#
# Host retention's per-layer kernels (the key sketch's product, the choice, the fetch, the
# attention history) work row by row, one row per (sequence, KV head), and rows are independent.
# Between two torch operators, torch's OpenMP threads are idle (or spinning, waiting for work).
# numba's ``omp`` threading layer runs its parallel loops on an OpenMP pool as well; with PyTorch's
# pip wheels that is a second ``libgomp`` (the system's, beside the copy torch bundles), so the
# kernel's threads are not torch's, but OpenMP's way of waiting keeps them out of each other's
# way: on a 2-core AVX2 EPYC the sketch product took 0.55 instead of 0.94 ms at B = 16 x 2,300
# positions, and a torch linear right after a kernel ran at 1.01x its time after a torch operator
# (stop 46, interleaved, 750 pairs). The other layers (``workqueue``, ``tbb``) start threads that
# do contend with torch's: the same split under ``workqueue`` was slower than one thread.
# Splitting rows never changes a result: each row is computed by the same code, only on another
# thread.


@kernel(parallel=True)
def _probe(values: np.ndarray) -> float:
    """A parallel loop, so that numba chooses its threading layer."""
    total = 0.0
    for index in numba.prange(values.shape[0]):
        total += values[index]
    return total


@functools.cache
def shares_torch_threads() -> bool:
    """Whether numba's parallel loops run on OpenMP (the ``omp`` layer), whose threads keep out
    of torch's way (see the module; numba chooses its layer once per process, at its first
    parallel loop)."""
    threads = torch.get_num_threads()
    _probe(np.zeros(2))
    # Loading the omp layer sets OpenMP's thread count to numba's, whatever it was asked for
    # (torch's count read back 2 after a first loop on a machine set to 1): put torch's back.
    torch.set_num_threads(threads)
    return numba.threading_layer() == "omp"


def kernel_parts(rows: int, parts: int | None = None) -> int:
    """Parts to split ``rows`` independent rows into for a parallel kernel: torch's intra-op
    thread count (capped by numba's and by ``rows``) where the threads are shared, else 1; numba's
    next parallel loop on this thread runs exactly that many threads.

    Every kernel call asks this before its first parallel loop, so numba's threads start in
    :func:`shares_torch_threads`, which keeps torch's thread count as it was.

    Parameters
    ----------
    rows
        Independent rows the kernel splits.
    parts
        The caller's own count instead (a test splits rows into more parts than this machine has
        threads), capped by ``rows``; numba's thread count is then left as it is (a parallel
        loop runs its parts on the threads it has). None: the count above.

    Returns
    -------
    int
        At least 1, at most ``max(rows, 1)``.

    Raises
    ------
    ValueError
        ``parts`` is not a whole number of at least 1 (a kernel would split rows into none).
    """
    if parts is not None:
        if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
            raise ValueError(f"parts={parts!r} must be a whole number of at least 1")
        return max(1, min(rows, parts))
    shared = shares_torch_threads()
    parts = 1
    if rows > 1 and shared:
        parts = max(1, min(rows, torch.get_num_threads(), config.NUMBA_NUM_THREADS))
    # numba sizes a parallel loop's team by its own thread count, not by the loop's length: a
    # larger team than the parts wakes threads with nothing to do, whose wait at the loop's end
    # (a spin, by OpenMP's default) takes cores that other processes may be using. The count is
    # per calling thread. It is read by numba's own getter, which its threads' start (above)
    # defines, without numba.get_num_threads's initialisation lock (a multiprocessing lock): the
    # kernels ask every layer and step, and setting an unchanged size through that lock cost
    # more than some of the kernels' own work at one sequence.
    if parallel._get_num_threads() != parts:
        numba.set_num_threads(parts)
    return parts


# =================================================================================================
# The key sketch's product (was alisa/storage/product.py)
# =================================================================================================

# The key sketch's product on a CPU as one compiled pass (numba), for CPUs without a fast
# bfloat16 product.
#
# Host retention scores every stored token against each step's queries through the key sketch
# (:class:`~alisa.kv.ranking.KeySketch`): per (sequence, KV head), G query heads against W
# kept channels of every position, a (G, W) x (W, N) product with W = 32 and G = 3-4 on the
# models users run. On a CPU without AVX-512 BF16 PyTorch has no fast bfloat16 product, and
# widening the sketch to float32 for its product costs a copy of it per layer and step; a GEMM
# library also does poorly with three rows. :func:`sketch_logits` reads the bfloat16 bits (or the
# INT8 codes) in place, widens them in registers and accumulates over the channels in order, a
# block of positions at a time in float32 vectors: on an AVX2 AMD EPYC (rows split over 2 threads,
# :func:`kernel_parts`) 1.3-3 times faster than the widened PyTorch product at 2,080 positions
# and 2.7-14 times at 8,000 (``python -m experiments.kernels sketch``).
#
# The arithmetic is fixed: each product of two bfloat16 values is exact in float32, the sum runs
# over the channels in order from 0 (so a fused multiply-add gives the same bits), an INT8 code's
# product is then multiplied by its position's scale, and the result is rounded to the nearest
# bfloat16, ties to even. A GEMM that sums its inner dimension in order gives the same bits
# (PyTorch's float32 product on the (W, N) layout did on the machines measured);
# ``tests/test_sketch.py`` checks the kernel against that sum written out in NumPy.
# InfiniGen (https://arxiv.org/abs/2406.19707) ranks tokens by partial channels the same way.


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


def _prefetcher(write: bool):
    """An intrinsic ``prefetch(array, index)``: ask for the cache line of 1-D ``array[index]``
    (no bounds check, no fault: a hint), for reading or, with ``write``, for writing."""

    @intrinsic
    def prefetch(typingctx, array, index):
        def codegen(context, builder, signature, args):
            kind = signature.args[0]
            view = context.make_array(kind)(context, builder, args[0])
            pointer = cgutils.get_item_pointer(
                context, builder, kind, view, [args[1]], wraparound=False, boundscheck=False
            )
            word, byte = ir.IntType(32), ir.IntType(8).as_pointer()
            function = cgutils.get_or_insert_function(
                builder.module,
                ir.FunctionType(ir.VoidType(), [byte, word, word, word]),
                "llvm.prefetch.p0",
            )
            # (address, write, locality 3: keep in every level, data cache)
            flags = (ir.Constant(word, int(write)), ir.Constant(word, 3), ir.Constant(word, 1))
            builder.call(function, [builder.bitcast(pointer, byte), *flags])
            return context.get_dummy_value()

        return types.void(array, index), codegen

    return prefetch


_prefetch_read = _prefetcher(write=False)
_prefetch_write = _prefetcher(write=True)


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
        Rows are split into this many parts, run in parallel (:func:`kernel_parts`); the
        results do not depend on it.
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


# =================================================================================================
# The choice, the slot swap, the history, the new token's slot (was alisa/kv/kernels.py)
# =================================================================================================

# Compiled CPU kernels for ``retention="host"``'s decode step (numba).
#
# On a CPU a host step written as PyTorch ops is dozens of small passes over (B, H_kv, n) arrays
# per layer (score, protect, rank, diff against the held slots, find free slots, fetch lists),
# each dominated by its fixed cost: at B = 16 x 2,048 tokens that was 130 ms of a 310 ms step
# (``docs/host-speed.md``). Each kernel here does one job in one pass per (sequence, KV head) row
# and writes only what its caller owns:
#
# * :func:`choose` (for :class:`~alisa.kv.host.HostKeeper`): this step's chosen positions:
#   protections, the history's picks, then the best sketch logits, found by a radix select; given
#   a fetch list (for :class:`~alisa.kv.slots.SlotMap`), each row's slots are then made exactly
#   those positions: the slots of tokens not chosen freed, each chosen token the device lacks
#   given a free slot and listed to fetch;
# * :func:`accumulate` (for :class:`~alisa.kv.ranking.PositionHistory`): add a step's attention to
#   the history of the positions the slots hold;
# * :func:`place_one` (for :class:`~alisa.kv.slots.SlotMap`): each (sequence, group)'s slot for a
#   decode step's new token, the lowest free one below the frontier or the frontier.
#
# Each has a PyTorch reference next to its caller (the path CUDA takes, where those ops are cheap)
# and tests compare the two exactly (``tests/test_kernels.py``): ranking is by integer keys with a
# defined tie rule (equal scores: the newer position first), so both choose the same tokens.
# ALISA, https://arxiv.org/abs/2403.17312 (§IV, phase II); the radix select follows
# https://doi.org/10.1145/3458817.3476141 (top-k by radix selection).


_RADIX = 8


@numba.njit(inline="always")
def _bf16_level(bits: np.int16) -> np.int32:
    """A bfloat16's order as an integer in [0, 65535] (its bits, negative floats flipped;
    branch-free so that a scan vectorises)."""
    value = np.int32(bits)
    return (value ^ ((value >> 15) & 0x7FFF)) + 32768


@numba.njit(inline="always")
def _f32_key(bits: np.int32) -> np.int64:
    """Order-preserving integer of a float32's bits (negative floats flipped)."""
    value = np.int64(bits)
    return value ^ 0x7FFFFFFF if value < 0 else value


@kernel(nogil=True)
def _threshold(keys: np.ndarray, count: int, bits: int) -> tuple[int, int, int]:
    """The ``count``-th largest of the non-negative ``keys`` (all below ``2**bits``; negative
    ones are not counted) by radix selection, one byte per pass (for the history's 64-bit
    keys: a few hundred, few of them sharing a pass's prefix, so the branch on it predicts
    well; :func:`_level_threshold` is the form for a row's thousands of 16-bit levels).

    Returns (threshold, taken, equal): the value, how many keys equal to it belong to the top
    ``count`` (every key above it does) and how many keys equal it.
    """
    prefix, mask, wanted = 0, 0, count
    histogram = np.zeros((1, 1 << _RADIX), dtype=np.int64)
    for shift in range(bits - _RADIX, -1, -_RADIX):
        histogram[:] = 0
        for key in keys:
            if key >= 0 and (key & mask) == prefix:
                histogram[0, (key >> shift) & 0xFF] += 1
        digit, wanted = _digit(histogram, wanted)
        prefix |= digit << shift
        mask |= 0xFF << shift
        if histogram[0, digit] == wanted and shift > 0:
            # Every key left under this prefix is taken: the cut is the least of them and the
            # later bytes need no pass (the history's distinct keys get here after about half
            # of their eight bytes).
            least = -1
            for key in keys:
                if key >= 0 and (key & mask) == prefix and (least < 0 or key < least):
                    least = key
            equal = 0
            for key in keys:
                equal += key == least
            return least, equal, equal
    return prefix, wanted, histogram[0, prefix & 0xFF]


@kernel(nogil=True)
def _level_threshold(levels: np.ndarray, count: int) -> tuple[int, int, int]:
    """:func:`_threshold` of 16-bit ``levels`` (a row's logit levels; history picks are -1 and
    not counted), in two passes that do not branch on the data.

    A row's levels crowd into a few high bytes (the logits share a few exponents), so counting
    them one histogram at a time waits on the same counter's last increment, and the second
    pass's filter (does the high byte match?) is a coin toss for the branch predictor. Four
    histograms filled in turn, and keys not counted sent to a spare bucket instead of skipped,
    took 3.1 us against 5.4 for a row of 1,844 levels (B = 16 x 2,048 step, stop 59).
    """
    histogram = np.zeros((4, 257), dtype=np.int32)  # bucket 256: not counted
    _count_digits(levels, 8, 0, histogram)  # the high bytes (every level is below 2**16)
    high, wanted = _digit(histogram, count)
    histogram[:] = 0
    _count_digits(levels, 0, high, histogram)  # the low bytes of the levels under ``high``
    low, wanted = _digit(histogram, wanted)
    return high << 8 | low, wanted, histogram[:, low].sum()


@numba.njit(inline="always")
def _count_digits(levels: np.ndarray, shift: int, prefix: int, histogram: np.ndarray) -> None:
    """Add to the four histograms, in turn, the byte at ``shift`` of every non-negative level
    whose bits above that byte are ``prefix``; the others go to bucket 256 (no branch)."""
    size = levels.shape[0]
    whole = size - size % 4
    for start in range(0, whole, 4):
        for lane in range(4):
            _count_level(levels[start + lane], shift, prefix, histogram, lane)
    for index in range(whole, size):
        _count_level(levels[index], shift, prefix, histogram, 0)


@numba.njit(inline="always")
def _count_level(level: int, shift: int, prefix: int, histogram: np.ndarray, lane: int) -> None:
    """One level into histogram ``lane``: its byte at ``shift`` when counted, else bucket 256."""
    counted = level >= 0 and level >> (shift + 8) == prefix
    histogram[lane, (level >> shift) & 0xFF if counted else 256] += 1


@kernel(nogil=True)
def _digit(histogram: np.ndarray, count: int) -> tuple[int, int]:
    """The digit holding the ``count``-th largest key of a histogram pass ((L, 256 or more):
    L histograms of the 256 digits, summed) and how many of the ``count`` are left to take at
    that digit (the keys of higher digits all are)."""
    above = 0
    digit = 255
    while True:
        here = 0
        for lane in range(histogram.shape[0]):
            here += histogram[lane, digit]
        if above + here >= count:
            return digit, count - above
        above += here
        digit -= 1


@kernel(nogil=True)
def _pick_history(
    history: np.ndarray, slots: np.ndarray, low: int, share: int, levels: np.ndarray
) -> int:
    """Flag (level -1) the ``share`` held positions of the ranked span with the most attention
    (> 0); equal sums: the newer first. ``levels[p - low]`` covers the span. Returns how many."""
    keys = np.empty(slots.shape[0], dtype=np.int64)
    found = 0
    for position in slots:
        if low <= position < low + levels.shape[0]:
            key = _f32_key(history[position])
            if key > 0:
                keys[found] = (key << 32) | position  # distinct: the position breaks ties
                found += 1
    cut = 0
    if found > share:
        cut = _threshold(keys[:found], share, 64)[0]
    picked = 0
    for entry in keys[:found]:
        if entry >= cut:
            levels[(entry & 0xFFFFFFFF) - low] = -1
            picked += 1
    return picked


@kernel(nogil=True)
def _choose_row(
    logits: np.ndarray,
    history: np.ndarray,
    slots: np.ndarray,
    share: int,
    first: int,
    low: int,
    high: int,
    seen: int,
    budget: int,
    levels: np.ndarray,
    chosen: np.ndarray,
) -> None:
    """One (sequence, KV head) of :func:`choose`: ``logits`` (G, C), ``history`` (W,) or
    empty, ``slots`` (S,), ``levels`` scratch of at least high - low, ``chosen`` (K,)."""
    span = levels[: high - low]
    # The logit's order over the ranked span, max over the query heads; 0 is below every
    # ordered bfloat16 (only a negative NaN maps there), so the span is counted as > 0. One
    # loop per query head: each is a straight pass over contiguous logits, so it vectorises.
    head = logits[0, low:high]
    for index in range(high - low):
        span[index] = max(_bf16_level(head[index]), 1)
    for g in range(1, logits.shape[0]):
        head = logits[g, low:high]
        for index in range(high - low):
            span[index] = max(span[index], _bf16_level(head[index]))
    wanted = budget - (low - first) - (seen - high)
    candidates = high - low
    if history.shape[0] > 0 and share > 0:
        picked = _pick_history(history, slots, low, share, span)
        wanted -= picked
        candidates -= picked
    cut, ties, equal = 0, 0, 0  # every ranked position above level 0: all of them
    if 0 < wanted < candidates:
        cut, ties, equal = _level_threshold(span, wanted)  # history picks (-1) not counted
    elif wanted <= 0:
        cut = 1 << 16  # none ranked
    written = 0
    for position in range(first, low):
        chosen[written] = position
        written += 1
    # Ties at the cut: the newest ``ties`` of the ``equal`` ones, so skip the older. Written
    # without branches on the data (each entry is stored, and kept by advancing ``written``).
    skip = equal - ties
    ties_seen = 0
    last = chosen.shape[0]
    for index in range(high - low):
        level = span[index]
        tie = level == cut
        if written < last:  # always, unless a row has no recent window and is full
            chosen[written] = low + index
        written += (level < 0) | (level > cut) | (tie & (ties_seen >= skip))
        ties_seen += tie
    for position in range(high, seen):
        chosen[written] = position
        written += 1
    chosen[written:] = seen


@kernel(nogil=True)
def choose_at(
    logits: np.ndarray,
    history: np.ndarray,
    shares: np.ndarray,
    positions: np.ndarray,
    first: np.ndarray,
    budget: np.ndarray,
    recent: np.ndarray,
    sinks: int,
    seen: int,
    b: int,
    h: int,
    levels: np.ndarray,
    chosen: np.ndarray,
) -> None:
    """Row (``b``, ``h``) of :func:`choose` (its arrays as it takes them) from the row's (G, C)
    ``logits``, into its (K,) ``chosen``: the ranked span [low, high) holds no sink and no
    recent token, then :func:`_choose_row`."""
    low = min(first[b] + sinks, seen)
    high = max(seen - recent[b], low)
    _choose_row(
        logits,
        history[b, h],
        positions[b, h],
        shares[b],
        first[b],
        low,
        high,
        seen,
        budget[b],
        levels,
        chosen,
    )


@kernel(nogil=True)
def swap_row(
    row: np.ndarray,
    chosen: np.ndarray,
    count: int,
    wanted: np.ndarray,
    b: int,
    h: int,
    fetch: np.ndarray,
    start: int,
) -> int:
    """Make one (sequence, KV head)'s slots exactly its chosen positions: ``row`` (S,) slot
    positions, rewritten; ``chosen[:count]`` ascending; ``wanted`` scratch of ``seen`` zeros, left
    zero. Slots whose token is not chosen are freed; the chosen tokens not held, in ascending
    position, take the free slots in ascending order, each listed (sequence ``b``, KV head
    ``h``, slot, position) in ``fetch[:, start:]``. Returns how many."""
    for index in range(count):
        wanted[chosen[index]] = 1
    for slot in range(row.shape[0]):
        position = row[slot]
        if position >= 0:
            if wanted[position]:
                wanted[position] = 2  # held already
            else:
                row[slot] = FREE
    slot = 0
    added = 0
    for index in range(count):
        position = chosen[index]
        if wanted[position] == 1:
            while row[slot] != FREE:
                slot += 1
            row[slot] = position
            fetch[0, start + added] = b
            fetch[1, start + added] = h
            fetch[2, start + added] = slot
            fetch[3, start + added] = position
            added += 1
        wanted[position] = 0
    return added


@kernel(parallel=True, nogil=True)
def choose(
    logits: np.ndarray,
    history: np.ndarray,
    shares: np.ndarray,
    positions: np.ndarray,
    first: np.ndarray,
    budget: np.ndarray,
    recent: np.ndarray,
    sinks: int,
    seen: int,
    chosen: np.ndarray,
    fetch: np.ndarray,
    parts: int,
) -> int:
    """Each (sequence, KV head)'s chosen positions for this step, ascending; with a ``fetch``
    list, each row's slots then made exactly those positions (:func:`swap_row`), as
    :meth:`alisa.kv.slots.SlotMap.swap` makes them.

    Chosen are, in order: the protections (the first ``sinks`` real tokens, the ``recent[b]``
    newest), up to ``shares[b]`` held tokens in between with the most attention history (> 0),
    then the rest of ``budget[b]`` by the sketch logit (the max over the KV head's query
    heads); equal logits: the newer position first.

    Parameters
    ----------
    logits, history, shares, positions, first, budget, recent, sinks, seen
        As :class:`alisa.ops.reference.ChoiceInputs` holds them, as numpy arrays: ``logits`` as
        the int16 bits of the bfloat16 logits, ``history`` as the int32 bits of the float32
        sums, or (B, H, 0) for none. Every row has ``recent[b] >= 1``.
    chosen
        (B, H, K) int64 output, K >= budget.max(): row entries [0, budget[b]) ascending, the rest
        ``seen``.
    fetch
        (4, B * H * K) int64: also swap (``positions`` rewritten; the sequence, KV head, slot
        and position of each token to bring in, row by row, in the first E columns), each row
        right after its choice, so a layer's choice and swap are one call with the rows in
        parallel; (4, 0): only choose.
    parts
        The (sequence, KV head) rows are split into this many parts, run in parallel
        (:func:`kernel_parts`); the result does not depend on it.

    Returns
    -------
    int
        E, the tokens to bring in (0 without a swap).
    """
    batch, heads = logits.shape[:2]
    rows = batch * heads
    width = chosen.shape[2]
    swapping = fetch.shape[1] > 0
    counts = np.zeros(rows, dtype=np.int64)
    size = (rows + parts - 1) // parts
    for part in numba.prange(parts):
        levels = np.empty(seen, dtype=np.int32)  # each part's own scratch
        wanted = np.zeros(seen if swapping else 0, dtype=np.uint8)
        for row in range(part * size, min(rows, (part + 1) * size)):
            b, h = row // heads, row % heads
            args = (history, shares, positions, first, budget, recent, sinks, seen)
            choose_at(logits[b, h], *args, b, h, levels, chosen[b, h])
            if swapping:
                counts[row] = swap_row(
                    positions[b, h], chosen[b, h], budget[b], wanted, b, h, fetch, row * width
                )
    # Each row wrote its entries at row * K: close the gaps, keeping the row order.
    total = 0
    for row in range(rows):
        for entry in range(row * width, row * width + counts[row]):
            for field in range(4):  # element by element: a column slice copy allocates
                fetch[field, total] = fetch[field, entry]
            total += 1
    return total


@numba.njit(inline="always")
def _combined(probabilities: np.ndarray, b: int, h: int, slot: int, head_max: bool) -> float:
    """The G query heads of KV head ``h`` at ``slot`` of (B, H, G, S') attention combined: their
    max, or their sum in head order (:func:`alisa.ops.reference.combine_queries`)."""
    combined = probabilities[b, h, 0, slot]
    for g in range(1, probabilities.shape[2]):
        value = probabilities[b, h, g, slot]
        combined = max(combined, value) if head_max else combined + value
    return combined


@kernel(parallel=True, nogil=True)
def accumulate(
    probabilities: np.ndarray,
    positions: np.ndarray,
    total: np.ndarray,
    scale: np.ndarray,
    head_max: bool,
    parts: int,
) -> None:
    """Add a step's attention over the slots to the history of the positions they hold.

    Parameters
    ----------
    probabilities
        (B, H, G, S') float32 attention of the G query heads of each KV head over the slots.
    positions
        (B, H, S) int64 slot positions (negative: none), S >= S'.
    total
        (B, H, W) float32 sums per position, updated: ``total[p] += combined * scale[b]``.
    scale
        (B,) float32 the history's lazy fading scale.
    head_max
        Combine a KV head's query heads by their max (else their sum, in head order).
    parts
        The (sequence, KV head) rows are split into this many parts, run in parallel
        (:func:`kernel_parts`); the result does not depend on it.
    """
    batch, heads, _, width = probabilities.shape
    rows = batch * heads
    size = (rows + parts - 1) // parts
    for part in numba.prange(parts):
        for row in range(part * size, min(rows, (part + 1) * size)):
            b, h = row // heads, row % heads
            for slot in range(width):
                position = positions[b, h, slot]
                if position < 0:
                    continue
                combined = _combined(probabilities, b, h, slot, head_max)
                total[b, h, position] += combined * scale[b]


@kernel(nogil=True)
def place_one(held: np.ndarray, width: int, seen: int, append: np.ndarray, out: np.ndarray) -> bool:
    """Claim one slot per (sequence, group) for the token at position ``seen``: the lowest
    ``FREE`` slot below ``width``, or ``width`` where the sequence appends; the slot is marked
    as holding ``seen``. As the numpy ops it replaced (a first-true ``argmax``, 0 when a row has
    no free slot), in one call where those took five dispatched array ops per layer and step.

    Parameters
    ----------
    held
        (B, Hs, C) int64 position each slot holds (negative: none); written.
    width, seen
        The frontier (slots at or past it are unused) and the new token's position.
    append
        (B,) bool, whether each sequence appends at the frontier.
    out
        (B, Hs) int64, the slot each (sequence, group) got.

    Returns
    -------
    bool
        Whether some sequence appended (the frontier moves).
    """
    grows = False
    for row in range(held.shape[0]):
        grows |= append[row]
        for group in range(held.shape[1]):
            slot = width
            if not append[row]:
                slot = 0
                for index in range(width):
                    if held[row, group, index] == FREE:
                        slot = index
                        break
            held[row, group, slot] = seen
            out[row, group] = slot
    return grows


# =================================================================================================
# Host rows into slots, attention over slots, rows coded (was alisa/storage/kernels.py)
# =================================================================================================

# Compiled CPU kernels of the device and host regions: host rows gathered or decoded into
# slots, and a decode query's attention over the slots read where they are.
#
# Each decode step brings back the tokens its selection wants that the device does not hold:
# about 12 % of the budget per layer (2,355 rows of keys and values per layer at B = 16 x 2,048,
# SmolLM2-135M). As PyTorch ops that is a gather of the codes, of the scales and of the zero
# points, a conversion, a subtraction, a multiplication and two scatters per layer, each paying its
# fixed cost: 25 ms of a 230 ms CPU step (``docs/host-speed.md``). :func:`fetch_rows` reads each
# row's INT8 codes and writes the dequantized values straight into its device slot, with the same
# float32 arithmetic as :func:`quant.dequantize` (``(code - zero) * scale``), so the values are the
# same bit for bit (``tests/test_kernels.py``). The PyTorch path stays the reference and CUDA's.
# :func:`slot_logits` and :func:`slot_output` compute a decode step's attention over a region's
# slots without the dequantized copy of an INT8 region (:func:`attend_slots`), and
# :func:`code_rows` quantizes each new token into such a region in one call, and :func:`put_slots`
# copies a plain region's new token into its slots.
# ALISA, https://arxiv.org/abs/2403.17312 (§IV, phase II: offloaded KV brought back per step).


# The float32 value of every float16, indexed by its bits read as uint16 (a 256 KiB table:
# numba has no float16, and the conversion is exact, so a lookup is the whole of it).
HALVES = (
    torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16).float().numpy()
)
HALVES.flags.writeable = False


@kernel(inline="always")
def _span(part: int, parts: int, count: int) -> tuple[int, int]:
    """Rows [start, stop) of part ``part`` of ``count`` rows split into ``parts`` (a helper of
    this module's kernels only: numba's cache notices a changed helper in the kernel's own file,
    not in another)."""
    size = (count + parts - 1) // parts
    return part * size, min(count, (part + 1) * size)


@kernel(parallel=True, nogil=True)
def fetch_rows(
    codes: np.ndarray,
    scale: np.ndarray,
    zero: np.ndarray,
    halves: np.ndarray,
    source: np.ndarray,
    target: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    parts: int,
) -> None:
    """Dequantize host rows ``source`` into device rows ``target``.

    Parameters
    ----------
    codes
        (2, N, D) uint8 INT8 codes of keys (0) and values (1), N = B * H_kv * host capacity.
    scale, zero
        (2, N) int16: the bits of each row's float16 scale and zero point (one group per row).
    halves
        :data:`HALVES`.
    source, target
        (E,) int64 rows of ``codes`` to read and of ``keys`` / ``values`` to write (targets
        distinct).
    keys, values
        (M, D) float32 device rows, written.
    parts
        The rows are split into this many parts, run in parallel (:func:`kernel_parts`); the
        result does not depend on it.
    """
    for part in numba.prange(parts):
        start, stop = _span(part, parts, source.shape[0])
        for entry in range(start - AHEAD, stop):
            ahead = entry + AHEAD  # asked for now, decoded AHEAD rows later
            if start <= ahead < stop:
                prefetch_row(codes, scale, zero, source[ahead], target[ahead], keys, values)
            if entry >= start:
                decode_row(codes, scale, zero, halves, source[entry], target[entry], keys, values)


# Rows fetched ahead of the one being decoded. A fetch reads scattered host rows (their codes,
# scales and zero points in four arrays) and writes scattered device rows: about ten cache
# misses per row, which one row's few dozen instructions cannot hide. Asked for this many rows
# early, they arrive while earlier rows decode (B = 16 x 2,048, SmolLM2: 2,600 rows per layer;
# docs/host-speed.md, stop 85).
AHEAD = 8


@numba.njit(inline="always")
def prefetch_row(
    codes: np.ndarray,
    scale: np.ndarray,
    zero: np.ndarray,
    row: int,
    out: int,
    keys: np.ndarray,
    values: np.ndarray,
) -> None:
    """Ask the caches for what :func:`decode_row` of host row ``row`` into device row ``out``
    will read and write (a hint: no result, no fault)."""
    for half in range(2):
        _prefetch_read(codes[half, row], 0)
        _prefetch_read(scale[half], row)
        _prefetch_read(zero[half], row)
    for channel in range(0, keys.shape[1], 16):  # 16 float32: one 64-byte line
        _prefetch_write(keys[out], channel)
        _prefetch_write(values[out], channel)


@kernel(nogil=True)
def decode_row(
    codes: np.ndarray,
    scale: np.ndarray,
    zero: np.ndarray,
    halves: np.ndarray,
    row: int,
    out: int,
    keys: np.ndarray,
    values: np.ndarray,
) -> None:
    """Dequantize host row ``row`` into device row ``out`` (:func:`fetch_rows`'s arrays), keys
    then values: ``(code - zero) * scale`` in float32, each scale and zero point widened from
    its float16 bits by ``halves``."""
    step = halves[scale[0, row] & 0xFFFF]
    offset = halves[zero[0, row] & 0xFFFF]
    for channel in range(codes.shape[2]):
        keys[out, channel] = (np.float32(codes[0, row, channel]) - offset) * step
    step = halves[scale[1, row] & 0xFFFF]
    offset = halves[zero[1, row] & 0xFFFF]
    for channel in range(codes.shape[2]):
        values[out, channel] = (np.float32(codes[1, row, channel]) - offset) * step


@kernel(parallel=True, nogil=True)
def move_rows(
    source: np.ndarray, rows: np.ndarray, target: np.ndarray, slots: np.ndarray, parts: int
) -> None:
    """Copy rows ``rows`` of both halves of a region into rows ``slots`` of ``target``, byte
    for byte: ``target[h, slots[e]] = source[h, rows[e]]``.

    It serves the fetch twice: gathering the chosen host rows into a new tensor
    (:func:`alisa.storage.pages.gathered`, ``slots`` = 0..E-1), and moving them straight into an
    INT8 device region's slots as they are stored (codes, scales, zero points; one call per
    tensor, where a gather and advanced-index writes took six operations per layer). The rows a
    decode step fetches lie scattered through the whole history, so each is a few cache misses:
    the copy waits on memory, not on arithmetic, and parts running in parallel keep more of those
    reads in flight (``torch.index_select`` runs one thread here).

    Parameters
    ----------
    source
        (2, N, W) uint8: the bytes of a region's keys (0) and values (1), W per row.
    rows
        (E,) int64 rows to read, each below N.
    target
        (2, M, W) uint8, written at rows ``slots``.
    slots
        (E,) int64 distinct rows of ``target``, each below M.
    parts
        As :func:`fetch_rows`'s.
    """
    for part in numba.prange(parts):
        start, stop = _span(part, parts, rows.shape[0])
        for entry in range(start, stop):
            row, slot = rows[entry], slots[entry]
            for half in range(source.shape[0]):
                for byte in range(source.shape[2]):
                    target[half, slot, byte] = source[half, row, byte]


# float16's largest finite value, smallest normal and smallest subnormal magnitude.
HALF_MAX = 65504.0
HALF_NORMAL = 2.0**-14
HALF_TINY = 2.0**-24


@numba.njit(inline="always")
def _half_ceil(value: float) -> float:
    """The smallest float16 value >= ``value`` > 0, as a float64 (above :data:`HALF_MAX`: a
    value the caller must refuse)."""
    if value < HALF_NORMAL:
        spacing = HALF_TINY
    else:
        _, exponent = math.frexp(value)  # value = m * 2**exponent, 0.5 <= m < 1
        spacing = math.ldexp(1.0, exponent - 11)  # 10 mantissa bits
    return math.ceil(value / spacing) * spacing


@numba.njit(inline="always")
def _half_bits(value: float) -> int:
    """The float16 bits of ``value``, a float16 value held in a float64 (signed zero kept), as
    the signed 16-bit integer a region's int16 view holds."""
    bits = 0x8000 if math.copysign(1.0, value) < 0.0 else 0
    magnitude = abs(value)
    if magnitude < HALF_NORMAL:
        bits |= int(magnitude / HALF_TINY)
    else:
        mantissa, exponent = math.frexp(magnitude)
        bits |= ((exponent + 14) << 10) | int((mantissa * 2.0 - 1.0) * 1024.0)
    return bits - 0x10000 if bits >= 0x8000 else bits


@kernel(nogil=True)
def put_slots(
    keys: np.ndarray,
    values: np.ndarray,
    new_keys: np.ndarray,
    new_values: np.ndarray,
    slots: np.ndarray,
) -> bool:
    """Copy a decode step's new token of each (sequence, KV head) into its slot, as bytes (any
    dtype): where the flat row index and two ``index_copy_`` calls were five dispatched
    operations per layer and step.

    Parameters
    ----------
    keys, values
        (B, H_kv, C, W) uint8 views of the region's rows; written.
    new_keys, new_values
        (B, H_kv, 1, W) uint8 views of the new token's rows.
    slots
        (B, Hs, 1) int64 slot per (sequence, group), Hs = 1 (every KV head alike) or H_kv.

    Returns
    -------
    bool
        False (nothing written) when a slot is outside [0, C).
    """
    batch, heads, capacity = keys.shape[:3]
    shared = slots.shape[1] == 1
    for row in range(batch):
        for group in range(slots.shape[1]):
            if not 0 <= slots[row, group, 0] < capacity:
                return False
    for row in range(batch):
        for head in range(heads):
            slot = slots[row, 0 if shared else head, 0]
            keys[row, head, slot, :] = new_keys[row, head, 0, :]
            values[row, head, slot, :] = new_values[row, head, 0, :]
    return True


@kernel(nogil=True)
def code_rows(
    tokens: np.ndarray,
    codes: np.ndarray,
    scale: np.ndarray,
    zero: np.ndarray,
    target: np.ndarray,
) -> bool:
    """Quantize token rows to INT8 codes with a float16 scale and zero point per row, written
    straight into their slots: the same bytes as :func:`quant.quantize` (``bits=8``,
    one group per row, float16 scales) followed by three advanced-index writes, which took
    about two dozen small operations per layer and step (0.9 ms at B = 16 on a CPU).

    The float64 arithmetic is quantize's, step for step: scale ``(max - min) / 255`` rounded up
    to float16, zero point ``round(-min / scale)``, codes ``round(x / scale + zero)`` clamped
    to [0, 255]; a constant row stores its value as the scale (1 for zeros) and zero point 0.
    Where quantize would widen the scales to float32 (a scale past float16's range, a constant
    row float16 cannot hold, or a zero point past 2,048, where float16 stops holding every
    integer) nothing is written and False comes back: the caller then takes quantize's path.
    One thread: a decode step brings one row per (sequence, KV head); a prompt's rows (B x H_kv
    x q) take 53 ms per layer at 16 x 3 x 2,048, where quantize's path took about 300.

    Parameters
    ----------
    tokens
        (2, E, D) float32 keys (0) and values (1), one row per (sequence, KV head, token).
    codes
        (2, N, D) uint8 region rows, written at rows ``target``.
    scale, zero
        (2, N) int16 views of the region's float16 scales and zero points, written likewise.
    target
        (E,) int64 distinct rows of the region.

    Returns
    -------
    bool
        Whether the rows were written (all or none).
    """
    halves, entries = tokens.shape[:2]
    steps = np.empty((halves, entries))
    offsets = np.empty((halves, entries))
    for half in range(halves):
        for entry in range(entries):
            holds, step, offset = _row_code(tokens[half, entry])
            if not holds:
                return False
            steps[half, entry], offsets[half, entry] = step, offset
    for half in range(halves):
        for entry in range(entries):
            step, offset = steps[half, entry], offsets[half, entry]
            _put_row(tokens[half, entry], step, offset, codes, scale, zero, half, target[entry])
    return True


@numba.njit(inline="always")
def _row_code(row: np.ndarray) -> tuple[bool, float, float]:
    """Whether float16 holds quantize's scale and zero point of one row, and those (float64;
    a constant row's scale is its value, of either sign) (:func:`code_rows`)."""
    low = high = np.float64(row[0])
    for channel in range(1, row.shape[0]):
        low = min(low, np.float64(row[channel]))
        high = max(high, np.float64(row[channel]))
    if high == low:  # quantize's constant group: the value itself is the scale
        step = 1.0 if low == 0.0 else low
        if low != 0.0 and _half_ceil(abs(low)) != abs(low) or abs(low) > HALF_MAX:
            return False, 0.0, 0.0
        return True, step, 0.0
    step = _half_ceil((high - low) / 255.0)
    offset = np.rint(-low / step)
    if step > HALF_MAX or abs(offset) > 2048.0:
        return False, 0.0, 0.0
    return True, step, offset


@numba.njit(inline="always")
def _put_row(
    row: np.ndarray,
    step: float,
    offset: float,
    codes: np.ndarray,
    scale: np.ndarray,
    zero: np.ndarray,
    half: int,
    out: int,
) -> None:
    """One row's INT8 codes under ``step`` and ``offset`` (quantize's rounding) into region row
    ``out`` of ``half``, with their float16 scale and zero point (:func:`code_rows`' arrays)."""
    for channel in range(row.shape[0]):
        code = np.rint(np.float64(row[channel]) / step + offset)
        codes[half, out, channel] = np.uint8(min(max(code, 0.0), 255.0))
    scale[half, out] = _half_bits(step)
    zero[half, out] = _half_bits(offset)


@kernel(nogil=True)
def code_token(
    keys: np.ndarray,
    values: np.ndarray,
    slots: np.ndarray,
    codes: np.ndarray,
    scale: np.ndarray,
    zero: np.ndarray,
    ring: tuple,
    entry: int,
    position: int,
) -> bool:
    """A decode step's token of every (sequence, KV head) written into an INT8 region in one
    call: its codes at the token's slot (:func:`code_rows`' bytes) and its full-precision copy
    at ring entry ``entry``. As a stack, an index computation, :func:`code_rows` and four ring
    writes it took about 40 us a layer more (SmolLM2-135M, one sequence: the write 4.6-5.3 ->
    3.4-3.7 ms a step, dropping's 2.6; ``docs/host-speed.md``, stop 85)

    Parameters
    ----------
    keys, values
        (B, H_kv, D) float32, the token (any strides).
    slots
        (B, Hs) int64 each (sequence, group)'s slot, Hs = 1 or H_kv.
    codes, scale, zero
        The region as :func:`code_rows` takes it: (2, B * H_kv * C, D) uint8 codes, (2, B *
        H_kv * C) int16 float16 bits; C slots per row.
    ring
        (keys (B, H_kv, E, D), values, slots (B, Hs, E) int64, positions (E,) int64), the
        full-precision ring, written at entry ``entry``; E = 0: none.
    position
        The token's position (the ring's record of what each entry holds).

    Returns
    -------
    bool
        Whether anything was written (all or none: False where quantize would widen a scale).
    """
    batch, heads, _ = keys.shape
    capacity = codes.shape[1] // (batch * heads)
    groups = slots.shape[1]
    steps = np.empty((2, batch, heads))
    offsets = np.empty((2, batch, heads))
    for b in range(batch):
        for h in range(heads):
            for half in range(2):
                holds, step, offset = _row_code(keys[b, h] if half == 0 else values[b, h])
                if not holds:
                    return False
                steps[half, b, h], offsets[half, b, h] = step, offset
    ring_keys, ring_values, ring_slots, ring_positions = ring
    for b in range(batch):
        for h in range(heads):
            slot = slots[b, h % groups]
            out = (b * heads + h) * capacity + slot
            for half in range(2):
                row = keys[b, h] if half == 0 else values[b, h]
                step, offset = steps[half, b, h], offsets[half, b, h]
                _put_row(row, step, offset, codes, scale, zero, half, out)
            if ring_positions.shape[0] > 0:
                ring_keys[b, h, entry] = keys[b, h]
                ring_values[b, h, entry] = values[b, h]
                if h < groups:
                    ring_slots[b, h, entry] = slot
    if ring_positions.shape[0] > 0:
        ring_positions[entry] = position
    return True


@numba.njit(inline="always")
def _ring_rows(
    held: np.ndarray,
    ring_slots: np.ndarray,
    ring_positions: np.ndarray,
    row_of: np.ndarray,
) -> None:
    """``row_of[slot]`` = the ring entry holding the slot's token exactly, else -1: an entry
    counts while its slot still holds the position it was written for."""
    row_of[:] = -1
    for entry in range(ring_slots.shape[0]):
        slot = ring_slots[entry]
        if slot >= 0 and held[slot] == ring_positions[entry]:
            row_of[slot] = entry


@numba.njit(inline="always")
def _unseen(position: int, last: int, window: int) -> bool:
    """Whether a slot holding ``position`` is hidden from the query at ``last``: empty, later,
    or (window W > 0) outside (last - W, last]."""
    return position < 0 or position > last or (window > 0 and position <= last - window)


def _slot_row(stored, scale, zero, halves, ring, row, slot, entry, buffer):  # pragma: no cover
    raise NotImplementedError  # typed by the overload below, never called from Python


@overload(_slot_row, inline="always")
def _slot_row_overload(stored, scale, zero, halves, ring, row, slot, entry, buffer):
    """Slot ``slot`` of row ``row`` into ``buffer`` (D,) float32: ring entry ``entry``'s exact
    row when ``entry`` >= 0, else the stored row: float32 as it is, INT8 codes dequantized as
    :func:`quant.dequantize` computes them (``(code - zero) * scale`` in float32)."""
    if stored.dtype == types.float32:

        def plain(stored, scale, zero, halves, ring, row, slot, entry, buffer):
            source = ring[row, entry] if entry >= 0 else stored[row, slot]
            for channel in range(buffer.shape[0]):
                buffer[channel] = source[channel]

        return plain
    if stored.dtype == types.uint8:

        def coded(stored, scale, zero, halves, ring, row, slot, entry, buffer):
            if entry >= 0:
                for channel in range(buffer.shape[0]):
                    buffer[channel] = ring[row, entry, channel]
                return
            step = halves[scale[row, slot] & 0xFFFF]
            offset = halves[zero[row, slot] & 0xFFFF]
            codes = stored[row, slot]
            for channel in range(buffer.shape[0]):
                buffer[channel] = (np.float32(codes[channel]) - offset) * step

        return coded
    return None


@kernel(parallel=True, nogil=True, fastmath={"reassoc", "contract"})
def slot_logits(
    query: np.ndarray,
    keys: np.ndarray,
    scale: np.ndarray,
    zero: np.ndarray,
    halves: np.ndarray,
    positions: np.ndarray,
    ring_keys: np.ndarray,
    ring_slots: np.ndarray,
    ring_positions: np.ndarray,
    last: int,
    window: int,
    scaling: float,
    logits: np.ndarray,
    parts: int,
) -> None:
    """A decode query's scaled logits over a device region's key slots, read where they are.

    Each key row is loaded (INT8 codes dequantized in registers) and used at once: no copy of
    the region is written, and the logits, the mask and the scaling are one pass instead of
    PyTorch's product, conversion, scaling and masked fill. A slot whose full-precision ring
    entry still holds its token reads the ring's exact row, as
    :meth:`~alisa.storage.quantized.QuantizedStore.read` does. Sums are reassociated (vector
    lanes): the logits match PyTorch's product to float32 rounding, not bit for bit. The
    softmax runs in PyTorch (vectorised exponentials), then :func:`slot_output`.

    Parameters
    ----------
    query
        (R, G, D) float32: R = B * H_kv rows (sequence, KV head), G query heads per KV head.
    keys
        (R, C, D) float32 keys, or uint8 INT8 codes, of C slots.
    scale, zero
        (R, C) int16: the bits of each coded row's float16 scale and zero point (one group per
        row); not read for float32 keys.
    halves
        :data:`HALVES`.
    positions
        (B, Hs, C) int64 position held by each slot (negative: empty); Hs is 1 or H_kv.
    ring_keys
        (R, E, D) float32 full-precision keys of the last E tokens (E may be 0).
    ring_slots
        (B, Hs, E) int64 slot of each ring entry (negative: none).
    ring_positions
        (E,) int64 position each ring entry was written for.
    last
        The query's position: slots holding later positions are not seen.
    window
        A sliding layer's window W (positions (last - W, last] are seen); 0: none.
    scaling
        Softmax scale applied to the float32 logits.
    logits
        (R, G, C) float32, written (-inf where a slot is not seen).
    parts
        As :func:`fetch_rows`'s.
    """
    rows, groups, head_dim = query.shape
    kv_heads = rows // positions.shape[0]
    shared = positions.shape[1] == 1
    factor = np.float32(scaling)
    for part in numba.prange(parts):
        start, stop = _span(part, parts, rows)
        row_of = np.empty(keys.shape[1], dtype=np.int64)
        buffer = np.empty(head_dim, dtype=np.float32)
        for row in range(start, stop):
            sequence, head = row // kv_heads, 0 if shared else row % kv_heads
            held = positions[sequence, head]
            _ring_rows(held, ring_slots[sequence, head], ring_positions, row_of)
            for slot in range(held.shape[0]):
                if _unseen(held[slot], last, window):
                    logits[row, :, slot] = -np.inf
                    continue
                _slot_row(keys, scale, zero, halves, ring_keys, row, slot, row_of[slot], buffer)
                for group in range(groups):
                    total = np.float32(0.0)
                    for channel in range(head_dim):
                        total += query[row, group, channel] * buffer[channel]
                    logits[row, group, slot] = total * factor


@kernel(parallel=True, nogil=True, fastmath={"reassoc", "contract"})
def slot_output(
    probabilities: np.ndarray,
    values: np.ndarray,
    scale: np.ndarray,
    zero: np.ndarray,
    halves: np.ndarray,
    positions: np.ndarray,
    ring_values: np.ndarray,
    ring_slots: np.ndarray,
    ring_positions: np.ndarray,
    out: np.ndarray,
    parts: int,
) -> None:
    """The attention output over a device region's value slots read where they are:
    ``out[r, g] = sum over slots of probabilities[r, g, slot] * value[r, slot]``, each value row
    loaded as in :func:`slot_logits` (slots of probability 0 are skipped).

    Parameters
    ----------
    probabilities
        (R, G, C) float32 softmax over the slots (0 where unseen; NaN in a row that sees none).
    values
        (R, C, D) float32 values, or uint8 INT8 codes.
    scale, zero, halves, positions, ring_slots, ring_positions, parts
        As :func:`slot_logits`'s (of the values).
    ring_values
        (R, E, D) float32 full-precision values of the ring's tokens.
    out
        (R, G, D) float32, written.
    """
    rows, groups, capacity = probabilities.shape
    kv_heads = rows // positions.shape[0]
    shared = positions.shape[1] == 1
    for part in numba.prange(parts):
        start, stop = _span(part, parts, rows)
        row_of = np.empty(capacity, dtype=np.int64)
        buffer = np.empty(out.shape[2], dtype=np.float32)
        for row in range(start, stop):
            sequence, head = row // kv_heads, 0 if shared else row % kv_heads
            held = positions[sequence, head]
            _ring_rows(held, ring_slots[sequence, head], ring_positions, row_of)
            result = out[row]
            result[:] = 0.0
            for slot in range(capacity):
                weighted = False  # 0 * value adds nothing; NaN (a row seeing none) does
                for group in range(groups):
                    weighted |= probabilities[row, group, slot] != 0.0
                if not weighted:
                    continue
                _slot_row(values, scale, zero, halves, ring_values, row, slot, row_of[slot], buffer)
                for group in range(groups):
                    weight = probabilities[row, group, slot]
                    for channel in range(buffer.shape[0]):
                        result[group, channel] += weight * buffer[channel]


# =================================================================================================
# The whole selection in one call (was alisa/kv/fused.py)
# =================================================================================================

# Host retention's selection on a CPU as one compiled call per layer: score, choose, swap, fetch.
#
# A host-retention decode step (:class:`~alisa.kv.host.HostKeeper`) scores every ranked position
# with the key sketch, chooses the tokens to attend, makes the device slots exactly those and
# fetches the tokens the device lacks from the host region. On a CPU each of those is a compiled
# kernel (:func:`alisa.storage.product.sketch_logits`, :func:`alisa.kv.kernels.choose`,
# :func:`alisa.storage.kernels.fetch_rows`), but the Python between them cost more than the
# kernels at one sequence: each line runs after the layer's weights have streamed through the
# caches, at several microseconds a line: at B = 1 the selection took 584 us a layer, 172 of
# them in its three kernels (line timings, ``docs/host-speed.md``, stop 58).
# :func:`select_and_fetch` runs the same row functions in one call, row after row on each thread:
# the sketch's logits of a (sequence, KV head) row (:func:`~alisa.storage.product.logits_rows`),
# its choice (:func:`~alisa.kv.kernels.choose_at`), its slot swap
# (:func:`~alisa.kv.kernels.swap_row`), then each token it lacks decoded from its INT8 host row into
# its new slot (:func:`~alisa.storage.kernels.decode_row`). The same code computes the same bits:
# the result equals the three calls' exactly (``tests/test_kernels.py``).
#
# It takes the layout the separate path takes through its fastest kernels: a float32 device region
# held plain, INT8 host rows with one float16 scale per row, the compiled sketch product. Anything
# else (16-bit or INT4 host regions, INT8 device regions, the rest's estimate, which keeps the
# logits) takes the separate calls.
#
# Its compiled code is cached under a digest of every kernel source
# (:func:`alisa.ops.numba_cache.kernel`), so an edit to a row function in another module is
# compiled anew, never run stale. ALISA, https://arxiv.org/abs/2403.17312 (§IV, phase II).


@kernel(parallel=True, nogil=True)
def select_and_fetch(
    query: np.ndarray,
    channels: np.ndarray,
    sketch: np.ndarray,
    scales: np.ndarray,
    logits: np.ndarray,
    history: np.ndarray,
    shares: np.ndarray,
    positions: np.ndarray,
    first: np.ndarray,
    budget: np.ndarray,
    recent: np.ndarray,
    sinks: int,
    seen: int,
    chosen: np.ndarray,
    codes: np.ndarray,
    scale: np.ndarray,
    zero: np.ndarray,
    halves: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    parts: int,
) -> tuple[int, int]:
    """One layer's selection: each (sequence, KV head) row scored, chosen, swapped and fetched.

    Parameters
    ----------
    query, channels, sketch, scales
        The sketch product's operands, as :func:`sketch_logits` takes them: (R, G, D) float32
        queries, R = B * H_kv; (R, W) channels; (R, W, N) codes; (R, N) or (R, 0) scales.
    logits
        (R, G, M) uint16, written: the bfloat16 bits of the logits of positions [0, M), every
        ranked position below M (what the sketch product writes).
    history, shares, positions, first, budget, recent, sinks, seen, chosen
        As :func:`choose` takes them (``positions`` (B, H_kv, S) rewritten, ``chosen`` (B, H_kv,
        K) written).
    codes, scale, zero, halves
        The host region as :func:`fetch_rows` reads it: (2, R * P, D) uint8 codes, P positions
        per row; (2, R * P) int16 float16 bits; :data:`HALVES`.
    keys, values
        (R * S, D) float32 device rows, slot ``s`` of row ``r`` at ``r * S + s``, written.
    parts
        Rows are split into this many parts, run in parallel (:func:`kernel_parts`); the
        result does not depend on it.

    Returns
    -------
    (int, int)
        Tokens fetched; chosen positions past the host region (0 unless the caller broke the
        invariant that every ranked position is coded: those are not read).
    """
    batch, heads, slots = positions.shape
    rows = batch * heads
    stored = codes.shape[1] // rows
    fetched = np.zeros(rows, dtype=np.int64)
    missing = np.zeros(rows, dtype=np.int64)
    bits = logits.view(np.int16)
    size = (rows + parts - 1) // parts
    for part in numba.prange(parts):
        levels = np.empty(seen, dtype=np.int32)  # each part's own scratch
        wanted = np.zeros(seen, dtype=np.uint8)
        entries = np.empty((4, chosen.shape[2]), dtype=np.int64)
        for row in range(part * size, min(rows, (part + 1) * size)):
            b, h = row // heads, row % heads
            logits_rows(query, channels, sketch, scales, logits, row, row + 1)
            args = (history, shares, positions, first, budget, recent, sinks, seen)
            choose_at(bits[row], *args, b, h, levels, chosen[b, h])
            added = swap_row(positions[b, h], chosen[b, h], budget[b], wanted, b, h, entries, 0)
            for entry in range(-AHEAD, added):
                ahead = entry + AHEAD  # asked for now, decoded AHEAD entries later
                if ahead < added and entries[3, ahead] < stored:
                    early = row * stored + entries[3, ahead]
                    prefetch_row(
                        codes, scale, zero, early, row * slots + entries[2, ahead], keys, values
                    )
                if entry < 0:
                    continue
                position = entries[3, entry]
                if position >= stored:
                    missing[row] += 1
                    continue
                target = row * slots + entries[2, entry]
                decode_row(
                    codes, scale, zero, halves, row * stored + position, target, keys, values
                )
            fetched[row] = added
    return fetched.sum(), missing.sum()


# =================================================================================================
# A decode step's attention over a region's slots (was alisa/storage/attend.py)
# =================================================================================================
# A decode step's attention over a device region's slots on a CPU, by compiled kernels.
#
# PyTorch's path (:func:`alisa.kv.attention.grouped_attention_parts`, the reference and CUDA's)
# needs the region as float tensors: an INT8 region is dequantized whole each step and the layer's
# full-precision ring written over it (``QuantizedStore.read``), about 1 ms per layer at B = 16 x
# 2,048 on SmolLM2-135M, then a product, a conversion, a scaling, a mask built from the slot
# positions, a softmax and a second product, each paying its fixed cost. Here the logits (mask and
# scaling included) are one compiled pass over the stored rows, INT8 codes dequantized in
# registers as they are read (:func:`alisa.ops.cpu.slot_logits`), then PyTorch's softmax,
# then one pass for the output (:func:`~alisa.ops.cpu.slot_output`). KIVI
# (https://arxiv.org/abs/2402.02750) and QServe compute attention on quantized KV the same way,
# dequantizing in the kernel; ALISA (https://arxiv.org/abs/2403.17312, §V) stores INT8 KV.

# Stand-ins for the arrays a region without codes or ring never reads.
_NO_SCALES = np.zeros((0, 0), dtype=np.int16)
_NO_SLOTS = np.zeros((0, 0, 0), dtype=np.int64)
_NO_POSITIONS = np.zeros(0, dtype=np.int64)


class Scales(NamedTuple):
    """(B, H_kv, C) float16 scale and zero point of each coded row (one group per row)."""

    scale: torch.Tensor
    zero: torch.Tensor


class Ring(NamedTuple):
    """Full-precision copies of the last E tokens: (B, H_kv, E, D) keys and values, (B, Hs, E)
    slot of each entry (negative: none), (E,) position each entry was written for."""

    keys: torch.Tensor
    values: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor


def takes(query: torch.Tensor, stored: torch.Tensor) -> bool:
    """Whether :func:`attend_slots` serves a decode step with these (B, H, q, D) queries over
    a region stored as ``stored`` (float32 rows or uint8 codes): one query per sequence, float32
    (the caller runs the compiled CPU kernels: :attr:`alisa.ops.backends.Ops.compiled`)."""
    return (
        query.shape[2] == 1
        and query.dtype == torch.float32
        and stored.dtype in (torch.float32, torch.uint8)
    )


def attend_slots(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    seen: int,
    window: int | None,
    scaling: float,
    *,
    scales: tuple[Scales, Scales] | None = None,
    ring: Ring | None = None,
    parts: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain softmax attention of one query per sequence over the slots of a region.

    Parameters
    ----------
    query
        (B, H, 1, D) float32 queries; query head h reads KV head h // G, G = H / H_kv.
    keys, values
        (B, H_kv, C, D) float32 rows, or uint8 INT8 codes with ``scales``.
    positions
        (B, Hs, C) position held by each slot (negative: empty), Hs = 1 or H_kv.
    seen
        Tokens seen so far: the query's position is ``seen - 1``; later positions are hidden.
    window
        A sliding layer's window W (positions within W of the query are seen), or None.
    scaling
        Softmax scale.
    scales
        The keys' and the values' :class:`Scales` when they are codes.
    ring
        Full-precision rows read instead of a slot's codes while the slot holds their token.
    parts
        The (sequence, KV head) rows are split into this many parts, run in parallel
        (:func:`kernel_parts`; None: its own count); the result does not depend on it.

    Returns
    -------
    tuple
        ((B, 1, H, D) output, (B, H_kv, G, 1, C) float32 probabilities): the shapes of
        :func:`alisa.kv.attention.grouped_attention_parts` for q = 1.
    """
    batch, heads, _, head_dim = query.shape
    kv_heads, capacity = keys.shape[1], keys.shape[2]
    rows, groups = batch * kv_heads, heads // kv_heads
    grouped = query.reshape(rows, groups, head_dim).contiguous()
    held = positions.numpy()
    if ring is None:
        ring_keys = ring_values = np.zeros((rows, 0, head_dim), dtype=np.float32)
        entries = (_NO_SLOTS, _NO_POSITIONS)
    else:
        ring_keys, ring_values = (
            t.reshape(rows, -1, head_dim).numpy() for t in (ring.keys, ring.values)
        )
        entries = (ring.slots.numpy(), ring.positions.numpy())
    key_scales = value_scales = (_NO_SCALES, _NO_SCALES)
    if scales is not None:
        key_scales, value_scales = (
            tuple(t.view(torch.int16).reshape(rows, capacity).numpy() for t in pair)
            for pair in scales
        )
    parts = kernel_parts(rows, parts)
    logits = torch.empty(rows, groups, capacity, dtype=torch.float32)
    keys_stored = keys.reshape(rows, capacity, head_dim).numpy()
    slot_logits(
        grouped.numpy(),
        keys_stored,
        *key_scales,
        HALVES,
        held,
        ring_keys,
        *entries,
        seen - 1,
        window or 0,
        scaling,
        logits.numpy(),
        parts,
    )
    probabilities = logits.softmax(dim=-1)  # PyTorch's vectorised exponentials
    out = torch.empty_like(grouped)
    values_stored = values.reshape(rows, capacity, head_dim).numpy()
    slot_output(
        probabilities.numpy(),
        values_stored,
        *value_scales,
        HALVES,
        held,
        ring_values,
        *entries,
        out.numpy(),
        parts,
    )
    return (
        out.view(batch, 1, heads, head_dim),
        probabilities.view(batch, kv_heads, groups, 1, capacity),
    )


# =================================================================================================
# Dropping: the attention sums and the eviction (alisa.kv.drop)
# =================================================================================================

# Dropping's decode step per layer (ALISA's SWA, H2O, ...) adds the step's attention to per-slot
# sums and evicts each sequence's excess, lowest score first: about fifteen PyTorch operators
# over (B, Hs, S) arrays, each a fixed few tens of microseconds on a CPU, 13-15 % of SmolLM2's
# step at one sequence and at sixteen (2-core EPYC, B = 1 and 16 x 2,048, r = 0.2, timed around
# the keeper in a throw-away run). Each kernel here is one pass per (sequence, group) row with
# the arithmetic of :func:`alisa.ops.reference.add_sums` and :func:`alisa.ops.reference.evict`:
# a float32 product, then a float32 sum, each rounded (no fused multiply-add); the same integer
# keys, so the same slots.

# Up to this many victims per row are kept sorted by insertion (a step evicts one per
# sequence); more are ranked by a sort of the row's keys.
_FEW = 16
_INF_BITS = 0x7F800000  # +inf's float32 bits: a protected slot's priority


@kernel(parallel=True, nogil=True)
def _add_sums(
    total: np.ndarray,
    probabilities: np.ndarray,
    keep: np.ndarray,
    decayed: bool,
    head_max: bool,
    parts: int,
) -> None:
    """total (B, Hs, S) float32 faded by keep (B,) float32 where ``decayed``, then each
    group's G query heads of probabilities (B, Hs, G, S') combined (their max, or their sum in
    head order) and added to its first S' slots, per row of ``parts`` in parallel."""
    batch, groups, width = total.shape
    used = probabilities.shape[3]
    count = batch * groups
    size = (count + parts - 1) // parts
    for part in numba.prange(parts):
        for row in range(part * size, min(count, (part + 1) * size)):
            b, h = row // groups, row % groups
            if decayed:
                factor = keep[b]
                for slot in range(width):
                    total[b, h, slot] = total[b, h, slot] * factor
            for slot in range(used):
                combined = _combined(probabilities, b, h, slot, head_max)
                total[b, h, slot] = total[b, h, slot] + combined


@kernel(parallel=True, nogil=True)
def _evict(
    score_bits: np.ndarray,
    positions: np.ndarray,
    first: np.ndarray,
    seen: int,
    recent: np.ndarray,
    sinks: int,
    excess: np.ndarray,
    victims: np.ndarray,
    taken: np.ndarray,
    parts: int,
) -> None:
    """Per (sequence, group) row, its ``victims.shape[2]`` lowest keys' slots, ascending
    (:func:`alisa.ops.reference.eviction_key` of the protected scores), and ``taken`` below the
    sequence's ``excess``."""
    batch, groups, width = score_bits.shape
    count = victims.shape[2]
    rows = batch * groups
    size = (rows + parts - 1) // parts
    for part in numba.prange(parts):
        keys = np.empty(width, dtype=np.int64)  # each part's own scratch
        best = np.empty(count, dtype=np.int64)
        for row in range(part * size, min(rows, (part + 1) * size)):
            b, h = row // groups, row % groups
            low, high = first[b] + sinks, seen - recent[b]
            for slot in range(width):
                position = positions[b, h, slot]
                bits = score_bits[b, h, slot]
                if position < 0 or position < low or position >= high:
                    bits = _INF_BITS
                keys[slot] = (_f32_key(bits) << 32) | max(position, 0)
            if count <= _FEW:
                filled = 0
                for slot in range(width):
                    key = keys[slot]
                    if filled == count and key >= best[count - 1]:
                        continue
                    at = filled if filled < count else count - 1
                    filled = min(filled + 1, count)
                    while at > 0 and best[at - 1] > key:
                        best[at] = best[at - 1]
                        victims[b, h, at] = victims[b, h, at - 1]
                        at -= 1
                    best[at] = key
                    victims[b, h, at] = slot
            else:
                order = np.argsort(keys)
                for rank in range(count):
                    victims[b, h, rank] = order[rank]
            for rank in range(count):
                taken[b, h, rank] = rank < excess[b]


def evict(step: Eviction, *, parts: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`alisa.ops.reference.evict` in one compiled pass per row (the same slots).

    Parameters
    ----------
    step
        The layer's step (:class:`alisa.ops.reference.Eviction`), its tensors on the CPU.
    parts
        The (sequence, group) rows are split into this many parts, run in parallel
        (:func:`kernel_parts`; None: its own count); the result does not depend on it.

    Returns
    -------
    tuple
        (B, Hs, K) slots and their (B, Hs, K) ``taken``, as the reference returns them.
    """
    batch, groups, _ = step.scores.shape
    count = int(step.excess.max())
    victims = np.empty((batch, groups, count), dtype=np.int64)
    taken = np.empty((batch, groups, count), dtype=np.bool_)
    _evict(
        step.scores.to(torch.float32).view(torch.int32).numpy(),
        step.positions.numpy(),
        np.asarray(step.first, dtype=np.int64),
        step.seen,
        np.asarray(step.recent, dtype=np.int64),
        step.sinks,
        np.asarray(step.excess, dtype=np.int64),
        victims,
        taken,
        kernel_parts(batch * groups, parts),
    )
    return torch.from_numpy(victims), torch.from_numpy(taken)


def add_sums(
    total: torch.Tensor,
    probabilities: torch.Tensor,
    keep: np.ndarray | None,
    head_max: bool,
    *,
    parts: int | None = None,
) -> None:
    """:func:`alisa.ops.reference.add_sums` in one compiled pass per row (the same bits);
    ``parts`` as :func:`evict` takes it."""
    batch, groups, _ = total.shape
    faded = keep is not None
    factors = np.asarray(keep if faded else (), dtype=np.float32)
    _add_sums(
        total.numpy(),
        probabilities.to(torch.float32).numpy(),
        factors,
        faded,
        head_max,
        kernel_parts(batch * groups, parts),
    )


# =================================================================================================
# The selection, composed from the kernels above (alisa.ops.backends.Ops.select binds one)
# =================================================================================================


def select_rule(
    inputs: ChoiceInputs, *, parts: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`alisa.ops.reference.select_rule` by the compiled :func:`choose` (the same
    positions, one pass per row).

    Parameters
    ----------
    inputs
        The step's inputs (:class:`alisa.ops.reference.ChoiceInputs`).
    parts
        The (sequence, KV head) rows are split into this many parts, run in parallel
        (:func:`kernel_parts`; None: its own count); the result does not depend on it.

    Returns
    -------
    tuple
        (chosen, taken), each (B, H_kv, K), as :func:`alisa.ops.reference.select_rule` gives.
    """
    batch, heads = inputs.logits.shape[:2]
    chosen = np.empty((batch, heads, int(inputs.budget.max())), dtype=np.int64)
    nothing = np.empty((4, 0), dtype=np.int64)  # no fetch list: choose only
    choose(*_kernel_inputs(inputs), chosen, nothing, kernel_parts(batch * heads, parts))
    return torch.from_numpy(chosen), taken_by_budget(inputs)


def choose_and_swap(inputs: ChoiceInputs, *, parts: int | None = None) -> Incoming | None:
    """:func:`select_rule`, then the slots ``inputs.positions`` (rewritten in place) made
    exactly the chosen positions as :func:`alisa.ops.reference.swap` makes them, in one kernel
    call (:func:`choose` with a fetch list).

    Parameters
    ----------
    inputs
        The step's inputs (:class:`alisa.ops.reference.ChoiceInputs`).
    parts
        As :func:`select_rule` takes it.

    Returns
    -------
    Incoming or None
        The tokens to bring in, as :func:`alisa.ops.reference.swap` lists them; None: none.
    """
    batch, heads = inputs.logits.shape[:2]
    chosen = np.empty((batch, heads, int(inputs.budget.max())), dtype=np.int64)
    fetch = np.empty((4, chosen.size), dtype=np.int64)
    count = choose(*_kernel_inputs(inputs), chosen, fetch, kernel_parts(batch * heads, parts))
    if count == 0:
        return None
    rows, groups, targets, tokens = torch.from_numpy(fetch[:, :count])
    return Incoming(rows, groups, targets, tokens, rows, groups, tokens)


def swapped(step: SelectionStep, *, parts: int | None = None) -> Selected:
    """The selection in separate compiled calls: the sketch's product where it was left to run
    (``step.operands``), then :func:`choose_and_swap`; the caller fetches the incoming rows.

    Parameters
    ----------
    step
        The layer's step (:class:`alisa.ops.reference.SelectionStep`).
    parts
        Each call's rows are split into this many parts, run in parallel
        (:func:`kernel_parts`; None: its own count); the result does not depend on it.

    Returns
    -------
    Selected
        The count of tokens to bring in, and those tokens (:class:`Incoming`, or None) for the
        caller to fetch.
    """
    if step.operands is not None:
        sketch_logits(*step.operands, kernel_parts(step.operands[0].shape[0], parts))
    incoming = choose_and_swap(step.inputs, parts=parts)
    return Selected(0 if incoming is None else incoming.rows.numel(), incoming)


def fused(step: SelectionStep, *, parts: int | None = None) -> Selected:
    """The selection in one compiled call per layer (:func:`select_and_fetch`): the sketch's
    product, the choice, the slot swap and the fetch of INT8 host rows into a plain float32
    device region. Any other layout takes :func:`swapped`: the same slots and rows.

    Parameters
    ----------
    step
        The layer's step (:class:`alisa.ops.reference.SelectionStep`).
    parts
        As :func:`swapped` takes it.

    Returns
    -------
    Selected
        The count of tokens fetched, none left for the caller; or :func:`swapped`'s.

    Raises
    ------
    IndexError
        A chosen position is past the host region (a broken invariant: none is read).
    """
    device, codes = step.device, step.host.codes
    if (
        step.operands is None
        or codes is None
        or device is None
        or not all(t.dtype == torch.float32 and t.is_contiguous() for t in device)
    ):
        return swapped(step, parts=parts)
    keys, values = device
    inputs = step.inputs
    batch, heads, _, dim = keys.shape
    chosen = np.empty((batch, heads, int(inputs.budget.max())), dtype=np.int64)
    fetched, missing = select_and_fetch(
        *step.operands,
        *_rule_inputs(inputs),  # the logits are the call's own product
        chosen,
        *codes,
        HALVES,
        keys.detach().numpy().reshape(-1, dim),  # views: the rows land in the buffers
        values.detach().numpy().reshape(-1, values.shape[-1]),
        kernel_parts(batch * heads, parts),
    )
    if missing:
        raise IndexError(f"{missing} chosen positions are past the host region")
    return Selected(fetched, None)


def _kernel_inputs(inputs: ChoiceInputs) -> tuple:
    """``inputs`` as the compiled kernels take them: numpy arrays, the logits as the int16 bits
    of their bfloat16 values, then :func:`_rule_inputs`."""
    return (inputs.logits.view(torch.int16).numpy(), *_rule_inputs(inputs))


def _rule_inputs(inputs: ChoiceInputs) -> tuple:
    """``inputs`` but the logits as the compiled kernels take them: numpy arrays, the history
    as the int32 bits of its float32 sums ((B, H, 0) without one)."""
    batch, heads = inputs.positions.shape[:2]
    history = inputs.history
    history_bits = (
        np.zeros((batch, heads, 0), dtype=np.int32)
        if history is None
        else history.view(torch.int32).numpy()
    )
    return (
        history_bits,
        inputs.shares,
        inputs.positions.numpy(),
        inputs.first,
        inputs.budget,
        inputs.recent,
        inputs.sinks,
        inputs.seen,
    )


# =================================================================================================
# Weight products at a few rows
# =================================================================================================

# A decode step multiplies its B new rows by every weight matrix (alisa.ops.products). At one
# to eight rows that is a pass over the weights with little arithmetic per byte, and the BLAS
# torch ships runs it on one thread: on a 2-core AMD EPYC (AVX-512) one pass over SmolLM2-135M's
# float32 weights (538 MB) took 43-47 ms as ``F.linear`` at one row, with one thread or two
# (11-12 GB/s), where two threads read 27 GB/s. Here each thread takes a block of the weight's
# rows and computes their dot products with every input row, reading each weight byte once,
# from eight rows on in tiles (:func:`weight_rows`): 25.9 ms at one row, 26.6 at two, 23.9 at
# four, 37.5 at eight and 52.8 at sixteen against the BLAS's faster form's 49.8, 32.1, 30.4,
# 47.3 and 65.7; at thirty-two 106.9 against 102.1, so the transposed form takes it up to
# sixteen rows (alisa.ops.products.ROW_KERNEL_ROWS; ``python -m experiments.kernels products``,
# docs/host-speed.md, stop 89).

# Input rows from which :func:`weight_rows` sums in tiles rather than one product at a time.
TILED_ROWS = 8


@kernel(parallel=True, nogil=True, fastmath={"reassoc", "contract"})
def weight_rows(x: np.ndarray, weight: np.ndarray, out: np.ndarray, parts: int) -> None:
    """``out = x @ weight.T``, the weight's rows split into ``parts`` blocks run in parallel.

    Below :data:`TILED_ROWS` input rows each weight row's dot products are summed one at a time
    (the pass is the memory's); from there on, in tiles of two weight rows by four input rows,
    whose eight sums share each value loaded (the pass is the arithmetic's: a pass over
    SmolLM2-135M's weights at eight rows took 50 against 59 ms one product at a time, at sixteen
    84 against 119; at four 36 against 26, docs/host-speed.md, stop 89). A tile past the last
    row repeats it (the same sum, written again).

    Parameters
    ----------
    x
        (R, K) float32 input rows, contiguous.
    weight
        (N, K) float32, contiguous.
    out
        (R, N) float32, written.
    parts
        Blocks of the weight's rows (:func:`kernel_parts`), each of an even count but the last;
        each output is summed by one thread in a tile slot set by its row's parity, so the
        result does not depend on ``parts``.
    """
    rows, count, size = x.shape[0], weight.shape[0], weight.shape[1]
    block = ((count + parts - 1) // parts + 1) // 2 * 2
    for part in numba.prange(parts):
        start, stop = part * block, min(count, (part + 1) * block)
        if rows < TILED_ROWS:
            for n in range(start, stop):
                for r in range(rows):
                    total = np.float32(0.0)
                    for k in range(size):
                        total += weight[n, k] * x[r, k]
                    out[r, n] = total
            continue
        for n in range(start, stop, 2):
            m = min(n + 1, stop - 1)
            for r in range(0, rows, 4):
                r1, r2, r3 = min(r + 1, rows - 1), min(r + 2, rows - 1), min(r + 3, rows - 1)
                s00 = s01 = s02 = s03 = s10 = s11 = s12 = s13 = np.float32(0.0)
                for k in range(size):
                    w0, w1 = weight[n, k], weight[m, k]
                    x0, x1, x2, x3 = x[r, k], x[r1, k], x[r2, k], x[r3, k]
                    s00 += w0 * x0
                    s01 += w0 * x1
                    s02 += w0 * x2
                    s03 += w0 * x3
                    s10 += w1 * x0
                    s11 += w1 * x1
                    s12 += w1 * x2
                    s13 += w1 * x3
                out[r, n], out[r1, n], out[r2, n], out[r3, n] = s00, s01, s02, s03
                out[r, m], out[r1, m], out[r2, m], out[r3, m] = s10, s11, s12, s13


def weight_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(R, N) ``x @ weight.T`` by :func:`weight_rows` (a few rows: alisa.ops.products).

    Parameters
    ----------
    x
        (R, K) float32 rows.
    weight
        (N, K) float32, contiguous.

    Returns
    -------
    torch.Tensor
        (R, N) float32, contiguous; the sums in another order than the BLAS's (float rounding).
    """
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    weight_rows(
        x.detach().contiguous().numpy(),
        weight.detach().numpy(),
        out.numpy(),
        kernel_parts(weight.shape[0]),
    )
    return out
