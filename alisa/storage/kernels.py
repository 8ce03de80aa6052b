"""Compiled CPU kernels of the device and host regions: host rows gathered or decoded into
slots, and a decode query's attention over the slots read where they are.

Each decode step brings back the tokens its selection wants that the device does not hold:
about 12 % of the budget per layer (2,355 rows of keys and values per layer at B = 16 x 2,048,
SmolLM2-135M). As PyTorch ops that is a gather of the codes, of the scales and of the zero
points, a conversion, a subtraction, a multiplication and two scatters per layer, each paying its
fixed cost: 25 ms of a 230 ms CPU step (``docs/host-speed.md``). :func:`fetch_rows` reads each
row's INT8 codes and writes the dequantized values straight into its device slot, with the same
float32 arithmetic as :func:`quant.dequantize` (``(code - zero) * scale``), so the values are the
same bit for bit (``tests/test_kernels.py``). The PyTorch path stays the reference and CUDA's.
:func:`slot_logits` and :func:`slot_output` compute a decode step's attention over a region's
slots without the dequantized copy of an INT8 region (:mod:`alisa.storage.attend`), and
:func:`code_rows` quantizes each new token into such a region in one call, and :func:`put_slots`
copies a plain region's new token into its slots.
ALISA, https://arxiv.org/abs/2403.17312 (§IV, phase II: offloaded KV brought back per step).
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch
from numba import types
from numba.extending import overload

from alisa.ops.numba_cache import kernel

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
        The rows are split into this many parts, run in parallel
        (:func:`alisa.kernel_threads.kernel_parts`); the result does not depend on it.
    """
    for part in numba.prange(parts):
        start, stop = _span(part, parts, source.shape[0])
        for entry in range(start, stop):
            decode_row(codes, scale, zero, halves, source[entry], target[entry], keys, values)


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
    halves, entries, width = tokens.shape
    steps = np.empty((halves, entries))
    offsets = np.empty((halves, entries))
    for half in range(halves):
        for entry in range(entries):
            row = tokens[half, entry]
            low = high = np.float64(row[0])
            for channel in range(1, width):
                low = min(low, np.float64(row[channel]))
                high = max(high, np.float64(row[channel]))
            if high == low:  # quantize's constant group: the value itself is the scale
                step = 1.0 if low == 0.0 else low
                if low != 0.0 and _half_ceil(abs(low)) != abs(low) or abs(low) > HALF_MAX:
                    return False
                offset = 0.0
            else:
                step = _half_ceil((high - low) / 255.0)
                offset = np.rint(-low / step)
                if step > HALF_MAX or abs(offset) > 2048.0:
                    return False
            steps[half, entry], offsets[half, entry] = step, offset
    for half in range(halves):
        for entry in range(entries):
            out, step, offset = target[entry], steps[half, entry], offsets[half, entry]
            for channel in range(width):
                code = np.rint(np.float64(tokens[half, entry, channel]) / step + offset)
                codes[half, out, channel] = np.uint8(min(max(code, 0.0), 255.0))
            scale[half, out] = _half_bits(step)
            zero[half, out] = _half_bits(offset)
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
