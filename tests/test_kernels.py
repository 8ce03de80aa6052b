"""The compiled CPU kernels of host retention equal their PyTorch references, exactly.

Host retention's choice, slot swap and history run as numba kernels (:mod:`alisa.ops.cpu`) on a
CPU and as PyTorch ops elsewhere (:mod:`alisa.ops.reference`, the definitions). Both rank by the
same integer keys with the same tie rule, so they must choose the same tokens, put them in the
same slots and keep the same sums, bit for bit: checked here on random inputs with many ties,
and end to end on generations.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
import sys
from functools import partial

import numpy as np
import pytest
import torch
from conftest import forced_ops, hf_generate, padded_batch, tiny_llama

import alisa.ops.cpu as compiled_ops
import alisa.storage.pages
from alisa import AlisaCache, AlisaConfig
from alisa.kv.cache import default_keeper
from alisa.kv.ranking import KeySketch, PositionHistory
from alisa.kv.slots import SlotMap
from alisa.ops import reference
from alisa.ops.reference import FREE, ChoiceInputs, SelectionStep, ordered_key
from alisa.storage.pages import FetchedRows, HostPages
from alisa.storage.quantized import QuantizedStore
from alisa.storage.store import DenseStore


def random_choice(rng: np.random.Generator, *, ties: bool) -> ChoiceInputs:
    """A step's inputs as a keeper builds them: budgets from a ratio, sinks covered, a recent
    window, padding on the left, held slots, a history over some of them."""
    batch, heads, groups = (int(v) for v in rng.integers(1, 4, size=3))
    seen = int(rng.integers(6, 300))
    first = rng.integers(0, min(seen - 1, 20), size=batch).astype(np.int64)
    length = seen - first
    sinks = int(rng.integers(0, 5))
    ratio = rng.uniform(0.05, 1.1)
    budget = np.minimum(length, np.maximum((length * ratio).astype(int), sinks + 1))
    recent = np.maximum(np.minimum(np.rint(budget * 0.5), np.maximum(budget - sinks, 0)), 1)
    recent = recent.astype(np.int64)
    capacity = seen + int(rng.integers(0, 8))
    if ties:  # few distinct values: many equal logits and sums
        values = torch.from_numpy(rng.integers(-8, 8, size=(batch, heads, groups, capacity)) / 4)
    else:
        values = torch.randn(batch, heads, groups, capacity, dtype=torch.float64)
    slots = int(budget.max()) + 6
    positions = torch.full((batch, heads, slots), FREE, dtype=torch.int64)
    for b in range(batch):
        for h in range(heads):
            held = int(rng.integers(0, min(slots, length[b]) + 1))
            positions[b, h, :held] = torch.from_numpy(
                rng.choice(np.arange(first[b], seen), held, replace=False)
            )
    history = torch.from_numpy(rng.integers(0, 5, size=(batch, heads, seen + 3)) / 2).float()
    shares = np.rint(np.maximum(budget - recent - sinks, 0) * rng.uniform(0, 1, size=batch))
    return ChoiceInputs(
        logits=values.to(torch.bfloat16),
        history=history if rng.uniform() < 0.7 else None,
        shares=shares.astype(np.int64),
        positions=positions,
        first=first,
        budget=budget.astype(np.int64),
        recent=recent,
        sinks=sinks,
        seen=seen,
    )


def brute_force(inputs: ChoiceInputs) -> list[list[list[int]]]:
    """The rule in plain Python: protections, the history's share, then the best logits
    (equal values: the newer position first)."""
    logits = inputs.logits.float().amax(dim=2)
    rows = []
    for b in range(len(inputs.budget)):
        low = min(int(inputs.first[b]) + inputs.sinks, inputs.seen)
        high = max(inputs.seen - int(inputs.recent[b]), low)
        heads = []
        for h in range(logits.shape[1]):
            chosen = set(range(int(inputs.first[b]), low)) | set(range(high, inputs.seen))
            if inputs.history is not None:
                held = [p for p in inputs.positions[b, h].tolist() if low <= p < high]
                ranked = sorted(((float(inputs.history[b, h, p]), p) for p in held), reverse=True)
                chosen |= {p for v, p in ranked[: int(inputs.shares[b])] if v > 0}
            rest = sorted(
                ((float(logits[b, h, p]), p) for p in range(low, high) if p not in chosen),
                reverse=True,
            )
            chosen |= {p for _, p in rest[: int(inputs.budget[b]) - len(chosen)]}
            heads.append(sorted(chosen))
        rows.append(heads)
    return rows


@pytest.fixture(params=[1, 2, 3], ids=["one-part", "two-parts", "three-parts"])
def parts(request):
    """Rows split into 1-3 parts run in parallel (:func:`alisa.ops.cpu.kernel_parts`), whatever
    this machine's threads: a test passes it to the functions it calls (``parts=``), and the
    results must not depend on it."""
    return request.param


def test_a_part_count_below_one_is_refused():
    """Rows split into no parts would leave a kernel's output unwritten: an explicit count that
    is not a whole number of at least 1 is refused where a kernel's caller takes it and where a
    backend binds it; a backend without compiled kernels has no rows to split."""
    inputs = random_choice(np.random.default_rng(0), ties=False)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=re.escape(f"parts={bad!r} must be a whole number")):
            compiled_ops.select_rule(inputs, parts=bad)
    with pytest.raises(ValueError, match="parts=0 must be a whole number"):
        forced_ops("cpu", "cpu", parts=0)
    with pytest.raises(ValueError, match=r"parts=2 needs compiled=True"):
        forced_ops("cpu", "reference", parts=2)


@pytest.mark.parametrize("ties", [True, False], ids=["ties", "distinct"])
def test_choose_compiled_equals_torch_and_the_rule(ties, parts):
    rng = np.random.default_rng(0 if ties else 1)
    for _ in range(60):
        inputs = random_choice(rng, ties=ties)
        compiled, taken = compiled_ops.select_rule(inputs, parts=parts)
        defined, defined_taken = reference.select_rule(inputs)
        assert torch.equal(compiled, defined) and torch.equal(taken, defined_taken)
        expected = brute_force(inputs)
        for b, heads in enumerate(expected):
            for h, positions in enumerate(heads):
                count = int(inputs.budget[b])
                assert len(positions) == count
                assert compiled[b, h, :count].tolist() == positions
                assert (compiled[b, h, count:] == inputs.seen).all()
        # Logits only up to the shortest recent window's start (KeySketch's ``upto``): the
        # same choice; one position fewer is refused.
        needed = inputs.seen - int(inputs.recent.min())
        narrow = dataclasses.replace(inputs, logits=inputs.logits[..., :needed])
        assert torch.equal(compiled_ops.select_rule(narrow, parts=parts)[0], compiled)
        assert torch.equal(reference.select_rule(narrow)[0], compiled)
        if needed > 0:
            with pytest.raises(ValueError, match=f"seen - min\\(recent\\) = {needed}"):
                dataclasses.replace(inputs, logits=inputs.logits[..., : needed - 1])


def test_ordered_key_sorts_like_the_values():
    values = torch.tensor([-3.5, -1.0, -0.0, 0.0, 1e-30, 2.0, 7.25, float("inf")])
    for dtype in (torch.bfloat16, torch.float32):
        keys = ordered_key(values.to(dtype))
        assert keys.tolist() == sorted(keys.tolist())
        assert keys[2] <= keys[3]  # -0 ranks with (just below) +0


def slot_map(inputs: ChoiceInputs) -> SlotMap:
    batch, heads, slots = inputs.positions.shape
    slots_map = SlotMap(batch, heads, 0, slots, torch.device("cpu"))
    slots_map.positions = inputs.positions.clone()
    slots_map.seen = inputs.seen
    slots_map.first = inputs.first.copy()
    slots_map.kept = (inputs.positions >= 0).sum(-1).amax(-1).numpy()
    slots_map.width = slots
    return slots_map


@pytest.mark.parametrize("ties", [True, False], ids=["ties", "distinct"])
def test_choice_and_swap_in_one_call_equal_choosing_then_the_torch_swap(ties, parts):
    """The compiled call (each row chosen, then its slots swapped, rows in parallel) leaves the
    same slots and lists the same fetches in the same order as choosing, then the PyTorch swap
    (the reference, CUDA's path); every row then holds exactly its chosen positions, each once."""
    rng = np.random.default_rng(3 if ties else 4)
    fetches = 0
    for _ in range(60):
        inputs = random_choice(rng, ties=ties)
        chosen, taken = compiled_ops.select_rule(inputs, parts=parts)
        apart, fused = slot_map(inputs), slot_map(inputs)
        expected = reference.swap(apart.positions, chosen, taken, inputs.seen)
        swapping = dataclasses.replace(inputs, positions=fused.positions)
        got = compiled_ops.choose_and_swap(swapping, parts=parts)
        assert torch.equal(fused.positions, apart.positions)
        assert (got is None) == (expected is None)
        if got is not None:
            fetches += got.rows.numel()
            for mine, theirs in zip(got, expected, strict=True):
                assert torch.equal(mine, theirs)
        for b in range(len(inputs.budget)):
            for h in range(chosen.shape[1]):
                held = fused.positions[b, h]
                count = int(inputs.budget[b])
                assert sorted(held[held >= 0].tolist()) == chosen[b, h, :count].tolist()
    assert fetches > 100  # the inputs do move tokens


@pytest.mark.parametrize("head_max", [True, False])
def test_accumulate_compiled_equals_torch_and_fades(head_max, parts):
    torch.manual_seed(0)
    batch, heads, groups, slots, width = 3, 2, 3, 20, 50
    positions = torch.stack([torch.randperm(width)[:slots] for _ in range(batch * heads)])
    positions = positions.view(batch, heads, slots)
    positions[:, :, -4:] = FREE
    histories = [
        PositionHistory(batch, heads, 8, torch.device("cpu"), decayed=True, head_max=head_max)
        for _ in range(2)
    ]
    window = np.array([3, 1, 40])  # w = 1: only the last step counts
    keep = torch.tensor(1 - 1 / window, dtype=torch.float64).view(-1, 1, 1)
    expected = torch.zeros(batch, heads, width, dtype=torch.float64)
    for _ in range(200):  # the scale of w = 3 passes RESCALE_AT: sums are rescaled on the way
        probabilities = torch.rand(batch, heads, groups, slots - 2)
        for history, flag in zip(histories, (True, False), strict=True):
            history.add(probabilities, positions, window, width, compiled=flag, parts=parts)
        rows = probabilities.amax(2) if head_max else probabilities.sum(2)
        held = positions[..., : slots - 2]
        rows = rows.double().masked_fill(held < 0, 0.0)
        expected = expected * keep
        expected.scatter_add_(-1, held.clamp(min=0), rows)
    assert torch.equal(histories[0].total, histories[1].total)
    assert histories[0].scale.max() < 2.0**64
    torch.testing.assert_close(
        histories[0].true_sums(width).double(), expected, rtol=1e-4, atol=1e-6
    )


def fetch_case(widened: bool, *, seed: int):
    """A host region of 3 sequences x 2 KV heads x 40 tokens (D = 16) with scales of about 1e-9
    to 10 (the smallest are float16 subnormals; ``widened``: one of 1e7, past float16), and 20
    distinct device rows of a flat (3 * 2 * 12 slots, D) view to fetch into: (pages, flat rows,
    (sequence, KV head, slot) of each, host token of each)."""
    torch.manual_seed(seed)
    batch, heads, dim, length, slots = 3, 2, 16, 40, 12
    pages = HostPages(batch, heads, dim, bits=8, dtype=torch.float32, device=torch.device("cpu"))
    magnitude = 10.0 ** torch.randint(-7, 3, (batch, heads, length, 1)).float()
    if widened:
        magnitude[0, 0, 0] = 1e7
    pages.write(0, *(torch.randn(2, batch, heads, length, dim) * magnitude))
    assert (pages.pair.scale.dtype == torch.float16) != widened
    flat = torch.randperm(batch * heads * slots)[:20]
    where = (flat // (heads * slots), flat // slots % heads, flat % slots)
    return pages, flat, where, torch.randint(0, length, (20,))


@pytest.mark.parametrize("widened", [False, True], ids=["float16-scales", "widened-scales"])
def test_fetched_rows_decode_into_the_slots_as_torch_does(widened, parts):
    """The fetch kernel writes each host row's INT8 codes, dequantized, into its device slot
    with the values :func:`quant.dequantize` gives, bit for bit: scales of every magnitude
    (float16 subnormals included), and a region whose scales were widened past float16 (the
    PyTorch path takes it)."""
    pages, flat, (rows, heads_, _), tokens = fetch_case(widened, seed=0)
    batch, heads, dim, slots = 3, 2, 16, 12
    written = []
    for flag in (True, False):
        buffers = torch.zeros(2, batch * heads * slots, dim)
        pages.fetch(rows, heads_, tokens, compiled=flag, parts=parts).write_into(*buffers, flat)
        written.append(buffers)
    assert torch.equal(written[0], written[1])
    expected = pages.fetch(rows, heads_, tokens, compiled=False).decoded()
    assert torch.equal(written[0][:, flat], torch.stack(expected))
    untouched = torch.ones(batch * heads * slots, dtype=torch.bool).index_fill_(0, flat, False)
    assert (written[0][:, untouched] == 0).all()


@pytest.mark.parametrize("widened", [False, True], ids=["float16-scales", "widened-scales"])
def test_fetched_codes_move_into_an_int8_region_as_torch_puts_them(widened, parts, monkeypatch):
    """An INT8 device region takes fetched rows' codes, scales and zero points as stored: the
    compiled copy (``codes_into``) writes exactly what the gather and advanced-index writes do,
    into exactly the fetched slots; a host region whose scales were widened past float16 (no
    longer the device region's dtype) takes PyTorch's path, which widens the device's."""
    pages, flat, (rows, heads_, slots_), tokens = fetch_case(widened, seed=1)
    batch, heads, dim, slots = 3, 2, 16, 12
    stores, keys = [], torch.randn(batch, heads, slots, dim)
    moved, copy = [], FetchedRows.codes_into
    monkeypatch.setattr(
        FetchedRows, "codes_into", lambda *args: moved.append(copy(*args)) or moved[-1]
    )
    for flag in (True, False):
        store = QuantizedStore(
            keys, keys, slots, bits=8, group_size=None, residual_tokens=0, groups=heads
        )
        moved.clear()
        fetched = pages.fetch(rows, heads_, tokens, compiled=flag, parts=parts)
        store.write_heads(rows, heads_, slots_, fetched)
        assert moved == [flag and not widened]  # the compiled copy took the rows, or not
        stores.append(store.codes.tensors())
    assert stores[0][1].dtype == (torch.float32 if widened else torch.float16)
    for mine, theirs in zip(*stores, strict=True):
        assert mine.dtype == theirs.dtype and torch.equal(mine, theirs)


@pytest.mark.parametrize(
    "dtype, width",
    [(torch.uint8, 16), (torch.float16, 1), (torch.bfloat16, 8), (torch.float32, 3)],
    ids=["codes", "scales", "bf16-rows", "fp32-rows"],
)
def test_gathered_rows_equal_index_select(dtype, width, parts):
    """The host gather (codes, scales, 16- and 32-bit rows) copies exactly the rows
    ``index_select`` does, in the order asked, repeats and no rows included."""
    generator = torch.Generator().manual_seed(width)
    region = torch.randint(0, 256, (2, 37, width * dtype.itemsize), dtype=torch.uint8)
    region = region.view(dtype)
    for count in (0, 1, 5, 60):
        rows = torch.randint(0, 37, (count,), generator=generator)
        got = alisa.storage.pages.gathered(region, rows, pin=False, compiled=True, parts=parts)
        expected = region.index_select(1, rows)
        assert got.dtype == dtype and got.shape == expected.shape
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))  # NaN bits too


@pytest.mark.parametrize("compiled", [True, False], ids=["fetch-kernel", "gather-kernel"])
def test_a_fetch_past_the_region_is_refused(compiled):
    """Both kernels that read fetched rows skip bounds checks, so a row past the region is
    refused when the fetch is made."""
    pages = HostPages(1, 2, 8, bits=8, dtype=torch.float32, device=torch.device("cpu"))
    pages.write(0, *torch.randn(2, 1, 2, 5, 8))
    fetched = pages.fetch(*torch.tensor([[0], [1], [3]]), compiled=compiled)
    assert fetched.decoded()[0].shape == (1, 8)
    rows = fetched.region[0].shape[1]  # the last head's last position is row rows - 1
    with pytest.raises(IndexError, match=f"row {rows} of a host region of {rows} rows"):
        pages.fetch(*torch.tensor([[0], [1], [pages.capacity]]), compiled=compiled)


@pytest.mark.parametrize(
    "settings",
    [
        dict(policy="swa", caching_ratio=0.3),
        dict(policy="swa", caching_ratio=0.3, history_share=0.0),
        dict(policy="h2o", budget_tokens=20),
        dict(policy="tova", caching_ratio=0.25),
        dict(policy="swa", caching_ratio=0.3, host_bits=8, kv_bits=8),
        dict(policy="swa", caching_ratio=0.3, reselect_every=2),
        dict(policy="swa", caching_ratio=0.3, reselect_every=2, estimate_rest=True),
    ],
    ids=["swa", "swa-no-history", "h2o", "tova", "int8", "every-2", "every-2-rest"],
)
def test_generation_compiled_equals_torch(settings):
    """Same tokens and the same cache state, layer by layer, with either implementation."""
    model = tiny_llama()
    ids, mask = padded_batch()
    config = AlisaConfig(retention="host", min_budget_tokens=0, **settings)
    outputs, caches = [], []
    # One product for both (named: a CPU's default differs by kind); the compiled kernels,
    # in one call where the layout allows, against the PyTorch reference.
    compiled = forced_ops("cpu", "cpu", product="compiled", fused=True)
    for ops in (compiled, forced_ops("cpu", "reference", product="compiled")):
        cache = AlisaCache(model, config, keeper=partial(default_keeper, ops=ops))
        outputs.append(hf_generate(model, ids, mask, cache, max_new_tokens=40))
        caches.append(cache)
    assert torch.equal(outputs[0], outputs[1])
    fetched = 0
    for mine, theirs in zip(caches[0].layers, caches[1].layers, strict=True):
        assert torch.equal(mine.slots.positions, theirs.slots.positions)
        for a, b in zip(
            mine.store.read(mine.slots.positions),
            theirs.store.read(theirs.slots.positions),
            strict=True,
        ):
            assert torch.equal(a, b)
        if mine.keeper.history is not None:
            assert torch.equal(mine.keeper.history.total, theirs.keeper.history.total)
        assert mine.keeper.fetched == theirs.keeper.fetched
        fetched += mine.keeper.fetched
    assert fetched > 0  # the budget was reached: tokens moved


@pytest.mark.parametrize(
    "settings",
    [
        dict(policy="swa", caching_ratio=0.3),
        dict(policy="swa", caching_ratio=0.15, history_share=0.0),
        dict(policy="h2o", budget_tokens=20),
        dict(policy="tova", caching_ratio=0.25),
        dict(policy="swa", caching_ratio=0.3, reselect_every=2),
    ],
    ids=["swa", "swa-no-history", "h2o", "tova", "every-2"],
)
def test_selection_in_one_call_equals_the_separate_calls(settings, parts):
    """Scoring, choosing, swapping and fetching in one compiled call per layer
    (:mod:`alisa.ops.cpu`) leaves every layer as the separate kernels do, bit for bit: the
    same tokens, slots, device rows, history and fetch counts, on a padded batch whose rows the
    selection splits into 1-3 parts (:attr:`alisa.ops.backends.Ops.parts`)."""
    model = tiny_llama()
    ids, mask = padded_batch()
    config = AlisaConfig(retention="host", min_budget_tokens=0, **settings)
    outputs, caches, calls = [], [], []
    for fused in (True, False):
        # The one call needs the compiled product: named, not left to this CPU's default.
        ops = forced_ops("cpu", "cpu", product="compiled", fused=fused, parts=parts)
        keeper = partial(default_keeper, ops=ops)
        cache = AlisaCache(model, config, keeper=keeper)
        outputs.append(hf_generate(model, ids, mask, cache, max_new_tokens=40))
        caches.append(cache)
        calls.append(sum(layer.keeper.steps for layer in cache.layers))
    assert torch.equal(outputs[0], outputs[1])
    assert calls[0] == calls[1] > 0
    fetched = 0
    for mine, theirs in zip(caches[0].layers, caches[1].layers, strict=True):
        assert torch.equal(mine.slots.positions, theirs.slots.positions)
        assert torch.equal(mine.store.keys, theirs.store.keys)
        assert torch.equal(mine.store.values, theirs.store.values)
        if mine.keeper.history is not None:
            assert torch.equal(mine.keeper.history.total, theirs.keeper.history.total)
        assert mine.keeper.fetched == theirs.keeper.fetched
        fetched += mine.keeper.fetched
    assert fetched > 0  # tokens came back from the host region
    assert all(layer.keeper.sketch.product == "compiled" for layer in caches[1].layers)


def test_the_one_call_selection_runs_where_its_layout_is_and_only_there(monkeypatch):
    """The fused call takes the float32 model's host retention with the compiled sketch
    product (INT8 host rows, a plain device region); a 16-bit host region, an INT8 device
    region, the rest's estimate, the library's bfloat16 or float32 product and ``fused=False``
    take the separate calls. Every case names its product: a CPU's default differs by kind."""
    model = tiny_llama()
    ids, mask = padded_batch()
    counts = {"fused": 0}
    fused = compiled_ops.select_and_fetch

    def counting(*args):  # a spy: the calls go on to the kernel
        counts["fused"] += 1
        return fused(*args)

    monkeypatch.setattr(compiled_ops, "select_and_fetch", counting)
    cases = [
        (dict(), {}, True),
        (dict(host_bits=16), {}, False),
        (dict(kv_bits=8), {}, False),
        (dict(estimate_rest=True), {}, False),
        (dict(), dict(fused=False), False),
        (dict(), dict(product="bfloat16", fused=False), False),
        (dict(), dict(product="float32", fused=False), False),
    ]
    for settings, keeper, expected in cases:
        counts["fused"] = 0
        config = AlisaConfig(
            retention="host", policy="swa", caching_ratio=0.3, min_budget_tokens=0, **settings
        )
        ops = forced_ops("cpu", "cpu", **{"product": "compiled", "fused": True, **keeper})
        cache = AlisaCache(model, config, keeper=partial(default_keeper, ops=ops))
        hf_generate(model, ids, mask, cache, max_new_tokens=8)
        assert (counts["fused"] > 0) == expected, settings


def test_a_fused_fetch_past_the_host_region_is_refused():
    """The fused call reads host rows without bounds checks, so a chosen position the host
    region does not hold (a broken invariant: every ranked position is coded) is refused."""
    cpu = torch.device("cpu")
    sketch = KeySketch(1, 1, 8, 40, cpu, product="compiled")  # the one call's product
    keys = torch.randn(1, 1, 40, 8)
    sketch.write(0, keys, torch.ones(1, 40, dtype=torch.bool))
    pages = HostPages(1, 1, 8, bits=8, dtype=torch.float32, device=cpu)
    pages.write(0, keys[:, :, :10], keys[:, :, :10])
    assert pages.capacity < 40
    positions = torch.full((1, 1, 48), FREE)  # nothing held: every chosen token is fetched
    store = DenseStore(torch.zeros(1, 1, 0, 8), torch.zeros(1, 1, 0, 8), 48)
    scoring = sketch.scoring(torch.randn(1, 1, 1, 8), 36)
    inputs = ChoiceInputs(
        logits=scoring.logits,
        history=None,
        shares=np.zeros(1, dtype=np.int64),
        positions=positions,
        first=np.zeros(1, dtype=np.int64),
        budget=np.array([12]),
        recent=np.array([4]),
        sinks=0,
        seen=40,
    )
    step = SelectionStep(inputs, scoring.operands, pages.region(0), store.plain_heads())
    with pytest.raises(IndexError, match="past the host region"):
        compiled_ops.fused(step)


def test_a_history_grows_moves_and_joins_with_its_scales():
    """Positions past the allocation are added after the sums grow; shifting moves columns;
    sequences that join keep their own scale, so their true sums are unchanged; histories of
    different kinds are refused."""
    cpu = torch.device("cpu")
    history = PositionHistory(1, 1, 4, cpu, decayed=False, head_max=False)
    history.add(torch.tensor([[[[2.0, 3.0]]]]), torch.tensor([[[1, 9]]]), None, 10, compiled=True)
    assert history.true_sums(12)[0, 0].tolist() == [0.0, 2.0] + [0.0] * 7 + [3.0, 0.0, 0.0]
    history.shift_columns(2)
    assert history.true_sums(4)[0, 0].tolist() == [0.0, 0.0, 0.0, 2.0]
    faded = PositionHistory(1, 1, 4, cpu, decayed=True, head_max=True)
    for _ in range(3):
        faded.add(torch.ones(1, 1, 2, 1), torch.tensor([[[0]]]), np.array([2]), 4, compiled=False)
    assert faded.scale[0] == 8.0  # (1 - 1/2) ** -3
    assert faded.true_sums(1)[0, 0, 0] == 1.75  # 1 + 1/2 + 1/4
    with pytest.raises(ValueError, match="different kinds"):
        history.extend_rows(faded)
    joined = faded.empty_like(2)
    joined.extend_rows(faded)
    assert joined.scale.tolist() == [1.0, 1.0, 8.0]
    assert joined.true_sums(1)[:, 0, 0].tolist() == [0.0, 0.0, 1.75]
    joined.select_batch(torch.tensor([2, 0]))
    assert joined.scale.tolist() == [8.0, 1.0] and joined.true_sums(1)[0, 0, 0] == 1.75


def test_kernels_leave_torch_thread_count_as_the_user_set_it():
    """numba's ``omp`` layer shares OpenMP with torch: starting its threads sets the thread
    count torch reads (a process set to one thread computed with every core after alisa's
    first kernel, even one given a single row). A fresh process, since numba starts its
    threads once per process."""
    script = (
        "import torch, numba\n"
        "from alisa.storage.pages import gathered\n"
        "region, seen = torch.zeros(2, 50, 4), []\n"
        "for threads, count in ((1, 1), (min(2, numba.config.NUMBA_NUM_THREADS), 40), (1, 40)):\n"
        "    torch.set_num_threads(threads)\n"
        "    gathered(region, torch.arange(count), pin=False, compiled=True)\n"
        "    seen.append((threads, torch.get_num_threads()))\n"
        "print(seen)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=300
    )
    seen = ast.literal_eval(result.stdout.strip().splitlines()[-1])
    assert all(asked == kept for asked, kept in seen), seen
