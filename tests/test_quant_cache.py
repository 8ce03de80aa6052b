"""INT8/INT4 storage inside the ALISA cache: exact bytes, no re-quantization, the residual ring."""

from pathlib import Path

import pytest
import torch
from conftest import padded_batch, tiny_gpt2, tiny_llama
from transformers import DynamicCache

from alisa import AlisaCache, AlisaConfig, generate
from alisa.storage.quantized import QuantizedStore

NEW = 12
PROSE = Path(__file__).parent / "fixtures" / "prose.txt"  # natural text, no ../shared


def prefill_and_decode(model, cache, ids, mask, steps=NEW):
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    logits = []
    with torch.no_grad():
        out = model(
            input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache
        )
        logits.append(out.logits[:, -1])
        for step in range(steps):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            positions = positions[:, -1:] + 1
            token = torch.full((ids.shape[0], 1), 11 + step)
            out = model(
                input_ids=token, attention_mask=mask, position_ids=positions, past_key_values=cache
            )
            logits.append(out.logits[:, -1])
    return torch.stack(logits)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("residual", [0, 8])
def test_kv_bytes_are_counted_exactly(bits, residual):
    model = tiny_llama()  # 2 layers, 2 KV heads, head_dim 16
    ids, mask = padded_batch(lengths=(50, 50))
    cache = AlisaCache(
        model, AlisaConfig(kv_bits=bits, quant_group_size=8, residual_tokens=residual)
    )
    prefill_and_decode(model, cache, ids, mask)
    store = cache.layers[0].store
    slots, batch, heads, head_dim = store.capacity, 2, 2, 16
    codes = batch * heads * slots * head_dim * bits // 8
    scales = batch * heads * slots * (head_dim // 8) * 2 * 2  # fp16 scale + zero point
    ring = batch * heads * residual * head_dim * 4  # float32 model
    assert cache.layers[0].kv_bytes() == 2 * (codes + scales) + 2 * ring
    assert cache.kv_bytes() == sum(layer.kv_bytes() for layer in cache.layers)


def test_int8_halves_and_int4_quarters_the_bytes_per_token():
    model = tiny_llama(hidden_size=128, num_attention_heads=4, num_key_value_heads=2)  # D = 32
    ids, mask = padded_batch(lengths=(300,))
    sizes = {}
    for bits in (16, 8, 4):
        cache = AlisaCache(model, AlisaConfig(kv_bits=bits, residual_tokens=0))
        prefill_and_decode(model, cache, ids, mask, steps=2)
        sizes[bits] = cache.kv_bytes()
    # float32 model: 4 bytes/value -> 1 (+4/32 scale and zero) and 0.5 (+4/32).
    assert sizes[8] / sizes[16] == pytest.approx((1 + 4 / 32) / 4)
    assert sizes[4] / sizes[16] == pytest.approx((0.5 + 4 / 32) / 4)


@pytest.mark.parametrize("architecture", [tiny_llama, tiny_gpt2])
def test_int8_logits_stay_close_to_dense(architecture):
    model = architecture()
    ids, mask = padded_batch()
    dense = prefill_and_decode(model, DynamicCache(), ids, mask)
    int8 = prefill_and_decode(
        model, AlisaCache(model, AlisaConfig(kv_bits=8, residual_tokens=0)), ids, mask
    )
    int4 = prefill_and_decode(
        model, AlisaCache(model, AlisaConfig(kv_bits=4, residual_tokens=0)), ids, mask
    )
    error8 = (int8 - dense).abs().max()
    error4 = (int4 - dense).abs().max()
    assert error8 < 0.02
    assert error8 < error4


def test_stored_codes_are_never_requantized():
    model = tiny_llama()
    ids, mask = padded_batch(lengths=(60,))
    cache = AlisaCache(model, AlisaConfig(kv_bits=8, residual_tokens=0))
    prefill_and_decode(model, cache, ids, mask, steps=3)
    store = cache.layers[1].store
    before = store.codes.data[:, :, :, :63].clone(), store.codes.scale[:, :, :, :63].clone()
    with torch.no_grad():
        for _ in range(5):
            model(input_ids=torch.tensor([[5]]), past_key_values=cache)
    assert torch.equal(store.codes.data[:, :, :, :63], before[0])
    assert torch.equal(store.codes.scale[:, :, :, :63], before[1])


def test_residual_window_is_full_precision_and_survives_evictions():
    model = tiny_llama()
    ids, mask = padded_batch(lengths=(120,))
    # TOVA protects no recent tokens, so tokens of the residual window get evicted and their
    # slots reused: the ring must never write a stale full-precision token over a new one.
    cache = AlisaCache(
        model, AlisaConfig(policy="tova", caching_ratio=0.3, kv_bits=4, residual_tokens=6)
    )
    reference = DynamicCache()
    prefill_and_decode(model, cache, ids, mask, steps=20)
    prefill_and_decode(model, reference, ids, mask, steps=20)
    layer = cache.layers[0]
    keys, _ = layer.store.read(layer.slots.positions)
    positions = layer.slots.positions[0, 0]
    full = reference.layers[0].keys[0]
    seen = layer.slots.seen
    scale_bound = layer.store.codes.scale.float().abs().max() / 2 + 1e-6
    for slot, position in enumerate(positions.tolist()):
        if position < 0:
            continue
        error = (keys[0, :, slot] - full[:, position]).abs().max()
        if position >= seen - 6:
            assert error == 0  # in the full-precision window
        else:
            assert error <= scale_bound


@pytest.mark.parametrize("groups", [1, 3])
def test_ring_entries_replace_exactly_the_slots_that_still_hold_their_tokens(groups):
    """read() against a per-entry loop: a live ring entry's full-precision token replaces its
    slot's codes; a stale one (its slot since given to another token, possibly a newer entry
    of the ring) changes nothing."""
    torch.manual_seed(0)
    batch, heads, capacity, dim, ring = 2, 3, 9, 8, 4
    keys, values = torch.randn(2, batch, heads, 5, dim)
    store = QuantizedStore(
        keys, values, capacity, bits=8, group_size=None, residual_tokens=ring, groups=groups
    )
    positions = torch.full((batch, groups, capacity), -1)
    positions[..., :5] = torch.arange(5)
    for position in range(5, 14):
        # few slots: entries of the ring share slots, the older of them stale
        slots = torch.randint(3, 6, (batch, groups, 1))
        store.write_slots(slots, *torch.randn(2, batch, heads, 1, dim), position)
        positions.scatter_(-1, slots, position)
    positions[0, 0, 4] = -1  # a slot freed: its entry (if any) is stale
    got_keys, got_values = store.read(positions)
    want_keys, want_values = (t.clone() for t in store.codes.dequantized())
    stale = 0
    for b in range(batch):
        for h in range(heads):
            g = h if groups > 1 else 0
            for entry in range(ring):
                slot = int(store.ring_slots[b, g, entry])
                if slot >= 0 and positions[b, g, slot] == store.ring_positions[entry]:
                    want_keys[b, h, slot] = store.ring_keys[b, h, entry]
                    want_values[b, h, slot] = store.ring_values[b, h, entry]
                else:
                    stale += 1
    assert stale > 0  # the case that needs care was exercised
    assert torch.equal(got_keys, want_keys) and torch.equal(got_values, want_values)
    assert got_keys.shape == (batch, heads, capacity, dim)


def test_compaction_keeps_the_ring_pointing_at_its_tokens():
    model = tiny_llama()
    ids, mask = padded_batch(lengths=(200,))
    cache = AlisaCache(
        model, AlisaConfig(policy="swa", caching_ratio=0.2, kv_bits=8, residual_tokens=8)
    )
    prefill_and_decode(model, cache, ids, mask, steps=4)
    layer = cache.layers[0]
    store: QuantizedStore = layer.store
    assert store.capacity < 200  # compacted after the prefill eviction
    live = store.ring_slots[0, 0]
    held = layer.slots.positions[0, 0, live]
    assert torch.equal(held, store.ring_positions)


def test_swa_with_int8_generates_within_its_budget(tokenizer):
    model = tiny_llama()
    prompts = ["a fairly long prompt " * 12, "short one"]
    result = generate(
        model,
        tokenizer,
        prompts,
        AlisaConfig(policy="swa", caching_ratio=0.3, kv_bits=8),
        max_new_tokens=8,
    )
    assert all(len(ids) >= 1 for ids in result.token_ids)


@pytest.mark.parametrize(
    ("options", "needle"),
    [({"kv_bits": 3}, "kv_bits=3"), ({"kv_bits": 8, "quant_group_size": 5}, "quant_group_size=5")],
)
def test_bad_quantization_options_are_rejected(options, needle):
    with pytest.raises(ValueError, match=needle):
        AlisaCache(tiny_llama(), AlisaConfig(**options))


@pytest.mark.slow
def test_smollm2_int8_greedy_matches_dense_for_32_tokens(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer(PROSE.read_text(encoding="utf-8"))["input_ids"]
    assert len(ids) >= 600
    prompt = tokenizer.decode(ids[100:600])  # a fixed 500-token window of ordinary prose
    dense = generate(model, tokenizer, prompt, AlisaConfig(), max_new_tokens=32)
    int8 = generate(model, tokenizer, prompt, AlisaConfig(kv_bits=8), max_new_tokens=32)
    assert int8.token_ids[0][:32] == dense.token_ids[0][:32]
    assert int8.kv_bytes < 0.6 * dense.kv_bytes
