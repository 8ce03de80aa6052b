"""The key sketch of retention="host": the strongest RoPE channel pairs of every key."""

import numba
import numpy as np
import pytest
import torch

from alisa.kv.ranking import PRODUCTS, SKETCH_DTYPE, KeySketch
from alisa.ops.cpu import BLOCK, kernel_parts, shares_torch_threads

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


def sequential_scores(sketch: KeySketch, query: torch.Tensor) -> torch.Tensor:
    """The compiled product's arithmetic written out: float32 products of the bfloat16
    operands summed channel by channel in order, times the INT8 scales, rounded to bfloat16."""
    index = sketch.channels.unsqueeze(2).expand(*query.shape[:3], -1)
    q = query.gather(-1, index).to(SKETCH_DTYPE).float().numpy()  # (B, H, G, W)
    k = sketch.keys.float().numpy()  # (B, H, W, C)
    total = np.zeros((*q.shape[:3], k.shape[-1]), dtype=np.float32)
    for channel in range(k.shape[2]):
        total = total + q[..., channel, None] * k[:, :, None, channel, :]
    if sketch.scales is not None:
        total = total * sketch.scales.numpy()[:, :, None, :]
    return torch.from_numpy(total).to(SKETCH_DTYPE)


@pytest.mark.parametrize("key_dtype", [torch.float32, torch.bfloat16])
def test_every_product_gives_the_exact_scores_rounded_and_the_compiled_one_bit_for_bit(key_dtype):
    """The three products multiply the same bfloat16 operands, so each score is the exact
    product rounded to bfloat16 (up to the order of the sum); the compiled kernel's order is
    fixed (channel by channel), so it gives exactly :func:`sequential_scores`, unwritten
    positions included (they score 0)."""
    keys = keys_with_strong_pairs(length=300, dim=64).to(key_dtype)
    batch, heads, length, dim = keys.shape
    counted = torch.ones(batch, length, dtype=torch.bool)
    query = torch.randn(batch, heads, 3, dim, dtype=key_dtype)
    query[0, 0, 0, 5] = float("nan")  # NaN stays NaN (the kernel rounds by its bits)
    scores = {}
    for product in PRODUCTS:
        sketch = KeySketch(batch, heads, dim, 8, keys.device, key_dtype=key_dtype, product=product)
        sketch.write(0, keys, counted)
        scores[product] = sketch.logits(query)
        assert scores[product].dtype == SKETCH_DTYPE
        # ``upto``: the compiled kernel scores only the positions a caller reads (the same
        # bits), the library products every allocated one.
        upto = sketch.logits(query, upto=length - 7)
        width = length - 7 if product == "compiled" else sketch.capacity
        assert upto.shape == (*query.shape[:3], width)
        assert torch.equal(upto.view(torch.int16), scores[product][..., :width].view(torch.int16))
        assert sketch.logits(query, upto=10**6).shape[-1] == sketch.capacity
    assert sketch.capacity > length  # headroom: positions never written
    compiled = scores["compiled"]
    reference = sequential_scores(sketch, query)
    nan = compiled.isnan()
    assert torch.equal(nan, reference.isnan())
    assert nan[0, 0, 0].all() and nan.sum() == sketch.capacity  # one query row, all positions
    assert (compiled.view(torch.int16)[nan] == -1).all()  # the all-ones NaN: ranks lowest
    assert torch.equal(compiled.view(torch.int16)[~nan], reference.view(torch.int16)[~nan])
    assert not compiled[..., length:].nan_to_num().any()
    index = sketch.channels.unsqueeze(2)
    q = query.gather(-1, index.expand(-1, -1, 3, -1)).to(SKETCH_DTYPE).double()
    k = sketch.keys[..., :length].double()
    exact = q @ k
    if sketch.scales is not None:
        exact = exact * sketch.scales[:, :, :length].unsqueeze(2).double()
    for product, logits in scores.items():
        torch.testing.assert_close(
            logits[..., :length].float(),
            exact.to(SKETCH_DTYPE).float(),
            rtol=8e-3 if product != "bfloat16" else 2e-2,
            atol=1e-6 if product != "bfloat16" else 1e-2,
            equal_nan=True,
            msg=product,
        )


@pytest.mark.parametrize(
    ("groups", "dim", "length"),
    # The kernel adds one to three query heads a pass and four channels a pass, a block of
    # positions at a time: head counts 1-7, a width that is not a multiple of four (dim 12:
    # 6 channels), and a row longer than a block.
    [(3, 64, 200), (1, 12, 200), (2, 64, 200), (4, 64, BLOCK + 100), (5, 12, 200), (7, 64, 300)],
)
def test_the_compiled_products_sum_runs_channel_by_channel_in_order(groups, dim, length):
    """Scores where the order of the sum shows in bfloat16: the first and last channels'
    products are large and cancel exactly, so what is left is the small products' sum plus the
    float32 rounding of every partial sum on the way (which depends on the order). The
    kernel's scores are exactly the in-order sum's, and the same sum run backwards (the check
    could fail) differs."""
    torch.manual_seed(1)
    batch, heads = 2, 3
    sketch = KeySketch(batch, heads, dim, length, torch.device("cpu"), product="compiled")
    sketch.write(0, torch.randn(batch, heads, length, dim), torch.ones(batch, length, dtype=bool))
    width = sketch.width
    sketch.channels = torch.arange(width).expand(batch, heads, width)
    keys = torch.randn(batch, heads, width, sketch.capacity) / 4
    keys[:, :, 0] = 2.0**12 * (1 + torch.randint(0, 128, (batch, heads, sketch.capacity)) / 128)
    keys[:, :, -1] = -keys[:, :, 0]
    sketch.keys = keys.to(SKETCH_DTYPE)
    query = torch.randn(batch, heads, groups, dim)
    query[..., 0] = query[..., width - 1] = 2.0**8
    compiled = sketch.logits(query).view(torch.int16)
    assert torch.equal(compiled, sequential_scores(sketch, query).view(torch.int16))
    backwards = KeySketch(batch, heads, dim, length, torch.device("cpu"), product="compiled")
    backwards.channels = sketch.channels.flip(-1)
    backwards.keys = sketch.keys.flip(2)
    assert not torch.equal(compiled, sequential_scores(backwards, query).view(torch.int16))


@pytest.mark.parametrize("parts", [1, 2, 5])
def test_the_compiled_products_rows_split_into_parts_give_the_same_scores(parts):
    """Rows split into parts run in parallel (:func:`alisa.ops.cpu.kernel_parts`), whatever
    this machine's threads: the scores do not depend on it (5 rows, so parts are uneven)."""
    keys = keys_with_strong_pairs(batch=5, heads=1, length=90)
    sketch = KeySketch(5, 1, 16, 8, keys.device, product="compiled")
    sketch.write(0, keys, torch.ones(5, 90, dtype=torch.bool))
    query = torch.randn(5, 1, 3, 16)
    scores = sketch.logits(query, parts=parts)
    assert torch.equal(scores.view(torch.int16), sequential_scores(sketch, query).view(torch.int16))


def test_kernel_parts_follow_torchs_threads_and_the_rows():
    threads = torch.get_num_threads()
    assert kernel_parts(1) == 1 and 1 <= kernel_parts(64) <= threads
    if shares_torch_threads():  # numba's omp layer: the split uses torch's threads
        assert kernel_parts(64) == min(threads, numba.get_num_threads())
    try:
        torch.set_num_threads(1)
        assert kernel_parts(64) == 1
    finally:
        torch.set_num_threads(threads)


def test_a_callers_own_part_count_is_kept_up_to_the_rows():
    """A count asked for (a test splits rows into more parts than this machine has threads) is
    kept, capped by the rows, whatever torch's threads; numba's thread count is not touched."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        team = numba.get_num_threads()
        assert [kernel_parts(rows, 3) for rows in (0, 1, 2, 3, 64)] == [1, 1, 2, 3, 3]
        assert numba.get_num_threads() == team
    finally:
        torch.set_num_threads(threads)


def test_numbas_next_parallel_loop_runs_as_many_threads_as_there_are_parts():
    """A team larger than the parts wakes threads with nothing to do: numba's count follows the
    parts, down and back up, and torch's own count is left as it was."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert kernel_parts(64) == 1 and numba.get_num_threads() == 1
        assert torch.get_num_threads() == 1
        torch.set_num_threads(threads)
        parts = kernel_parts(64)
        assert numba.get_num_threads() == parts and torch.get_num_threads() == threads
        assert kernel_parts(1) == 1 and numba.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


def test_the_compiled_product_needs_a_cpu_and_a_known_name():
    with pytest.raises(ValueError, match="product='int8'"):
        KeySketch(1, 1, 8, 4, torch.device("cpu"), product="int8")
    with pytest.raises(ValueError, match="runs on a CPU; the sketch is on meta"):
        KeySketch(1, 1, 8, 4, torch.device("meta"), product="compiled")


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
