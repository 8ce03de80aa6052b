"""Host retention's selection on a CPU as one compiled call per layer: score, choose, swap, fetch.

A host-retention decode step (:class:`~alisa.kv.host.HostKeeper`) scores every ranked position
with the key sketch, chooses the tokens to attend, makes the device slots exactly those and
fetches the tokens the device lacks from the host region. On a CPU each of those is a compiled
kernel (:func:`alisa.storage.product.sketch_logits`, :func:`alisa.kv.kernels.choose`,
:func:`alisa.storage.kernels.fetch_rows`), but the Python between them cost more than the
kernels at one sequence: each line runs after the layer's weights have streamed through the
caches, at several microseconds a line: at B = 1 the selection took 584 us a layer, 172 of
them in its three kernels (line timings, ``docs/host-speed.md``, stop 58).
:func:`select_and_fetch` runs the same row functions in one call, row after row on each thread:
the sketch's logits of a (sequence, KV head) row (:func:`~alisa.storage.product.logits_rows`),
its choice (:func:`~alisa.kv.kernels.choose_at`), its slot swap
(:func:`~alisa.kv.kernels.swap_row`), then each token it lacks decoded from its INT8 host row into
its new slot (:func:`~alisa.storage.kernels.decode_row`). The same code computes the same bits:
the result equals the three calls' exactly (``tests/test_kernels.py``).

It takes the layout the separate path takes through its fastest kernels: a float32 device region
held plain, INT8 host rows with one float16 scale per row, the compiled sketch product. Anything
else (16-bit or INT4 host regions, INT8 device regions, the rest's estimate, which keeps the
logits) takes the separate calls.

Its compiled code is cached under a digest of every kernel source
(:func:`alisa.ops.numba_cache.kernel`), so an edit to a row function in another module is
compiled anew, never run stale. ALISA, https://arxiv.org/abs/2403.17312 (§IV, phase II).
"""

from __future__ import annotations

import numba
import numpy as np

from alisa.kv.kernels import choose_at, swap_row
from alisa.ops.numba_cache import kernel
from alisa.storage.kernels import decode_row
from alisa.storage.product import logits_rows


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
        The sketch product's operands, as :func:`alisa.storage.product.sketch_logits` takes
        them: (R, G, D) float32 queries, R = B * H_kv; (R, W) channels; (R, W, N) codes; (R, N)
        or (R, 0) scales.
    logits
        (R, G, M) uint16, written: the bfloat16 bits of the logits of positions [0, M), every
        ranked position below M (what the sketch product writes).
    history, shares, positions, first, budget, recent, sinks, seen, chosen
        As :func:`alisa.kv.kernels.choose` takes them (``positions`` (B, H_kv, S) rewritten,
        ``chosen`` (B, H_kv, K) written).
    codes, scale, zero, halves
        The host region as :func:`alisa.storage.kernels.fetch_rows` reads it: (2, R * P, D)
        uint8 codes, P positions per row; (2, R * P) int16 float16 bits; :data:`HALVES`.
    keys, values
        (R * S, D) float32 device rows, slot ``s`` of row ``r`` at ``r * S + s``, written.
    parts
        Rows are split into this many parts, run in parallel
        (:func:`alisa.kernel_threads.kernel_parts`); the result does not depend on it.

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
            for entry in range(added):
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
