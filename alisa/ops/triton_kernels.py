"""The Triton kernel of :func:`alisa.ops.cuda.choose_and_place` (imported only where Triton
is: CPU builds of PyTorch do not ship it).

One program per (sequence, KV head) row, in six steps, each a loop over the row's positions or
slots in blocks; a step that reads what an earlier one wrote (the program's scratch in global
memory) follows a barrier. Levels (the order of a bfloat16 logit as an integer) and history keys
(the sum's bits, then the position) are ranked by radix selection, one digit (a histogram of
``DIGIT_BITS`` bits) a pass (https://doi.org/10.1145/3458817.3476141), so nothing is sorted.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def kth_largest(scratch, start, end, wanted, bits, BLOCK: tl.constexpr, DIGIT_BITS: tl.constexpr):
    """The ``wanted``-th largest of the non-negative values of ``scratch[start:end]`` (all
    below ``2**bits``, ``bits`` <= 60; negative ones are not counted), by radix selection
    ``DIGIT_BITS`` bits per pass: each pass histograms the values that match the digits found
    so far by their next digit, and keeps the digit where the count from the top reaches
    ``wanted``.

    Returns (value, ties, equal): the value, how many of the values equal to it belong to the
    top ``wanted`` (every value above it does), and how many values equal it.
    """
    DIGITS: tl.constexpr = 1 << DIGIT_BITS
    digits = tl.arange(0, DIGITS)
    prefix = tl.zeros((), dtype=tl.int64)
    remaining = wanted.to(tl.int64)
    equal = tl.zeros((), dtype=tl.int64)
    shift = (bits + DIGIT_BITS - 1) // DIGIT_BITS * DIGIT_BITS - DIGIT_BITS
    while shift >= 0:
        # Every value is below 2**60: above bit 62 all are equal (and a shift stays defined).
        above_digit = tl.minimum(shift + DIGIT_BITS, 62)
        counts = tl.zeros((DIGITS,), dtype=tl.int32)
        index = start
        while index < end:
            offsets = index + tl.arange(0, BLOCK)
            value = tl.load(scratch + offsets, mask=offsets < end, other=-1).to(tl.int64)
            match = (value >= 0) & ((value >> above_digit) == (prefix >> above_digit))
            digit = ((value >> shift) & (DIGITS - 1)).to(tl.int32)
            counts += tl.histogram(digit, DIGITS, mask=match)
            index += BLOCK
        wide = counts.to(tl.int64)
        # at_least[d]: matching values whose digit is d or above.
        at_least = tl.sum(wide) - tl.cumsum(wide, axis=0) + wide
        found = tl.max(tl.where(at_least >= remaining, digits, 0))
        above = tl.sum(tl.where(digits > found, wide, 0))
        equal = tl.sum(tl.where(digits == found, wide, 0))
        remaining -= above
        prefix |= found.to(tl.int64) << shift
        shift -= DIGIT_BITS
    return prefix, remaining, equal


# Sizes change from step to step: one compilation, not one per divisibility class.
@triton.jit(
    do_not_specialize=[
        "columns",
        "logit_batch",
        "logit_head",
        "logit_group",
        "history_batch",
        "history_head",
        "capacity",
        "count",
        "seen",
        "position_bits",
    ]
)
def choose_and_place_rows(  # pointers, then sizes, then blocks
    logits,
    history,
    per_sequence,
    positions,
    chosen,
    fetch,
    target,
    levels,
    keys,
    free,
    heads,
    groups,
    columns,
    logit_batch,
    logit_head,
    logit_group,
    history_batch,
    history_head,
    batch,
    capacity,
    count,
    sinks,
    seen,
    position_bits,
    PICKING: tl.constexpr,
    BLOCK: tl.constexpr,
    DIGIT_BITS: tl.constexpr,
):
    row = tl.program_id(0)
    b = row // heads
    h = row % heads
    first = tl.load(per_sequence + b)
    budget = tl.load(per_sequence + batch + b)
    recent = tl.load(per_sequence + 2 * batch + b)
    share = tl.load(per_sequence + 3 * batch + b)
    low = tl.minimum(first + sinks, seen)  # the ranked span [low, high)
    high = tl.maximum(seen - recent, low)
    lane = tl.arange(0, BLOCK)
    logit_row = logits + b.to(tl.int64) * logit_batch + h.to(tl.int64) * logit_head
    level_row = levels + row.to(tl.int64) * seen
    slot_row = positions + row.to(tl.int64) * capacity
    out = row.to(tl.int64) * count

    # 1. Each ranked position's level: the order of its bfloat16 logit as an integer in
    # [1, 65535], max over the query heads (0 past the logits' columns).
    index = low
    while index < high:
        position = index + lane
        inside = position < high
        readable = inside & (position < columns)
        level = tl.zeros((BLOCK,), dtype=tl.int32)
        g = 0
        while g < groups:
            bits = tl.load(logit_row + g * logit_group + position, mask=readable, other=0)
            value = bits.to(tl.int32)
            value = (value ^ ((value >> 15) & 0x7FFF)) + 32768
            level = tl.maximum(level, tl.maximum(value, 1))
            g += 1
        level = tl.where(position < columns, level, 0)
        tl.store(level_row + position, level, mask=inside)
        index += BLOCK
    tl.debug_barrier()

    # 2. The history's share: the held ranked positions with the most attention (> 0),
    # equal sums: the newer first (keys: the sum's bits, then the position); flagged -1.
    wanted = budget - (low - first) - (seen - high)
    candidates = high - low
    if PICKING:
        history_row = history + b.to(tl.int64) * history_batch + h.to(tl.int64) * history_head
        key_row = keys + row.to(tl.int64) * capacity
        found = tl.zeros((), dtype=tl.int64)
        index = 0
        while index < capacity:
            slot = index + lane
            position = tl.load(slot_row + slot, mask=slot < capacity, other=-1)
            ranked = (position >= low) & (position < high)
            bits = tl.load(history_row + position, mask=ranked, other=0)
            candidate = ranked & (bits > 0)
            key = (bits.to(tl.int64) << position_bits) | position
            tl.store(key_row + slot, tl.where(candidate, key, -1), mask=slot < capacity)
            found += tl.sum(candidate.to(tl.int64))
            index += BLOCK
        tl.debug_barrier()
        if share > 0:
            cut = tl.zeros((), dtype=tl.int64)
            if found > share:
                cut, _, _ = kth_largest(
                    key_row, 0, capacity, share, 31 + position_bits, BLOCK, DIGIT_BITS
                )
            index = 0
            while index < capacity:
                slot = index + lane
                key = tl.load(key_row + slot, mask=slot < capacity, other=-1)
                picked = (key >= 0) & (key >= cut)
                spot = key & ((tl.full((), 1, tl.int64) << position_bits) - 1)
                tl.store(level_row + spot, tl.full((BLOCK,), -1, tl.int32), mask=picked)
                picked_count = tl.sum(picked.to(tl.int64))
                wanted -= picked_count
                candidates -= picked_count
                index += BLOCK
        tl.debug_barrier()

    # 3. The cut: the wanted-th largest level; of the levels equal to it, the newest
    # (wanted - above) are taken, so the oldest ``skip`` are not.
    cut_level = tl.zeros((), dtype=tl.int64)
    skip = tl.zeros((), dtype=tl.int64)
    if wanted <= 0:
        cut_level = tl.full((), 1 << 16, tl.int64)  # none ranked
    elif wanted < candidates:
        cut_level, kept_ties, equal = kth_largest(
            level_row, low, high, wanted, 16, BLOCK, DIGIT_BITS
        )
        skip = equal - kept_ties

    # 4. The chosen positions, ascending, into the row's K entries (the rest: seen); each
    # position's level becomes 1 where chosen, 0 where not (the placement's flags).
    written = tl.zeros((), dtype=tl.int64)
    ties_before = tl.zeros((), dtype=tl.int64)
    index = 0
    while index < seen:
        position = index + lane
        inside = position < seen
        spanned = (position >= low) & (position < high)
        level = tl.load(level_row + position, mask=spanned, other=0).to(tl.int64)
        tie = spanned & (level == cut_level)
        tie_rank = ties_before + tl.cumsum(tie.to(tl.int64), axis=0) - tie.to(tl.int64)
        ranked = (level < 0) | (level > cut_level) | (tie & (tie_rank >= skip))
        taken = inside & (position >= first) & tl.where(spanned, ranked, True)
        entry = written + tl.cumsum(taken.to(tl.int64), axis=0) - 1
        tl.store(chosen + out + entry, position.to(tl.int64), mask=taken & (entry < count))
        tl.store(level_row + position, taken.to(tl.int32), mask=inside)
        written += tl.sum(taken.to(tl.int64))
        ties_before += tl.sum(tie.to(tl.int64))
        index += BLOCK
    index = tl.minimum(written, count)
    while index < count:
        entry = index + lane
        tl.store(chosen + out + entry, tl.zeros((BLOCK,), tl.int64) + seen, mask=entry < count)
        index += BLOCK
    tl.debug_barrier()

    # 5. Free the slots of tokens not chosen (a chosen token's flag becomes 2: held) and
    # list the free slots, lowest first.
    free_row = free + row.to(tl.int64) * capacity
    listed = tl.zeros((), dtype=tl.int64)
    index = 0
    while index < capacity:
        slot = index + lane
        inside = slot < capacity
        position = tl.load(slot_row + slot, mask=inside, other=-2)
        held = position >= 0
        flag = tl.load(level_row + position, mask=held, other=0)
        leaving = held & (flag == 0)
        tl.store(slot_row + slot, tl.full((BLOCK,), -1, tl.int64), mask=leaving)  # FREE
        tl.store(level_row + position, tl.full((BLOCK,), 2, tl.int32), mask=held & (flag == 1))
        empty = inside & ((position == -1) | leaving)
        rank = listed + tl.cumsum(empty.to(tl.int64), axis=0) - 1
        tl.store(free_row + rank, slot.to(tl.int32), mask=empty)
        listed += tl.sum(empty.to(tl.int64))
        index += BLOCK
    tl.debug_barrier()

    # 6. Each chosen token not held takes the next free slot.
    fetched = tl.zeros((), dtype=tl.int64)
    index = 0
    while index < count:
        entry = index + lane
        inside = entry < count
        position = tl.load(chosen + out + entry, mask=inside, other=seen)
        valid = inside & (entry < budget) & (position < seen)
        flag = tl.load(level_row + position, mask=valid, other=0)
        wanted_in = valid & (flag == 1)
        rank = fetched + tl.cumsum(wanted_in.to(tl.int64), axis=0) - 1
        slot = tl.load(free_row + rank, mask=wanted_in, other=0).to(tl.int64)
        slot = tl.where(wanted_in, slot, capacity)
        tl.store(fetch + out + entry, wanted_in.to(tl.uint8), mask=inside)
        tl.store(target + out + entry, slot, mask=inside)
        tl.store(slot_row + slot, position, mask=wanted_in)
        fetched += tl.sum(wanted_in.to(tl.int64))
        index += BLOCK
