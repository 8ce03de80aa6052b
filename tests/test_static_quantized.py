"""INT8/INT4 KV in a static cache (alisa.storage.quantized.StaticPair, issue 65): a store
written one token at a time with fixed shapes holds the eager store's codes, scales and zero
points, widened where a token needs it, and reads the same keys and values, bit for bit."""

from __future__ import annotations

import pytest
import torch

from alisa.storage.quantized import QuantizedStore
from quant.asymmetric import SCALE_LEVELS

BATCH, HEADS, DIM, CAPACITY = 2, 2, 8, 40


def _token(generator: torch.Generator, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """(B, H, 1, D) keys or values; ``kind`` picks rows whose scales float16 cannot hold."""
    token = torch.randn(BATCH, HEADS, 1, DIM, generator=generator)
    if kind == "constant":  # a constant row keeps its value as the scale: not a float16 one
        token[0, 1] = 0.1234567
    elif kind == "offset":  # a zero point past float16's and float32's integers
        token[1, 0] = 1e4 + torch.arange(DIM) * 1e-3
    return token.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("bits", "group"), [(8, None), (4, 4)])
@pytest.mark.parametrize("widen", ["none", "constant", "offset"])
@pytest.mark.parametrize("branch", [False, True], ids=["select", "branch"])
def test_a_static_store_holds_and_reads_the_eager_stores_bytes(branch, widen, bits, group, dtype):
    """Decoded by selecting among every dtype's values (CUDA) or by a branch to one (a CPU):
    the eager store's keys and values."""
    generator = torch.Generator().manual_seed(3)
    prompt = [torch.randn(BATCH, HEADS, 12, DIM, generator=generator).to(dtype) for _ in "kv"]
    options = dict(bits=bits, group_size=group, residual_tokens=5, groups=1)
    eager = QuantizedStore(*prompt, CAPACITY, **options)
    static = QuantizedStore(*prompt, CAPACITY, static=True, branch=branch, **options)
    positions = torch.full((BATCH, 1, CAPACITY), -1, dtype=torch.long)
    positions[:, :, :12] = torch.arange(12)
    for step, position in enumerate(range(12, 30)):
        kind = widen if position in (17, 25) else "none"
        keys, values = _token(generator, kind, dtype), _token(generator, "none", dtype)
        # Slots each row takes in turn: a slot refilled after an eviction, or the next one.
        slot = torch.tensor([[[12 + step]], [[(3 * step) % 12]]])
        positions.scatter_(-1, slot, position)
        eager.write_slots(slot, keys, values, position)
        static.write_slots(slot, keys, values, torch.tensor([position]))
        assert SCALE_LEVELS[int(static.codes.level)] == eager.codes.scale.dtype
        assert torch.equal(static.codes.data, eager.codes.data)
        assert torch.equal(static.codes.scale, eager.codes.scale.double())
        assert torch.equal(static.codes.zero, eager.codes.zero.double())
        for mine, theirs in zip(static.read(positions), eager.read(positions), strict=True):
            assert mine.dtype == dtype and torch.equal(mine, theirs)
    if dtype == torch.float32:  # 16-bit keys round these rows to ones float16 scales hold
        widened = {"none": torch.float16, "constant": torch.float32, "offset": torch.float64}
        assert eager.codes.scale.dtype == widened[widen]


def test_a_static_store_keeps_its_buffers_and_counts_its_wider_scales():
    """A static step writes the same tensors every step (their addresses are marked fixed);
    their bytes are what the store reports: float64 scales and zero points (16 bytes a
    group) where the eager store's are float16 (4)."""
    prompt = [torch.randn(BATCH, HEADS, 4, DIM) for _ in "kv"]
    options = dict(bits=8, group_size=None, residual_tokens=0, groups=1)
    static = QuantizedStore(*prompt, CAPACITY, static=True, **options)
    eager = QuantizedStore(*prompt, CAPACITY, **options)
    before = [t.data_ptr() for t in static.static_buffers()]
    for position in range(4, 10):
        slot = torch.full((BATCH, 1, 1), position)
        static.write_slots(slot, *(torch.randn(BATCH, HEADS, 1, DIM) for _ in "kv"), position)
    assert [t.data_ptr() for t in static.static_buffers()] == before
    rows = 2 * BATCH * HEADS * CAPACITY
    assert eager.nbytes() == rows * (DIM + 4)
    assert static.nbytes() == rows * (DIM + 16) + 8  # and the level
    with pytest.raises(NotImplementedError, match="built without static=True"):
        eager.static_buffers()
