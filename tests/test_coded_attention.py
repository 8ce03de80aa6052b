"""A decode step's attention by the compiled kernels equals PyTorch's path over the same slots.

On a CPU, :meth:`QuantizedStore.attend` scores and sums the INT8 codes where they are and
:meth:`DenseStore.attend` the float32 buffers (:mod:`alisa.ops.cpu`), instead of
PyTorch's product, mask, softmax and product over :meth:`parts` (for INT8, the region written
dequantized each step): the reference, and CUDA's path. The kernels reassociate sums, so outputs
agree to float32 rounding; the slots seen, the ring's exact rows and the rows that see nothing
must agree exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import hf_generate, padded_batch, tiny_llama

from alisa import AlisaCache, AlisaConfig
from alisa.kv.attention import _visible, grouped_attention_parts
from alisa.ops.cpu import HALVES, slot_logits, slot_output
from alisa.storage.quantized import QuantizedStore
from alisa.storage.store import DenseStore


def random_store(rng: np.random.Generator, *, shared: bool, residual: int, capacity: int = 48):
    """A store written as a decode would leave it: a prompt, then single tokens written over
    slots (some ring entries stale), positions shuffled with holes."""
    batch, kv_heads, groups, head_dim = 3, 2, 3, 16
    hs = 1 if shared else kv_heads
    keys = torch.randn(batch, kv_heads, capacity - 8, head_dim)
    store = QuantizedStore(
        keys,
        torch.randn_like(keys),
        capacity,
        bits=8,
        group_size=None,
        residual_tokens=residual,
        groups=hs,
        compiled=True,
    )
    seen = capacity - 8
    positions = torch.full((batch, hs, capacity), -1, dtype=torch.int64)
    positions[..., :seen] = torch.arange(seen)
    for _ in range(8):  # tokens written over random slots: the ring's older entries go stale
        slots = torch.from_numpy(rng.integers(0, capacity, size=(batch, hs, 1)))
        token = torch.randn(batch, kv_heads, 1, head_dim)
        store.write_slots(slots, token, torch.randn_like(token), position=seen)
        positions.scatter_(-1, slots, seen)
        seen += 1
    positions[torch.from_numpy(rng.random(positions.shape) < 0.15)] = -1
    query = torch.randn(batch, kv_heads * groups, 1, head_dim)
    return store, positions, seen, query


def count_in_place(monkeypatch, store_class) -> list[bool]:
    """Record, per call of ``store_class.attend``, whether it attended itself (not None)."""
    calls = []
    in_place = store_class.attend

    def counted(self, *args):
        result = in_place(self, *args)
        calls.append(result is not None)
        return result

    monkeypatch.setattr(store_class, "attend", counted)
    return calls


def reference(store, positions, query, seen, window, scaling=0.25):
    parts = store.parts(positions)
    visible = _visible(parts, seen, 1, window)
    return grouped_attention_parts(query, parts, visible, scaling)


@pytest.mark.parametrize("shared", [True, False], ids=["one-group", "per-head"])
@pytest.mark.parametrize("residual", [0, 4, 64])
@pytest.mark.parametrize("window", [None, 9])
def test_in_place_equals_the_dequantized_region(shared, residual, window):
    rng = np.random.default_rng(residual + 7 * shared + (window or 0))
    for trial in range(4):
        store, positions, seen, query = random_store(rng, shared=shared, residual=residual)
        seen -= trial  # later positions than the query are hidden
        output, probabilities = store.attend(positions, query, seen, window, 0.25)
        expected_output, expected = reference(store, positions, query, seen, window)
        assert output.shape == expected_output.shape
        assert probabilities.shape == expected.shape
        assert torch.equal(probabilities == 0, expected == 0)  # the same slots seen
        torch.testing.assert_close(probabilities, expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(output, expected_output, rtol=1e-5, atol=1e-5)


def test_the_ring_is_read_exactly():
    """With every slot's token in the ring, attention is exactly full precision (the codes,
    written from other values, would be far off)."""
    keys = torch.randn(1, 1, 4, 8)
    values = torch.randn(1, 1, 4, 8)
    store = QuantizedStore(
        keys, values, 4, bits=8, group_size=None, residual_tokens=4, groups=1, compiled=True
    )
    store.codes.data.fill_(255)  # codes no longer say anything about the tokens
    positions = torch.arange(4).view(1, 1, 4)
    query = torch.randn(1, 2, 1, 8)
    output, probabilities = store.attend(positions, query, 4, None, 0.5)
    logits = (query[0, :, 0] @ keys[0, 0].T) * 0.5
    torch.testing.assert_close(probabilities.view(2, 4), logits.softmax(-1))
    torch.testing.assert_close(output.view(2, 8), logits.softmax(-1) @ values[0, 0])


def test_a_row_that_sees_nothing_is_nan_as_the_softmax():
    rng = np.random.default_rng(3)
    store, positions, seen, query = random_store(rng, shared=True, residual=4)
    positions[1] = -1  # the second sequence holds nothing
    output, probabilities = store.attend(positions, query, seen, None, 0.25)
    expected_output, expected = reference(store, positions, query, seen, None)
    assert torch.equal(probabilities.isnan(), expected.isnan())
    assert probabilities[1].isnan().all() and output[1].isnan().all()
    torch.testing.assert_close(output[[0, 2]], expected_output[[0, 2]], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("parts", [2, 3, 5])
def test_splitting_rows_changes_nothing(parts):
    """Rows run in parallel parts (torch's threads): the same bits as one part."""
    rng = np.random.default_rng(parts)
    store, positions, seen, query = random_store(rng, shared=False, residual=4)
    codes = store.codes
    rows = 6
    keys, values = (codes.data[half].reshape(rows, store.capacity, 16).numpy() for half in (0, 1))
    scales = [
        tuple(
            t[half].view(torch.int16).reshape(rows, store.capacity).numpy()
            for t in (codes.scale, codes.zero)
        )
        for half in (0, 1)
    ]
    ring = (store.ring_slots.numpy(), store.ring_positions.numpy())
    ring_keys = store.ring_keys.reshape(rows, 4, 16).numpy()
    ring_values = store.ring_values.reshape(rows, 4, 16).numpy()
    grouped = query.reshape(rows, 3, 16).contiguous().numpy()
    held = positions.numpy()
    results = []
    for split in (1, parts):
        logits = np.empty((rows, 3, store.capacity), dtype=np.float32)
        slot_logits(
            grouped,
            keys,
            *scales[0],
            HALVES,
            held,
            ring_keys,
            *ring,
            seen - 1,
            0,
            0.25,
            logits,
            split,
        )
        probabilities = torch.from_numpy(logits).softmax(-1).numpy()
        out = np.empty((rows, 3, 16), dtype=np.float32)
        slot_output(probabilities, values, *scales[1], HALVES, held, ring_values, *ring, out, split)
        results.append((logits, out))
    for a, b in zip(*results, strict=True):
        assert np.array_equal(a, b)


def test_other_formats_read_the_dequantized_region():
    """INT4, groups narrower than a head, 16-bit models, several queries, ``compiled=False``:
    no in-place path (None), attention reads ``parts``."""
    keys = torch.randn(1, 1, 4, 16)
    query = torch.randn(1, 2, 1, 16)
    positions = torch.arange(4).view(1, 1, 4)

    def store(keys=keys, **options):
        settings = dict(bits=8, group_size=None, residual_tokens=2, groups=1, compiled=True)
        settings |= options
        return QuantizedStore(keys, keys.clone(), 4, **settings)

    assert store().attend(positions, query, 4, None, 0.25) is not None
    assert store(bits=4).attend(positions, query, 4, None, 0.25) is None
    assert store(group_size=8).attend(positions, query, 4, None, 0.25) is None
    assert store(compiled=False).attend(positions, query, 4, None, 0.25) is None
    two = torch.randn(1, 2, 2, 16)
    assert store().attend(positions, two, 4, None, 0.25) is None
    half = keys.bfloat16()
    assert store(keys=half).attend(positions, query.bfloat16(), 4, None, 0.25) is None


@pytest.mark.parametrize("shared", [True, False], ids=["one-group", "per-head"])
@pytest.mark.parametrize("window", [None, 9])
def test_float32_slots_equal_pytorch(shared, window):
    """A float32 region (:class:`DenseStore`): the same attention as PyTorch's path."""
    rng = np.random.default_rng(11 + shared + (window or 0))
    for trial in range(4):
        _, positions, seen, query = random_store(rng, shared=shared, residual=0)
        keys = torch.randn(3, 2, positions.shape[-1], 16)
        store = DenseStore(keys, torch.randn_like(keys), keys.shape[2], compiled=True)
        seen -= trial
        output, probabilities = store.attend(positions, query, seen, window, 0.25)
        expected_output, expected = reference(store, positions, query, seen, window)
        assert torch.equal(probabilities == 0, expected == 0)
        torch.testing.assert_close(probabilities, expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(output, expected_output, rtol=1e-5, atol=1e-5)
    half = DenseStore(keys.bfloat16(), keys.bfloat16(), keys.shape[2], compiled=True)
    assert half.attend(positions, query.bfloat16(), seen, window, 0.25) is None  # PyTorch's
    assert (
        DenseStore(keys, keys, keys.shape[2], compiled=False).attend(
            positions, query, seen, window, 0.25
        )
        is None
    )


@pytest.mark.parametrize(
    "settings",
    [
        dict(policy="swa", caching_ratio=0.3, retention="host"),
        dict(policy="swa", caching_ratio=0.3),
        dict(policy="h2o", budget_tokens=20, residual_tokens=4),
        dict(policy="dense"),
    ],
    ids=["host", "drop", "h2o-ring-4", "dense"],
)
@pytest.mark.parametrize("kv_bits", [16, 8])
def test_generation_kernels_equal_pytorch(settings, kv_bits, monkeypatch):
    """Whole float32 generations, float32 or INT8 device region: the same tokens whether
    attention runs the kernels (every decode step of every layer) or PyTorch's path
    (``attend`` answering None)."""
    model = tiny_llama()
    ids, mask = padded_batch()
    config = AlisaConfig(kv_bits=kv_bits, min_budget_tokens=0, **settings)
    store_class = QuantizedStore if kv_bits == 8 else DenseStore
    calls = count_in_place(monkeypatch, store_class)
    kernel = hf_generate(model, ids, mask, AlisaCache(model, config), max_new_tokens=30)
    assert calls and all(calls)
    monkeypatch.setattr(store_class, "attend", lambda self, *args: None)
    torch_path = hf_generate(model, ids, mask, AlisaCache(model, config), max_new_tokens=30)
    assert torch.equal(kernel, torch_path)
