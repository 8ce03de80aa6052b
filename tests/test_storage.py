"""Stores as regions: one routing loop, so a new tier is one class; grouped logits helper."""

import numpy as np
import pytest
import torch
from transformers.integrations.sdpa_attention import repeat_kv

from alisa.kv.grouped import grouped_logits
from alisa.kv.slots import SlotMap
from alisa.ops.cpu import FREE
from alisa.storage.quantized import QuantizedStore
from alisa.storage.regions import DeviceRegion, TierStats
from alisa.storage.store import DenseStore, KVStore, TokenInputs
from alisa.storage.tiers import TieredStore


class ScratchRegion:
    """A tier made up for this test: KV kept in a plain tensor pair, on the same device."""

    tier = "scratch"
    needs_inputs = True  # also records the attention inputs it is handed

    def __init__(self, batch, heads, slots, dim, hidden_size):
        self.keys = torch.zeros(batch, heads, slots, dim)
        self.values = torch.zeros(batch, heads, slots, dim)
        self.hidden = torch.zeros(batch, slots, hidden_size)

    @property
    def slots(self):
        return self.keys.shape[2]

    def nbytes(self):
        return self.keys.nbytes + self.values.nbytes

    def read(self, positions, used):
        return self.keys, self.values  # every slot: the ones from ``used`` on are free

    def write_range(self, start, keys, values, position, inputs):
        end = start + keys.shape[2]
        self.keys[:, :, start:end], self.values[:, :, start:end] = keys, values
        self.hidden[:, start:end] = inputs.hidden

    def write_entries(self, rows, slots, keys, values, position, inputs):
        self.keys[rows, :, slots], self.values[rows, :, slots] = keys, values
        self.hidden[rows, slots] = inputs.hidden[:, 0]

    def grow(self, slots):
        extra = slots - self.slots
        self.keys = torch.nn.functional.pad(self.keys, (0, 0, 0, extra))
        self.values = torch.nn.functional.pad(self.values, (0, 0, 0, extra))
        self.hidden = torch.nn.functional.pad(self.hidden, (0, 0, 0, extra))

    def select_batch(self, indices):
        self.keys, self.values = self.keys[indices], self.values[indices]
        self.hidden = self.hidden[indices]

    def prefetch(self, used):
        pass


def test_a_new_tier_is_one_class_and_routes_like_a_dense_store():
    torch.manual_seed(0)
    batch, heads, dim, hidden_size = 2, 2, 4, 3
    empty = torch.zeros(batch, heads, 0, dim)
    device = DeviceRegion(DenseStore(empty, empty, 5))
    scratch = ScratchRegion(batch, heads, 3, dim, hidden_size)
    tiered = TieredStore([device, scratch], torch.device("cpu"), TierStats())
    dense = DenseStore(empty, empty, 8)
    assert tiered.needs_inputs and not tiered.compactable
    # A range crossing the boundary, then single tokens landing in either region.
    keys, values = torch.randn(batch, heads, 6, dim), torch.randn(batch, heads, 6, dim)
    inputs = TokenInputs(torch.randn(batch, 6, hidden_size), torch.arange(6).expand(batch, -1))
    for store in (tiered, dense):
        store.write_range(0, keys, values, 0, inputs)
    one_key, one_value = torch.randn(batch, heads, 1, dim), torch.randn(batch, heads, 1, dim)
    slots = torch.tensor([1, 6]).view(batch, 1, 1)
    one = TokenInputs(torch.randn(batch, 1, hidden_size), torch.full((batch, 1), 6))
    for store in (tiered, dense):
        store.write_slots(slots, one_key, one_value, 6, one)
    tiered_keys, tiered_values = tiered.read(torch.zeros(batch, 1, 8, dtype=torch.long))
    assert torch.equal(tiered_keys, dense.keys) and torch.equal(tiered_values, dense.values)
    assert torch.equal(scratch.hidden[:, :1], inputs.hidden[:, 5:6])
    assert torch.equal(scratch.hidden[1, 1], one.hidden[1, 0])
    assert tiered.regions == [("device", 5), ("scratch", 3)]
    assert tiered.tier_bytes() == {"device": device.nbytes(), "scratch": scratch.nbytes()}
    tiered.grow(10)  # the last region takes the growth
    assert tiered.regions == [("device", 5), ("scratch", 5)]


def test_every_store_answers_the_whole_protocol():
    members = [name for name in vars(KVStore) if not name.startswith("_")]
    members += list(KVStore.__annotations__)
    keys = torch.randn(1, 2, 3, 16)
    stores = [
        DenseStore(keys, keys, 8),
        QuantizedStore(keys, keys, 8, bits=8, group_size=None, residual_tokens=2, groups=1),
        TieredStore([DeviceRegion(DenseStore(keys, keys, 4))], torch.device("cpu"), TierStats()),
    ]
    for store in stores:
        for name in members:
            assert hasattr(store, name), (type(store).__name__, name)
        assert sum(store.tier_bytes().values()) == store.nbytes()
        assert sum(slots for _, slots in store.regions) == store.capacity


def test_grouped_logits_match_repeated_keys():
    torch.manual_seed(1)
    query, key = torch.randn(2, 6, 3, 8), torch.randn(2, 2, 5, 8)
    expected = query @ repeat_kv(key, 3).transpose(-1, -2) * 0.5  # (B, H, q, S)
    logits = grouped_logits(query, key, 0.5)  # (B, H_kv, G, q, S)
    assert torch.allclose(logits.reshape(2, 6, 3, 5), expected, atol=1e-6)


@pytest.mark.parametrize("bits", [16, 8])
def test_writes_that_land_late_read_as_writes_that_land_at_once(bits):
    """On CUDA a host region's pages land at its next read (their copies run meanwhile): every
    read and reshaping settles first, so deferred and immediate landing hold the same rows."""
    from alisa.storage.pages import WRITE_CHUNK, HostPages

    torch.manual_seed(0)
    batch, heads, dim = 3, 2, 8
    cpu = torch.device("cpu")
    pages = [
        HostPages(batch, heads, dim, bits=bits, dtype=torch.float32, device=cpu, defer=defer)
        for defer in (True, False)
    ]

    def every_row(region):
        length, batch = region.length, rows_now[0]
        rows = torch.arange(batch).repeat_interleave(heads * length)
        kv_heads = torch.arange(heads).repeat_interleave(length).repeat(batch)
        positions = torch.arange(length).repeat(batch * heads)
        return region.fetch(rows, kv_heads, positions, compiled=False).decoded()

    def same():
        first, second = (every_row(region) for region in pages)
        assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))

    rows_now = [batch]
    start = 0
    for length in (WRITE_CHUNK + 40, 16, 16, 3):  # a prompt (two chunks), then pages
        keys, values = torch.randn(2, batch, heads, length, dim)
        for region in pages:
            region.write(start, keys, values)
        start += length
    same()
    keys, values = torch.randn(2, batch, heads, 16, dim)
    for region in pages:
        region.write(start, keys, values)
        region.select_batch(torch.tensor([2, 0]))
    start += 16
    rows_now[0] = 2
    same()
    keys, values = torch.randn(2, 2, heads, 16, dim)
    for region in pages:
        region.write(start, keys, values)
        region.shift(-5)
    same()
    other = HostPages(2, heads, dim, bits=bits, dtype=torch.float32, device=cpu, defer=True)
    other.write(0, *torch.randn(2, 2, heads, pages[0].length, dim))
    keys, values = torch.randn(2, 2, heads, 4, dim)
    for region in pages:
        region.write(start, keys, values)
        region.extend_rows(other)
    rows_now[0] = 4
    same()


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "pytorch"])
def test_a_new_token_takes_each_rows_lowest_free_slot_and_its_keys_land_there(groups, compiled):
    # SlotMap.place_one and DenseStore.write_slots as a decode step uses them once slots were
    # freed (eviction, or host retention's swap): per (sequence, group), the lowest free slot
    # below the frontier; a sequence without a hole appends at the frontier.
    batch, heads, dim, length = 3, 3, 4, 6
    slots = SlotMap(batch, groups, length, 8, torch.device("cpu"), compiled=compiled)
    # Sequence 0 frees slot 4 in every group, and slot 1 too in its last group; sequence 1 frees
    # slot 2; sequence 2 frees nothing (it appends).
    slots.positions[0, :, 4] = FREE
    slots.positions[0, -1, 1] = FREE
    slots.positions[1, :, 2] = FREE
    slots.kept = np.array([length - 1, length - 1, length])
    append = slots.appends()
    assert append.tolist() == [False, False, True]
    placed = slots.place_one(append)
    expected = torch.tensor([[4] * groups, [2] * groups, [6] * groups]).view(batch, groups, 1)
    expected[0, -1, 0] = 1
    assert torch.equal(placed, expected)
    assert (slots.positions.gather(-1, placed) == length).all()
    assert slots.width == length + 1 and slots.seen == length + 1

    store = DenseStore(
        torch.zeros(batch, heads, 0, dim), torch.zeros(batch, heads, 0, dim), 8, compiled=compiled
    )
    keys, values = torch.randn(batch, heads, 1, dim), torch.randn(batch, heads, 1, dim)
    store.write_slots(placed, keys, values)
    reference = torch.zeros(batch, heads, 8, dim), torch.zeros(batch, heads, 8, dim)
    for b in range(batch):
        for h in range(heads):
            slot = int(placed[b, h if groups > 1 else 0, 0])
            reference[0][b, h, slot], reference[1][b, h, slot] = keys[b, h, 0], values[b, h, 0]
    assert torch.equal(store.keys, reference[0]) and torch.equal(store.values, reference[1])


def test_compiled_placement_is_the_first_free_slot_rule():
    """alisa.ops.cpu.place_one against the rule as array ops (the CUDA branch's): random
    holes, appending rows, and a row claimed to have a hole that has none (slot 0, as argmax)."""
    from alisa.ops import cpu

    rng = np.random.default_rng(5)
    for trial in range(40):
        batch, groups, width = rng.integers(1, 5), rng.integers(1, 4), rng.integers(1, 30)
        held = rng.integers(0, 100, (batch, groups, width + 3))
        held[rng.random(held.shape) < 0.2] = FREE
        held[rng.random(held.shape) < 0.05] = -2  # padding is never reused
        append = rng.random(batch) < 0.4
        if trial == 0:
            held[0, :, :width] = 7  # no free slot below the frontier
            append[0] = False
        mine, slots = held.copy(), np.empty((batch, groups), dtype=np.int64)
        grows = cpu.place_one(mine, width, 500, append, slots)
        expected = (held[..., :width] == FREE).argmax(axis=-1)
        expected[append] = width
        assert np.array_equal(slots, expected) and grows == append.any()
        theirs = held.copy()
        theirs[np.arange(batch).reshape(-1, 1), np.arange(groups), expected] = 500
        assert np.array_equal(mine, theirs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups", [1, 2])
def test_a_compiled_slot_write_copies_each_token_and_refuses_a_slot_outside(dtype, groups):
    batch, heads, dim, capacity = 3, 2, 4, 8
    store = DenseStore(
        torch.zeros(batch, heads, 0, dim, dtype=dtype),
        torch.zeros(batch, heads, 0, dim, dtype=dtype),
        capacity,
        compiled=True,
    )
    keys, values = torch.randn(2, batch, heads, 1, dim).to(dtype)
    placed = torch.tensor([[5, 1], [0, 0], [7, 3]])[:, :groups, None]
    store.write_slots(placed, keys, values)
    reference = torch.zeros(2, batch, heads, capacity, dim, dtype=dtype)
    index = placed.expand(batch, heads, 1)
    reference[0].scatter_(2, index[..., None].expand(-1, -1, -1, dim), keys)
    reference[1].scatter_(2, index[..., None].expand(-1, -1, -1, dim), values)
    assert torch.equal(store.keys, reference[0]) and torch.equal(store.values, reference[1])
    with pytest.raises(IndexError, match="outside"):
        store.write_slots(torch.full((batch, groups, 1), capacity), keys, values)
    assert torch.equal(store.keys, reference[0])  # nothing written
