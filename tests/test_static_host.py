"""Host retention's static step (alisa.kv.host, issue 65): the host region a static step codes
one token at a time holds the eager region's bytes, widened scales included, and its fetch
writes only the fetched rows."""

from __future__ import annotations

import pytest
import torch

from alisa.ops.reference import fetch_codes_static, fetch_placed, fetch_placed_static
from alisa.storage.pages import PAGE_TOKENS, HostPages
from alisa.storage.quantized import QuantizedStore
from quant.asymmetric import SCALE_LEVELS

BATCH, HEADS, DIM = 2, 2, 8


def _token(generator: torch.Generator, kind: str) -> torch.Tensor:
    """(B, H, 1, D) keys or values; ``kind`` picks rows whose scales float16 cannot hold."""
    token = torch.randn(BATCH, HEADS, 1, DIM, generator=generator)
    if kind == "constant":  # a constant row keeps its value as the scale: not a float16 one
        token[0, 1] = 0.1234567
    elif kind == "offset":  # a zero point of -5.7e8: past float16's and float32's integers
        token[1, 0] = 1e9 + torch.arange(DIM) * 64.0
    return token


@pytest.mark.parametrize("widen", ["none", "constant", "offset"])
def test_a_static_int8_region_holds_the_eager_regions_bytes(widen):
    """Tokens coded a range at a time (a page, or sooner when a selection would leave one
    out), the eager way and the static way (each token into the ring, the host's range coded
    by a fixed-shape call): the same codes, the same scales and zero points in the dtype
    quantize chose, widened where a row needed it, at the same step."""
    generator = torch.Generator().manual_seed(7)
    eager = HostPages(BATCH, HEADS, DIM, bits=8, dtype=torch.float32, device="cpu")
    static = HostPages(BATCH, HEADS, DIM, bits=8, dtype=torch.float32, device="cpu")
    prompt = torch.randn(2, BATCH, HEADS, 20, DIM, generator=generator)
    for pages in (eager, static):
        pages.write(0, *prompt)
    static.make_static(96)
    flushed, pending = 20, []
    early = {27, 33, 34, 61}  # steps where a selection codes the pending tokens sooner
    for position in range(20, 90):
        kind = widen if position in (41, 70) else "none"
        keys, values = _token(generator, kind), _token(generator, "none")
        pending.append((keys, values))
        seen = position + 1
        coded = seen - flushed >= PAGE_TOKENS or position in early
        start, count = flushed, seen - flushed if coded else 0
        if coded:
            keys_due, values_due = (torch.cat(half, 2) for half in zip(*pending, strict=True))
            eager.write(flushed, keys_due, values_due)
            pending, flushed = [], seen
        static.write_static(
            torch.tensor([position]), keys, values, torch.tensor([start]), torch.tensor([count])
        )
        data, scale, zero = eager.tensors()
        assert SCALE_LEVELS[int(static.level)] == scale.dtype
        mine = static.tensors()
        assert torch.equal(mine[0][:, :, :, :flushed], data[:, :, :, :flushed])
        assert torch.equal(mine[1][:, :, :, :flushed], scale[:, :, :, :flushed].double())
        assert torch.equal(mine[2][:, :, :, :flushed], zero[:, :, :, :flushed].double())
    widened = {"none": torch.float16, "constant": torch.float32, "offset": torch.float64}
    assert eager.tensors()[1].dtype == widened[widen]


@pytest.mark.parametrize("coded", [False, True])
def test_the_static_fetch_writes_what_the_eager_fetch_writes_and_nothing_else(coded):
    """Random placements (rows with and without fetches, entries past a budget): the static
    fetch leaves the device buffers as the eager one does, reading a float64-scaled INT8
    region as the eager one decodes its float16 one."""
    generator = torch.Generator().manual_seed(3)
    capacity, slots, entries = 40, 12, 6
    region16 = torch.randn(2, BATCH, HEADS, capacity, DIM, generator=generator)
    if coded:
        pages = HostPages(BATCH, HEADS, DIM, bits=8, dtype=torch.float32, device="cpu")
        pages.write(0, *region16)
        eager_region = pages.tensors()
        pages.make_static(capacity)
        static_region = pages.tensors()
    else:
        eager_region = static_region = (region16,)
    keys = torch.randn(BATCH, HEADS, slots, DIM, generator=generator)
    values = torch.randn(BATCH, HEADS, slots, DIM, generator=generator)
    chosen = torch.stack(
        [torch.randperm(capacity, generator=generator)[:entries] for _ in range(BATCH * HEADS)]
    ).view(BATCH, HEADS, entries)
    fetch = torch.rand(BATCH, HEADS, entries, generator=generator) < 0.5
    fetch[0, 1] = False  # a row that fetches nothing
    # Fetched entries take distinct slots 1..; slot 0 is held through the step (the anchor).
    target = torch.where(fetch, fetch.cumsum(-1), slots)
    anchor = torch.zeros(BATCH, HEADS, 1, dtype=torch.int64)
    expected = (keys.clone(), values.clone())
    fetch_placed(eager_region, chosen, fetch, target, *expected)
    fetch_placed_static(static_region, chosen, fetch, target, anchor, keys, values)
    assert torch.equal(keys, expected[0]) and torch.equal(values, expected[1])


@pytest.mark.parametrize("widen", ["none", "offset"])
@pytest.mark.parametrize("fetches", [True, False])
def test_the_static_fetch_of_codes_copies_rows_and_raises_the_level(widen, fetches):
    """Over INT8 device KV the static fetch copies each fetched row's codes, scales and zero
    points from the INT8 host region as they are, leaves every other slot alone, and raises
    the device's scale level to the region's where a row was fetched (as the eager store's
    ``put`` widens its scales), not where none was."""
    generator = torch.Generator().manual_seed(5)
    capacity, slots, entries = 40, 12, 6
    pages = HostPages(BATCH, HEADS, DIM, bits=8, dtype=torch.float32, device="cpu")
    region = torch.randn(2, BATCH, HEADS, capacity, DIM, generator=generator)
    if widen == "offset":  # a zero point past float16's and float32's integers: float64
        region[0, 1, 0, 7] = 1e9 + torch.arange(DIM) * 64.0
    pages.write(0, *region)
    pages.make_static(capacity)
    device = QuantizedStore(
        *(torch.randn(BATCH, HEADS, slots, DIM, generator=generator) for _ in "kv"),
        slots,
        bits=8,
        group_size=None,
        residual_tokens=0,
        groups=1,
        static=True,
    )
    chosen = torch.stack(
        [torch.randperm(capacity, generator=generator)[:entries] for _ in range(BATCH * HEADS)]
    ).view(BATCH, HEADS, entries)
    chosen[1, 0, 0] = 7  # the widened row, where it is fetched
    fetch = torch.rand(BATCH, HEADS, entries, generator=generator) < 0.5
    fetch[1, 0, 0] = True
    fetch &= fetches
    target = torch.where(fetch, fetch.cumsum(-1), slots)
    anchor = torch.zeros(BATCH, HEADS, 1, dtype=torch.int64)
    before = [t.clone() for t in device.codes.tensors()]
    level = device.codes.level.clone()
    fetch_codes_static(
        pages.tensors(),
        pages.level,
        chosen,
        fetch,
        target,
        anchor,
        device.codes.tensors(),
        device.codes.level,
    )
    for mine, old, theirs in zip(device.codes.tensors(), before, pages.tensors(), strict=True):
        expected = old.clone()
        for b, h, e in fetch.nonzero().tolist():
            expected[:, b, h, target[b, h, e]] = theirs[:, b, h, chosen[b, h, e]]
        assert torch.equal(mine, expected)
    raised = torch.maximum(level, pages.level) if fetches else level
    assert torch.equal(device.codes.level, raised)
    assert int(pages.level) == (2 if widen == "offset" else 0)


def _selection(seed: int, *, history: bool):
    """A random static step's selection inputs: (B, H_kv) rows holding some of their seen
    positions (the new token always, empty slots between), a plain host region, sums."""
    from alisa.ops.reference import FREE

    generator = torch.Generator().manual_seed(seed)
    groups, slots, seen, capacity = 2, 12, 30, 40
    logits = torch.randn(BATCH, HEADS, groups, capacity, generator=generator).bfloat16()
    positions = torch.full((BATCH, HEADS, slots), FREE, dtype=torch.int64)
    for b in range(BATCH):
        for h in range(HEADS):
            held = torch.randperm(seen - 1, generator=generator)[:7]
            row = torch.cat([held, torch.tensor([seen - 1])])
            place = torch.randperm(slots, generator=generator)[: row.numel()]
            positions[b, h, place] = row
    sums = torch.rand(BATCH, HEADS, capacity, generator=generator) if history else None
    region = (torch.randn(2, BATCH, HEADS, capacity, DIM, generator=generator),)
    keys = torch.randn(BATCH, HEADS, slots, DIM, generator=generator)
    values = torch.randn(BATCH, HEADS, slots, DIM, generator=generator)
    numbers = {
        "budget": torch.tensor([9, 6]),
        "recent": torch.tensor([2, 3]),
        "shares": torch.tensor([3, 1]) if history else torch.zeros(BATCH, dtype=torch.int64),
        "first": torch.tensor([0, 4]),
    }
    return logits, sums, positions, region, keys, values, numbers, seen


@pytest.mark.parametrize("history", [False, True])
def test_the_selection_operator_is_the_pytorch_static_selection(history):
    """``alisa::choose_and_fetch`` (the eager step's compiled choice and swap, the rows the
    slots lack fetched) leaves the slot map and the device rows as PyTorch's static path does
    (choose at fixed width, place, fetch), and passes torch.library's checks."""
    from alisa.kv.slots import first_slot
    from alisa.ops import library
    from alisa.ops.reference import StaticChoice, place, select_rule_static

    logits, sums, positions, region, keys, values, numbers, seen = _selection(5, history=history)
    mine = [positions.clone(), keys.clone(), values.clone()]
    history_arg = sums if history else torch.zeros(BATCH, HEADS, 0)
    count = library.choose_and_fetch(
        logits, history_arg, numbers["shares"], mine[0], numbers["first"], numbers["budget"],
        numbers["recent"], 1, torch.tensor([seen]), list(region), mine[1], mine[2],
    )  # fmt: skip
    inputs = StaticChoice(
        logits=logits,
        history=sums,
        positions=positions,
        sinks=1,
        seen=torch.tensor([seen]),
        width=40,
        most=9,
        **numbers,
    )
    chosen, taken = select_rule_static(inputs)
    placement = place(positions, chosen, taken, 40)
    anchor = first_slot(positions == seen - 1)  # the new token's slot
    fetch_placed_static(region, *placement, anchor, keys, values)
    assert torch.equal(mine[0], positions)
    assert torch.equal(mine[1], keys) and torch.equal(mine[2], values)
    assert int(count) == int(placement.fetch.sum()) > 0
    arguments = (
        logits, history_arg, numbers["shares"], positions.clone(), numbers["first"],
        numbers["budget"], numbers["recent"], 1, torch.tensor([seen]), list(region),
        keys.clone(), values.clone(),
    )  # fmt: skip
    torch.library.opcheck(torch.ops.alisa.choose_and_fetch.default, arguments)
