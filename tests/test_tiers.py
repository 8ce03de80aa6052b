"""Tiered KV (device budget, host pool, recompute): lossless, bounded, clear errors."""

import pytest
import torch
from conftest import hf_generate, padded_batch, tiny_gpt2, tiny_llama

from alisa import AlisaCache, AlisaConfig, generate
from alisa.sizes import parse_bytes

NEW = 24


def weights(model) -> int:
    return sum(p.nbytes for p in model.parameters())


def run(model, config=None, cache=None):
    ids, mask = padded_batch(lengths=(120, 100, 60))
    cache = cache if cache is not None else AlisaCache(model, config, max_new_tokens=NEW)
    out = hf_generate(model, ids, mask, cache, max_new_tokens=NEW, do_sample=False)
    return out, cache


@pytest.mark.parametrize("architecture", [tiny_llama, tiny_gpt2], ids=["llama-gqa", "gpt2-mha"])
@pytest.mark.parametrize(("policy", "ratio"), [("dense", 1.0), ("swa", 0.5), ("h2o", 0.3)])
@pytest.mark.parametrize("recompute", ["never", "always"])
def test_offload_and_recompute_change_no_greedy_token(architecture, policy, ratio, recompute):
    model = architecture()
    # Tiers are per layer: the resident reference selects per layer too.
    resident, _ = run(model, AlisaConfig(policy=policy, caching_ratio=ratio, per_head=False))
    # Room for the activations, one streamed layer (half the KV: 2 layers) and a quarter more:
    # the device tier then holds about half of what the policy keeps.
    config_ = model.config
    kv_token = (
        2
        * config_.num_hidden_layers
        * (getattr(config_, "num_key_value_heads", None) or config_.num_attention_heads)
        * 16
        * 4
    )
    kept = 3 * round((120 + NEW) * ratio)
    budget = weights(model) + 20_000 + int(kept * kv_token * 0.75)
    config = AlisaConfig(policy=policy, caching_ratio=ratio, gpu_memory=budget, recompute=recompute)
    tiered, cache = run(model, config)
    assert torch.equal(tiered, resident)
    tiers = cache.tier_bytes()
    overflow = tiers["recompute"] if recompute == "always" else tiers["host"]
    assert overflow > 0, tiers  # the budget really pushed KV out of the device tier
    assert weights(model) + tiers["device"] <= budget


def test_tokens_really_come_back_from_the_slower_tiers():
    model = tiny_gpt2()
    config = AlisaConfig(gpu_memory=weights(model) + 350_000, recompute="never")
    _, cache = run(model, config)
    assert cache.layers[0].store.fetched_bytes > 0
    config = AlisaConfig(gpu_memory=weights(model) + 350_000, recompute="always")
    _, cache = run(model, config)
    assert cache.layers[0].store.recomputed_tokens > 0


@pytest.mark.parametrize("recompute", ["never", "always"])
def test_a_slower_tier_reads_only_the_slots_below_the_frontier(recompute):
    """A host region copies, and a recompute region rebuilds, its slots below the slot map's
    width, not the spare ones its growth allocated (a fifth of a recompute region's work at
    B = 8 x 1,024); what attention reads is exact either way (the test above)."""
    model = tiny_gpt2()
    config = AlisaConfig(gpu_memory=weights(model) + 350_000, recompute=recompute)
    _, cache = run(model, config)
    layer = cache.layers[0]
    store, width = layer.store, layer.slots.width
    (_, device), (tier, slots) = store.regions
    used = width - device
    assert tier == ("host" if recompute == "never" else "recompute")
    assert 0 < used < slots  # the last region grew: spare slots past the frontier
    before = (store.fetched_bytes, store.recomputed_tokens)
    parts = layer.parts()
    assert [part.keys.shape[2] for part in parts] == [device, used]
    assert [part.positions.shape[-1] for part in parts] == [device, used]
    batch = parts[1].keys.shape[0]
    if recompute == "never":
        assert store.fetched_bytes - before[0] == parts[1].keys.nbytes + parts[1].values.nbytes
    else:
        assert store.recomputed_tokens - before[1] == batch * used


def test_host_copies_are_prefetched_a_layer_ahead():
    model = tiny_gpt2(n_layer=4)  # prefetching needs more than two layers
    resident, _ = run(model, AlisaConfig())
    tiered, cache = run(model, AlisaConfig(gpu_memory=weights(model) + 600_000, recompute="never"))
    assert torch.equal(tiered, resident)  # the patched prefetched copies are exact
    assert cache.tier_bytes()["host"] > 0
    assert sum(layer.store.prefetch_hits for layer in cache.layers) > 0


def test_alisa_generate_plans_with_the_real_generation_length(tokenizer):
    model = tiny_llama()
    prompts = ["a long prompt " * 10, "short"]
    free = generate(model, tokenizer, prompts, AlisaConfig(), max_new_tokens=8)
    tight = generate(
        model, tokenizer, prompts, AlisaConfig(gpu_memory=weights(model) + 90_000), max_new_tokens=8
    )
    assert tight.token_ids == free.token_ids


def test_a_budget_below_the_weights_is_refused_with_the_shortfall():
    model = tiny_llama()
    config = AlisaConfig(gpu_memory=weights(model) // 2)
    with pytest.raises(ValueError, match=r"short by \d+ bytes"):
        run(model, config)


@pytest.mark.parametrize("text", ["16GiB", "512MB", "1.5G", "100", "2 KiB"])
def test_sizes_parse(text):
    assert parse_bytes(text) > 0


@pytest.mark.parametrize("text", ["lots", "-5GB", "12 parsecs", ""])
def test_bad_sizes_are_rejected(text):
    with pytest.raises(ValueError, match="gpu_memory"):
        AlisaConfig(gpu_memory=text)


def test_per_head_selection_cannot_be_tiered():
    with pytest.raises(ValueError, match="per_head"):
        AlisaConfig(per_head=True, gpu_memory="1GiB")


def test_unknown_recompute_mode_is_rejected():
    with pytest.raises(ValueError, match="recompute='sometimes'"):
        AlisaConfig(recompute="sometimes")


def test_int8_storage_can_be_tiered_too():
    model = tiny_gpt2()
    resident, _ = run(model, AlisaConfig(kv_bits=8, residual_tokens=0))
    config = AlisaConfig(kv_bits=8, residual_tokens=0, gpu_memory=weights(model) + 130_000)
    tiered, cache = run(model, config)
    assert torch.equal(tiered, resident)  # the host tier keeps the same INT8 codes
    assert cache.tier_bytes()["host"] > 0


def test_a_rebuild_measurably_slower_gives_its_real_rate_even_above_the_micro_benchmark():
    """The bfloat16 cost model's recompute row missed by 43 %: the rate was capped at the
    micro-benchmark's, which the real steps beat. A measurable rebuild now gives its own rate;
    one within the resident step's noise keeps the micro-benchmark, labelled a fallback."""
    from alisa.calibration.steps import TIERED, rebuild_rate

    resident = [1.00, 1.01, 1.02, 1.01, 1.00]  # spread 0.02 s
    rebuilt = [1.50, 1.51, 1.52, 1.51, 1.50]  # 0.5 s more, 0.1 s of it reading
    rate = rebuild_rate(4e9, rebuilt, resident, read=0.1, ceiling=1e9)
    assert rate.source == TIERED and rate.median == pytest.approx(4e9 / 0.4)  # above 1e9
    within = rebuild_rate(4e9, [1.11, 1.12, 1.13], resident, read=0.1, ceiling=1e9)
    assert within.median == 1e9 and within.source.startswith("micro-benchmark (fallback")
    slower = rebuild_rate(4e9, rebuilt, resident, read=0.1, ceiling=1e11)  # under the ceiling
    assert slower.source == TIERED and slower.median == pytest.approx(1e10)


def test_calibration_splits_half_the_kv_off_device_and_only_lowers_the_read_rate():
    from alisa.calibration.steps import calibrate_tiers, decode_step, half_offload_budget
    from alisa.model.adapter import model_shape
    from alisa.planning.spec import model_spec

    model = tiny_llama()
    spec = model_spec(model, model_shape(model))
    budget = half_offload_budget(spec, 4, 256 + 16)
    device = torch.device("cpu")
    _, cache = decode_step(model, device, 4, 256, AlisaConfig(gpu_memory=budget, recompute="never"))
    tiers = cache.tier_tokens()
    assert sum(tiers.values()) == cache.stored_tokens()
    assert tiers["recompute"] == 0
    assert 0.3 < tiers["host"] / cache.stored_tokens() < 0.7
    reads, rebuilds = calibrate_tiers(model, device, 1e15, 1e18, batch=4, context=256)
    h2d, rebuild = reads.median, rebuilds.median
    assert 0 < h2d <= 1e15 and 0 < rebuild <= 1e18  # a measured read only lowers the input
    # A real host read is not free; on a busy machine the tiered step can time no slower than
    # the resident one, and the micro-benchmark is then kept and labelled so (never silent).
    assert h2d < 1e15 or reads.source.startswith("micro-benchmark (fallback")
