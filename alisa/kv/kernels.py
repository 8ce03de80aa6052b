"""Compiled CPU kernels for ``retention="host"``'s decode step (numba).

On a CPU a host step written as PyTorch ops is dozens of small passes over (B, H_kv, n) arrays
per layer (score, protect, rank, diff against the held slots, find free slots, fetch lists),
each dominated by its fixed cost: at B = 16 x 2,048 tokens that was 130 ms of a 310 ms step
(``docs/host-speed.md``). Each kernel here does one job in one pass per (sequence, KV head) row
and writes only what its caller owns:

* :func:`choose` (for :class:`~alisa.kv.host.HostKeeper`): this step's chosen positions:
  protections, the history's picks, then the best sketch logits, found by a radix select; given
  a fetch list (for :class:`~alisa.kv.slots.SlotMap`), each row's slots are then made exactly
  those positions: the slots of tokens not chosen freed, each chosen token the device lacks
  given a free slot and listed to fetch;
* :func:`accumulate` (for :class:`~alisa.kv.history.PositionHistory`): add a step's attention to
  the history of the positions the slots hold;
* :func:`place_one` (for :class:`~alisa.kv.slots.SlotMap`): each (sequence, group)'s slot for a
  decode step's new token, the lowest free one below the frontier or the frontier.

Each has a PyTorch reference next to its caller (the path CUDA takes, where those ops are cheap)
and tests compare the two exactly (``tests/test_kernels.py``): ranking is by integer keys with a
defined tie rule (equal scores: the newer position first), so both choose the same tokens.
ALISA, https://arxiv.org/abs/2403.17312 (§IV, phase II); the radix select follows
https://doi.org/10.1145/3458817.3476141 (top-k by radix selection).
"""

from __future__ import annotations

import numba
import numpy as np

from alisa.ops.numba_cache import kernel

FREE = -1  # an empty slot (alisa.kv.slots names it; this module imports nothing of alisa)
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
        As :class:`alisa.kv.choice.ChoiceInputs` holds them, as numpy arrays: ``logits`` as
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
        (:func:`alisa.kernel_threads.kernel_parts`); the result does not depend on it.

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
        (:func:`alisa.kernel_threads.kernel_parts`); the result does not depend on it.
    """
    batch, heads, groups, width = probabilities.shape
    rows = batch * heads
    size = (rows + parts - 1) // parts
    for part in numba.prange(parts):
        for row in range(part * size, min(rows, (part + 1) * size)):
            b, h = row // heads, row % heads
            for slot in range(width):
                position = positions[b, h, slot]
                if position < 0:
                    continue
                combined = probabilities[b, h, 0, slot]
                for g in range(1, groups):
                    value = probabilities[b, h, g, slot]
                    combined = max(combined, value) if head_max else combined + value
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
