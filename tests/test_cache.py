"""The ALISA cache inside HF generate: exactness (the brand), real eviction, batches."""

from functools import partial

import conftest
import numpy as np
import pytest
import torch
from conftest import padded_batch, tiny_gpt2, tiny_llama
from transformers import DynamicCache

from alisa import AlisaCache, AlisaConfig
from alisa.policies import POLICIES

NEW_TOKENS = 24
hf_generate = partial(conftest.hf_generate, max_new_tokens=NEW_TOKENS)


def _exact_configs():
    for name in sorted(POLICIES):
        yield pytest.param(AlisaConfig(policy=name, caching_ratio=1.0), id=f"{name}-r1")
        if name != "dense":
            yield pytest.param(
                AlisaConfig(policy=name, budget_tokens=10_000),
                id=f"{name}-unreachable-budget",
            )
    yield pytest.param(
        AlisaConfig(policy="swa", caching_ratio=1.0, per_head=True), id="swa-per-head"
    )
    yield pytest.param(
        AlisaConfig(policy="h2o", caching_ratio=1.0, layer_schedule="pyramid", dense_layers=1),
        id="h2o-pyramid",
    )


@pytest.mark.parametrize("config", list(_exact_configs()))
def test_greedy_is_token_identical_to_dynamic_cache(tiny_model, config):
    ids, mask = padded_batch()
    reference = hf_generate(tiny_model, ids, mask, do_sample=False)
    ours = hf_generate(tiny_model, ids, mask, AlisaCache(tiny_model, config), do_sample=False)
    assert torch.equal(ours, reference)


@pytest.mark.parametrize("policy", ["dense", "swa", "h2o"])
def test_sampling_is_identical_under_a_fixed_seed(tiny_model, policy):
    ids, mask = padded_batch()
    options = dict(do_sample=True, top_k=40, temperature=0.9)
    torch.manual_seed(11)
    reference = hf_generate(tiny_model, ids, mask, DynamicCache(), **options)
    torch.manual_seed(11)
    cache = AlisaCache(tiny_model, AlisaConfig(policy=policy, caching_ratio=1.0))
    assert torch.equal(hf_generate(tiny_model, ids, mask, cache, **options), reference)


def test_dense_cache_reports_exact_bytes_and_positions():
    model = tiny_llama()
    ids, mask = padded_batch(lengths=(30, 30))
    cache = AlisaCache(model, AlisaConfig())
    hf_generate(model, ids, mask, cache)
    layer = cache.layers[0]
    assert layer.get_seq_length() == 30 + NEW_TOKENS - 1
    assert cache.stored_tokens() == 2 * 2 * (30 + NEW_TOKENS - 1)  # layers x sequences x tokens
    expected = sum(layer.store.keys.nbytes + layer.store.values.nbytes for layer in cache.layers)
    assert cache.kv_bytes() == expected
    positions = layer.slot_positions()[0, 0]
    assert positions[: layer.slots.width].tolist() == list(range(30 + NEW_TOKENS - 1))
    assert (positions[layer.slots.width :] < 0).all()


@pytest.mark.parametrize("policy", sorted(set(POLICIES) - {"dense"}))
@pytest.mark.parametrize("architecture", [tiny_llama, tiny_gpt2])
def test_budget_is_respected_per_sequence_every_step(policy, architecture):
    model = architecture()
    ids, mask = padded_batch(lengths=(400, 300, 180))  # the last one's budget is the floor
    config = AlisaConfig(policy=policy, caching_ratio=0.25, sink_tokens=4)
    cache = AlisaCache(model, config)
    seen_real = mask.sum(1).numpy()
    with torch.no_grad():
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache)
        for step in range(12):
            check_budget(cache, seen_real + step)
            mask = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1)
            positions = positions[:, -1:] + 1
            model(
                input_ids=torch.full((3, 1), 7),
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
            )


def check_budget(cache, seen_real):
    for layer in cache.layers:
        budget = np.maximum(np.rint(seen_real * 0.25).astype(int), 64)  # the default floor
        assert (layer.slots.kept == budget).all()
        stored = (layer.slot_positions() >= 0).sum(-1)  # (B, Hs)
        assert torch.equal(stored, torch.as_tensor(budget).view(-1, 1).expand_as(stored))


def test_eviction_frees_memory_for_real():
    model = tiny_llama()
    ids, mask = padded_batch(lengths=(400, 400))
    dense, sparse = (
        AlisaCache(model, AlisaConfig()),
        AlisaCache(model, AlisaConfig(policy="swa", caching_ratio=0.2)),
    )
    hf_generate(model, ids, mask, dense)
    hf_generate(model, ids, mask, sparse)
    # The sparse buffers shrank: kept tokens plus bounded headroom, not masked full-length buffers.
    assert sparse.kv_bytes() < 0.35 * dense.kv_bytes()
    layer = sparse.layers[-1]
    assert layer.store.capacity <= int(layer.slots.kept.max()) + 2 * 32
    assert sparse.evicted_tokens() > 0


def test_decode_steps_write_in_place_without_copying_the_cache():
    model = tiny_llama()
    ids, mask = padded_batch(lengths=(300,))
    cache = AlisaCache(model, AlisaConfig(policy="swa", caching_ratio=0.3))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
        buffer = cache.layers[0].store.keys.data_ptr()
        for _ in range(20):
            model(input_ids=torch.tensor([[9]]), past_key_values=cache)
    # Tokens went into slots freed by evictions: the same buffer throughout.
    assert cache.layers[0].store.keys.data_ptr() == buffer
    assert cache.layers[0].get_seq_length() == 320


@pytest.mark.parametrize("per_head", [False, True])
def test_kept_tokens_keep_their_original_positions_and_keys(per_head):
    model = tiny_llama()
    ids, mask = padded_batch(lengths=(240,))
    config = AlisaConfig(policy="h2o", caching_ratio=0.3, per_head=per_head)
    sparse = AlisaCache(model, config)
    dense = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=sparse)
        model(input_ids=ids, attention_mask=mask, past_key_values=dense)
    layer = sparse.layers[1]
    keys = layer.store.read()[0][0]  # (H_kv, capacity, D)
    reference = dense.layers[1].keys[0]  # (H_kv, 240, D)
    for head in range(keys.shape[0]):
        positions = layer.slot_positions()[0, head if per_head else 0]
        kept = positions >= 0
        assert int(kept.sum()) == 72  # round(240 * 0.3), above the floor
        assert torch.equal(keys[head, kept], reference[head, positions[kept]])


@pytest.mark.parametrize("policy", ["swa", "h2o", "tova"])
def test_every_kv_head_keeps_its_budget_sinks_and_newest_tokens(policy):
    # Per-head eviction must evict from every KV head: each head holds exactly the budget,
    # with its sinks and its protected newest tokens (a head that stopped evicting would keep
    # the oldest tokens after compaction, or overwrite its sink).
    model = tiny_llama()
    ids, mask = padded_batch(lengths=(300,))
    config = AlisaConfig(policy=policy, caching_ratio=0.2, per_head=True, sink_tokens=2)
    cache = AlisaCache(model, config)
    hf_generate(model, ids, mask, cache)
    seen = 300 + NEW_TOKENS - 1
    for layer in cache.layers:
        budget = int(layer.keeper.policy.budget(np.array([seen]))[0])
        recent = int(layer.keeper.policy.recent(np.array([budget]))[0])
        for positions in layer.slot_positions()[0]:  # (H_kv, width): one KV head each
            held = set(positions[positions >= 0].tolist())
            assert len(held) == budget
            assert {0, 1} | set(range(seen - max(recent, 1), seen)) <= held


def test_per_head_selection_differs_between_heads():
    model = tiny_llama()
    ids, mask = padded_batch(lengths=(200,))
    cache = AlisaCache(model, AlisaConfig(policy="tova", caching_ratio=0.2, per_head=True))
    hf_generate(model, ids, mask, cache)
    positions = cache.layers[0].slot_positions()[0]  # (H_kv, width)
    sets = [set(p[p >= 0].tolist()) for p in positions]
    assert len(sets) == 2 and sets[0] != sets[1]
    assert len(sets[0]) == len(sets[1])


def test_dense_layers_keep_everything():
    model = tiny_llama()
    ids, mask = padded_batch(lengths=(100,))
    config = AlisaConfig(policy="swa", caching_ratio=0.2, dense_layers=1, min_budget_tokens=0)
    cache = AlisaCache(model, config)
    hf_generate(model, ids, mask, cache)
    assert cache.layers[0].slots.kept[0] == 100 + NEW_TOKENS - 1
    assert cache.layers[1].slots.kept[0] == round((100 + NEW_TOKENS - 1) * 0.2)


def test_unsupported_architecture_is_named():
    from transformers import BloomConfig, BloomForCausalLM

    model = BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match="BloomForCausalLM .* computes attention inline"):
        AlisaCache(model, AlisaConfig(policy="swa", caching_ratio=0.5))


def test_model_without_attention_modules_is_rejected():
    class NotAModel(torch.nn.Module):
        config = None

    with pytest.raises(ValueError, match="no HF config"):
        AlisaCache(NotAModel())


def test_other_caches_still_work_after_attaching():
    model = tiny_llama()
    ids, mask = padded_batch()
    before = hf_generate(model, ids, mask)
    AlisaCache(model, AlisaConfig(policy="swa", caching_ratio=0.5))
    assert model.config._attn_implementation == "alisa"
    assert torch.equal(hf_generate(model, ids, mask, DynamicCache()), before)


def test_switching_the_model_to_eager_is_refused():
    model = tiny_llama()
    ids, mask = padded_batch()
    cache = AlisaCache(model, AlisaConfig(policy="swa", caching_ratio=0.5))
    model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="attn_implementation='eager' is incompatible"):
        hf_generate(model, ids, mask, cache)


def test_padding_slots_are_reclaimed_by_compaction():
    model = tiny_llama()
    ids, mask = padded_batch(lengths=(400, 60))
    cache = AlisaCache(model, AlisaConfig(policy="swa", caching_ratio=0.2))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    layer = cache.layers[0]
    assert layer.store.capacity <= int(layer.slots.kept.max()) + 32
    assert (layer.slots.dead == 0).all()
