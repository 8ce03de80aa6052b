"""Compiled CPU kernels for ``retention="host"``'s fetch: host rows gathered, or decoded into slots.

Each decode step brings back the tokens its selection wants that the device does not hold:
about 12 % of the budget per layer (2,355 rows of keys and values per layer at B = 16 x 2,048,
SmolLM2-135M). As PyTorch ops that is a gather of the codes, of the scales and of the zero
points, a conversion, a subtraction, a multiplication and two scatters per layer, each paying its
fixed cost: 25 ms of a 230 ms CPU step (``docs/host-speed.md``). :func:`fetch_rows` reads each
row's INT8 codes and writes the dequantized values straight into its device slot, with the same
float32 arithmetic as :func:`quant.dequantize` (``(code - zero) * scale``), so the values are the
same bit for bit (``tests/test_kernels.py``). The PyTorch path stays the reference and CUDA's.
ALISA, https://arxiv.org/abs/2403.17312 (§IV, phase II: offloaded KV brought back per step).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

# The float32 value of every float16, indexed by its bits read as uint16 (a 256 KiB table:
# numba has no float16, and the conversion is exact, so a lookup is the whole of it).
HALVES = (
    torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16).float().numpy()
)
HALVES.flags.writeable = False


@numba.njit(cache=True, inline="always")
def _span(part: int, parts: int, count: int) -> tuple[int, int]:
    """Rows [start, stop) of part ``part`` of ``count`` rows split into ``parts`` (a helper of
    this module's kernels only: numba's cache notices a changed helper in the kernel's own file,
    not in another)."""
    size = (count + parts - 1) // parts
    return part * size, min(count, (part + 1) * size)


@numba.njit(parallel=True, cache=True, nogil=True)
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
            row = source[entry]
            out = target[entry]
            step = halves[scale[0, row] & 0xFFFF]
            offset = halves[zero[0, row] & 0xFFFF]
            for channel in range(codes.shape[2]):
                keys[out, channel] = (np.float32(codes[0, row, channel]) - offset) * step
            step = halves[scale[1, row] & 0xFFFF]
            offset = halves[zero[1, row] & 0xFFFF]
            for channel in range(codes.shape[2]):
                values[out, channel] = (np.float32(codes[1, row, channel]) - offset) * step


@numba.njit(parallel=True, cache=True, nogil=True)
def gather_rows(source: np.ndarray, rows: np.ndarray, out: np.ndarray, parts: int) -> None:
    """Copy rows ``rows`` of both halves of a host region into ``out``, byte for byte.

    The rows a decode step fetches lie scattered through the whole history, so each is a few
    cache misses: a gather waits on memory, not on arithmetic, and parts running in parallel
    keep more of those reads in flight (``torch.index_select`` runs one thread here, and on
    CUDA its result still had to be copied into page-locked memory before the upload).

    Parameters
    ----------
    source
        (2, N, W) uint8: the bytes of a region's keys (0) and values (1), W per row.
    rows
        (E,) int64 rows to read, each below N.
    out
        (2, E, W) uint8, written: ``out[h, e] = source[h, rows[e]]``.
    parts
        As :func:`fetch_rows`'s.
    """
    for part in numba.prange(parts):
        start, stop = _span(part, parts, rows.shape[0])
        for entry in range(start, stop):
            row = rows[entry]
            for half in range(source.shape[0]):
                for byte in range(source.shape[2]):
                    out[half, entry, byte] = source[half, row, byte]
