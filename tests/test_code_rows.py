"""The compiled INT8 writer of new tokens (``alisa.ops.cpu.code_rows``) against the
reference, ``quant.quantize`` and three writes: the same bytes in the region, and the
reference's own path wherever float16 cannot hold a row's scale or zero point."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import alisa.storage.quantized
from alisa.ops.cpu import _half_bits, _half_ceil, code_rows
from alisa.storage.quantized import QuantizedStore
from quant import quantize


def test_half_helpers_agree_with_torch_float16():
    """The smallest float16 at or above a value, and a float16 value's bits, as torch has them,
    over normal and subnormal magnitudes and both signs."""
    rng = np.random.default_rng(0)
    values = np.concatenate(
        [
            np.exp(rng.uniform(np.log(1e-9), np.log(6e4), 20_000)),
            [2.0**-24, 2.0**-14, 1.0, 65504.0, 3 * 2.0**-25, 1.0 + 2.0**-11],
        ]
    )
    for value in values:
        expected = torch.tensor(value, dtype=torch.float64).to(torch.float16)
        if float(expected) < value:
            expected = torch.nextafter(expected, torch.tensor(float("inf"), dtype=torch.float16))
        assert _half_ceil(value) == float(expected), value
    halves = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    floats = halves.view(torch.float16).double()
    finite = torch.isfinite(floats)
    got = np.array([_half_bits(float(v)) for v in floats[finite]])
    np.testing.assert_array_equal(got, halves[finite].numpy())


def reference_bytes(tokens: torch.Tensor):
    """quantize's codes, scales and zero points of (2, E, D) rows (one group per row)."""
    q = quantize(tokens, 8, None, scale_dtype=torch.float16, check_finite=False)
    return q.data, q.scale, q.zero_point


def rows_of(kind: str, rng: np.random.Generator, entries: int = 12, width: int = 64):
    tokens = rng.standard_normal((2, entries, width)).astype(np.float32)
    if kind == "scaled":
        tokens *= np.exp(rng.uniform(-12, 6, (2, entries, 1))).astype(np.float32)
    elif kind == "constant":
        tokens[:, ::2] = rng.choice([0.0, -0.0, 1.5, -3.0, 2.0**-20], (2, entries // 2, 1))
    elif kind == "positive":  # small spread far from zero: zero points beyond 2,048
        tokens = 1000.0 + tokens * 1e-3
    elif kind == "huge":  # a scale past float16's range
        tokens *= 1e8
    elif kind == "constant-unholdable":  # a constant float16 cannot hold
        tokens[:, 3] = 0.1
    return torch.from_numpy(tokens)


@pytest.mark.parametrize(
    "kind, written",
    [
        ("normal", True),
        ("scaled", True),
        ("constant", True),
        ("positive", False),
        ("huge", False),
        ("constant-unholdable", False),
    ],
)
def test_code_rows_writes_quantize_bytes_or_nothing(kind, written):
    rng = np.random.default_rng(1)
    tokens = rows_of(kind, rng)
    entries, width = tokens.shape[1:]
    capacity = 40
    codes = np.full((2, capacity, width), 7, dtype=np.uint8)
    scale = np.full((2, capacity), 5, dtype=np.int16)
    zero = np.full((2, capacity), 5, dtype=np.int16)
    target = rng.permutation(capacity)[:entries].astype(np.int64)
    before = codes.copy(), scale.copy(), zero.copy()
    assert code_rows(tokens.numpy(), codes, scale, zero, target) is written
    if not written:  # all or nothing
        for mine, theirs in zip((codes, scale, zero), before, strict=True):
            np.testing.assert_array_equal(mine, theirs)
        return
    data, scales, zeros = reference_bytes(tokens)
    assert scales.dtype == torch.float16
    np.testing.assert_array_equal(codes[:, target], data.numpy())
    np.testing.assert_array_equal(scale[:, target], scales[..., 0].view(torch.int16).numpy())
    np.testing.assert_array_equal(zero[:, target], zeros[..., 0].view(torch.int16).numpy())
    untouched = np.setdiff1d(np.arange(capacity), target)
    assert (codes[:, untouched] == 7).all() and (scale[:, untouched] == 5).all()


@pytest.fixture
def kernel_calls(monkeypatch) -> list[bool]:
    """What each call of the compiled writers returned, in order (the kernels still run):
    ``code_rows``' result, or ``("token", result)`` for a decode token's ``code_token``."""
    calls = []
    rows, token = alisa.storage.quantized.code_rows, alisa.storage.quantized.code_token
    monkeypatch.setattr(
        alisa.storage.quantized,
        "code_rows",
        lambda *a: calls.append(rows(*a)) or calls[-1],
    )
    monkeypatch.setattr(
        alisa.storage.quantized,
        "code_token",
        lambda *a: calls.append(("token", token(*a))) or calls[-1][1],
    )
    return calls


def store_pair(compiled: bool, heads: int, groups: int, residual: int):
    torch.manual_seed(2)
    keys = torch.randn(3, heads, 6, 16)
    return QuantizedStore(
        keys,
        keys * 0.5,
        20,
        bits=8,
        group_size=None,
        residual_tokens=residual,
        groups=groups,
        compiled=compiled,
    )


@pytest.mark.parametrize("groups", [1, 2], ids=["one-group", "per-head"])
@pytest.mark.parametrize(
    "kind", ["normal", "constant", "positive"], ids=["kernel", "constant", "widening"]
)
def test_a_store_writes_new_tokens_as_the_reference_does(groups, kind, kernel_calls):
    """write_range, write_slots and write_entries, compiled and not: the same region and
    full-precision ring, byte for byte; a row that needs wider scales takes the reference's
    path (and widens the region)."""
    rng = np.random.default_rng(3)
    regions = []
    for compiled in (True, False):
        store = store_pair(compiled, heads=2, groups=groups, residual=2)  # slots 0-5
        tokens = rows_of(kind, rng, entries=3 * 2 * 2, width=16).view(2, 3, 2, 2, 16)
        store.write_range(6, tokens[0], tokens[1], position=6)
        for step in range(3):
            # laid out as a model's projection leaves it: (B, 1, H_kv, D) transposed
            token = rows_of(kind, rng, entries=3 * 2, width=16).view(2, 3, 1, 2, 16)
            token = token.transpose(2, 3)
            slots = torch.tensor([[[8 + step]], [[11]], [[14 - step]]]).expand(3, groups, 1)
            store.write_slots(slots, token[0], token[1], position=8 + step)
        token = rows_of("normal", rng, entries=2 * 2, width=16).view(2, 2, 2, 16)
        store.write_entries(
            torch.tensor([0, 2]), torch.tensor([15, 16]), token[0], token[1], position=9
        )
        ring = (store.ring_keys, store.ring_values, store.ring_slots, store.ring_positions)
        regions.append([t.clone() for t in (*store.codes.tensors(), *ring)])
        rng = np.random.default_rng(3)
    widened = kind == "positive"
    # construction, write_range, write_slots x 3 (codes and ring in one call each),
    # write_entries; widened once, the region's scales are no longer float16 and no kernel is
    # asked again
    token = ("token", True)
    expected = [True, False] if widened else [True, True, token, token, token, True]
    assert kernel_calls == expected  # the compiled store only
    assert (regions[0][1].dtype == torch.float16) is not widened
    for mine, theirs in zip(*regions, strict=True):
        assert mine.dtype == theirs.dtype
        assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))


@pytest.mark.parametrize("kind", ["normal", "scaled", "positive"], ids=["kernel", "s", "widening"])
def test_a_host_region_codes_its_pages_as_the_reference_does(kind, kernel_calls):
    """Host retention's region (HostPages), compiled and not: a prompt of two chunks, then
    pages, then a row that needs wider scales: the same bytes and dtypes after each write (the
    kernel writes all or nothing; from a widening on, quantize's path codes the region)."""
    from alisa.storage.pages import WRITE_CHUNK, HostPages

    cpu = torch.device("cpu")
    batch, heads, dim = 2, 3, 8
    pages = [
        HostPages(batch, heads, dim, bits=8, dtype=torch.float32, device=cpu, compiled=compiled)
        for compiled in (True, False)
    ]
    rng = np.random.default_rng(4)
    start = 0
    for length in (WRITE_CHUNK + 24, 16, 16, 5):
        entries = batch * heads * length
        tokens = rows_of("normal" if start else kind, rng, entries, dim)
        tokens = tokens.view(2, batch, heads, length, dim)
        for region in pages:
            region.write(start, tokens[0], tokens[1])
        start += length
        mine, theirs = (region.pair.tensors() for region in pages)
        for a, b in zip(mine, theirs, strict=True):
            assert a.dtype == b.dtype
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    widened = kind == "positive"
    assert kernel_calls == ([False] if widened else [True] * 5)  # the compiled region only
    assert (pages[0].pair.scale.dtype == torch.float16) is not widened
