"""The key sketch of retention="host": the strongest RoPE channel pairs of every key."""

import pytest
import torch

import alisa.storage.sketch as sketch_module
from alisa.storage.sketch import SKETCH_DTYPE, KeySketch

STRONG = ((1, 6, 2, 5), (3, 4, 7, 6), (2, 5, 1, 7))  # per KV head: its strong RoPE pairs


def keys_with_strong_pairs(batch=2, heads=3, length=40, dim=16):
    """(B, H, L, D) keys whose pairs (channels p and p + D/2) in ``STRONG[h]`` are strong, and
    two sink rows with huge values on pair 0."""
    torch.manual_seed(0)
    keys = torch.randn(batch, heads, length, dim) * 0.01
    half = dim // 2
    for head in range(heads):
        for pair in STRONG[head]:
            keys[:, head, :, pair] *= 400
            keys[:, head, :, pair + half] *= 400
    keys[:, :, :2, 0] = 1e4  # sinks: never counted, so they cannot claim pair 0
    return keys


def test_the_sketch_keeps_the_pairs_with_the_largest_key_norms_and_ignores_sinks():
    keys = keys_with_strong_pairs()
    batch, heads, length, dim = keys.shape
    counted = torch.ones(batch, length, dtype=torch.bool)
    counted[:, :2] = False
    sketch = KeySketch(batch, heads, dim, length, keys.device)
    assert sketch.choosing
    sketch.write(0, keys, counted)
    assert not sketch.choosing
    half = dim // 2
    for head, strong in enumerate(STRONG):
        chosen = set(sketch.channels[0, head, : sketch.width // 2].tolist())
        assert chosen == set(strong)
        # Pairs: channel p and p + D/2 are kept together.
        assert torch.equal(
            sketch.channels[0, head, sketch.width // 2 :],
            sketch.channels[0, head, : sketch.width // 2] + half,
        )
    assert sketch.width == dim // 2


def test_logits_are_the_partial_logits_of_each_query_head():
    keys = keys_with_strong_pairs()
    batch, heads, length, dim = keys.shape
    sketch = KeySketch(batch, heads, dim, 8, keys.device)  # grows as keys come
    counted = torch.ones(batch, 24, dtype=torch.bool)
    counted[:, :2] = False
    sketch.write(0, keys[:, :, :24], counted)
    sketch.write(24, keys[:, :, 24:], None)  # later writes need no `counted`
    query = torch.randn(batch, heads, 2, dim)
    logits = sketch.logits(query)
    assert logits.dtype == SKETCH_DTYPE and logits.shape[-1] == sketch.capacity >= length
    out = logits.float()[..., :length]
    index = sketch.channels.unsqueeze(2)
    q = query.gather(-1, index.expand(-1, -1, 2, -1)).to(SKETCH_DTYPE).float()
    k = keys.gather(-1, index.expand(-1, -1, length, -1)).to(SKETCH_DTYPE).float()
    expected = q @ k.transpose(-1, -2)
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
    assert not logits[..., length:].any()  # positions not written score 0
    out = out.amax(dim=2)
    # Past the sinks (always attended), the ranking follows the full logits: the dropped
    # channels are weak.
    full = (query @ keys.transpose(-1, -2)).amax(dim=2)[..., 2:]
    top = out[..., 2:].topk(4, dim=-1).indices
    assert (top.unsqueeze(-1) == full.topk(8, dim=-1).indices.unsqueeze(-2)).any(-1).all()


@pytest.mark.parametrize("pieces", [False, True])
@pytest.mark.parametrize("key_dtype", [torch.float32, torch.bfloat16])
def test_the_float32_product_gives_the_bfloat16_products_scores(key_dtype, pieces, monkeypatch):
    """Where the device has no fast bfloat16 product the sketch multiplies in float32: the
    same bfloat16 operands, so the scores are the exact product rounded to bfloat16 (the
    bfloat16 product rounds its sum the same way, up to the order of the sum); a large
    sketch is widened a piece of positions at a time, with the same scores."""
    keys = keys_with_strong_pairs(length=300, dim=64).to(key_dtype)
    batch, heads, length, dim = keys.shape
    if pieces:  # 7 positions per piece: the last piece is partial
        monkeypatch.setattr(sketch_module, "WIDEN_CHUNK_BYTES", batch * heads * dim // 2 * 4 * 7)
    counted = torch.ones(batch, length, dtype=torch.bool)
    sketches = {}
    for product in (torch.float32, torch.bfloat16):
        sketch = KeySketch(batch, heads, dim, 8, keys.device, key_dtype=key_dtype, product=product)
        sketch.write(0, keys, counted)
        sketches[product] = sketch
    query = torch.randn(batch, heads, 3, dim, dtype=key_dtype)
    wide = sketches[torch.float32].logits(query)
    narrow = sketches[torch.bfloat16].logits(query)
    assert wide.dtype == narrow.dtype == SKETCH_DTYPE
    torch.testing.assert_close(wide.float(), narrow.float(), rtol=1e-2, atol=1e-2)
    sketch = sketches[torch.float32]
    index = sketch.channels.unsqueeze(2)
    q = query.gather(-1, index.expand(-1, -1, 3, -1)).to(SKETCH_DTYPE).double()
    k = sketch.keys[:, :, :length].double()
    exact = q @ k.mT
    if sketch.scales is not None:
        exact = exact * sketch.scales[:, :, :length].unsqueeze(2).double()
    torch.testing.assert_close(
        wide[..., :length].float(), exact.to(SKETCH_DTYPE).float(), rtol=8e-3, atol=1e-6
    )


def test_a_sequence_with_nothing_counted_chooses_from_all_its_keys_and_batches_reorder():
    keys = keys_with_strong_pairs(batch=2)
    batch, heads, length, dim = keys.shape
    counted = torch.ones(batch, length, dtype=torch.bool)
    counted[0, :2] = False
    counted[1] = False  # all padding or sinks so far
    sketch = KeySketch(batch, heads, dim, length, keys.device)
    sketch.write(0, keys, counted)
    assert 0 in sketch.channels[1, 0].tolist()  # the huge sink values now count
    assert 0 not in sketch.channels[0, 0].tolist()
    channels, stored = sketch.channels.clone(), sketch.keys.clone()
    sketch.select_batch(torch.tensor([1, 0]))
    assert torch.equal(sketch.channels, channels.flip(0))
    assert torch.equal(sketch.keys, stored.flip(0))


def test_an_odd_head_dim_sketches_its_pairs_and_a_single_channel_is_refused():
    keys = torch.randn(1, 2, 12, 7)
    sketch = KeySketch(1, 2, 7, 12, keys.device)
    sketch.write(0, keys, torch.ones(1, 12, dtype=torch.bool))
    assert sketch.width == 4 and int(sketch.channels.max()) < 6  # channel 6 has no partner
    query = torch.randn(1, 2, 1, 7)
    assert torch.isfinite(sketch.logits(query)).all()
    with pytest.raises(ValueError, match="head_dim=1"):
        KeySketch(1, 1, 1, 4, torch.device("cpu"))


def test_sixteen_bit_keys_are_sketched_in_int8_within_half_a_step_of_each_product():
    """A 16-bit model's sketch is INT8 codes with a scale per (token, KV head): half the bytes
    of a bfloat16 sketch, and each estimated logit within the codes' rounding of the bfloat16
    partial product (no offset term: symmetric codes)."""
    keys = keys_with_strong_pairs().to(torch.bfloat16)
    batch, heads, length, dim = keys.shape
    counted = torch.ones(batch, length, dtype=torch.bool)
    counted[:, :2] = False
    sketch = KeySketch(batch, heads, dim, 8, keys.device, key_dtype=torch.bfloat16)
    wide = KeySketch(batch, heads, dim, 8, keys.device, key_dtype=torch.float32)
    sketch.write(0, keys[:, :, :24], counted[:, :24])
    sketch.write(24, keys[:, :, 24:], None)
    wide.write(0, keys.float(), counted)
    assert sketch.keys.dtype == torch.int8 and wide.keys.dtype == SKETCH_DTYPE
    assert torch.equal(sketch.channels, wide.channels)  # the same channels, cheaper codes
    per_position = (sketch.keys.nbytes + sketch.scales.nbytes) / sketch.capacity
    assert per_position == batch * heads * (sketch.width + 4)
    assert per_position < wide.keys.nbytes / wide.capacity  # half of it at real head_dims

    query = torch.randn(batch, heads, 2, dim, dtype=torch.bfloat16)
    logits = sketch.logits(query)
    assert logits.dtype == SKETCH_DTYPE and not logits[..., length:].any()
    index = sketch.channels.unsqueeze(2)
    q = query.gather(-1, index.expand(-1, -1, 2, -1)).float()
    k = keys.gather(-1, index.expand(-1, -1, length, -1)).float()
    exact = q @ k.mT
    step = sketch.scales[..., :length].unsqueeze(2)  # (B, H, 1, L)
    rounding = q.abs().sum(-1, keepdim=True) * step / 2
    error = (logits[..., :length].float() - exact).abs()
    assert (error <= rounding + exact.abs() * 2**-7 + 1e-3).all()
    assert (error > 0).any()  # a test that could fail: codes, not the keys themselves


def test_int8_sketches_shift_reorder_and_join_batches_with_their_scales():
    keys = keys_with_strong_pairs(batch=2).to(torch.bfloat16)
    batch, heads, length, dim = keys.shape
    counted = torch.ones(batch, length, dtype=torch.bool)
    one = KeySketch(batch, heads, dim, length, keys.device, key_dtype=torch.bfloat16)
    one.write(0, keys, counted)
    query = torch.randn(batch, heads, 1, dim, dtype=torch.bfloat16)
    before = one.logits(query)[..., :length]
    one.shift(3)
    assert torch.equal(one.logits(query)[..., 3 : 3 + length], before)
    one.shift(-3)
    assert torch.equal(one.logits(query)[..., :length], before)
    one.select_batch(torch.tensor([1, 0]))
    assert torch.equal(one.logits(query.flip(0))[..., :length], before.flip(0))

    other = KeySketch(1, heads, dim, 4, keys.device, key_dtype=torch.float16)
    other.write(0, keys[:1, :, :10].half(), counted[:1, :10])
    one.extend_rows(other)
    assert one.keys.shape[0] == one.scales.shape[0] == 3
    assert one.scales.shape[-1] == one.capacity
    joined = one.logits(torch.cat([query.flip(0), query[:1]]))
    assert torch.equal(joined[2:, ..., :10], other.logits(query[:1])[..., :10])
    wide = KeySketch(1, heads, dim, 4, keys.device, key_dtype=torch.float32)
    wide.write(0, keys[:1, :, :10].float(), counted[:1, :10])
    with pytest.raises(ValueError, match="cannot share a batch"):
        one.extend_rows(wide)
