"""Recall: evicted tokens wait in an INT8 pool and can swap back; nothing is lost or duplicated."""

import numpy as np
import pytest
import torch
from conftest import PAD, padded_batch, tiny_llama

from alisa import AlisaCache, AlisaConfig


def decode(model, cache, steps=20):
    ids, mask = padded_batch(lengths=(120, 100, 60))
    model.generation_config.eos_token_id = None
    model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=steps,
        do_sample=False,
        pad_token_id=PAD,
        past_key_values=cache,
    )
    return mask


def test_every_token_is_either_kept_or_in_the_pool_exactly_once():
    model = tiny_llama()
    cache = AlisaCache(model, AlisaConfig(policy="swa", caching_ratio=0.2, recall_every=1))
    decode(model, cache)
    for layer in cache.layers:
        pool = layer.extensions[0].pool.positions
        for row in range(3):
            kept = layer.slots.positions[row, 0][layer.slots.positions[row, 0] >= 0].tolist()
            pooled = pool[row][pool[row] >= 0].tolist()
            everything = sorted(kept + pooled)
            first = int(layer.slots.first[row])
            assert everything == list(range(first, layer.slots.seen))
        budget = np.maximum(np.rint((layer.slots.seen - layer.slots.first) * 0.2), 1)
        assert (layer.slots.kept == budget).all()


def test_recall_swaps_tokens_back_in():
    model = tiny_llama()
    config = AlisaConfig(policy="swa", caching_ratio=0.2, recall_every=1, recall_tokens=16)
    cache = AlisaCache(model, config)
    decode(model, cache)
    assert sum(layer.extensions[0].recalled for layer in cache.layers) > 0
    for layer in cache.layers:
        keys, _ = layer.store.read(layer.slots.positions)
        assert torch.isfinite(keys).all()


@pytest.mark.parametrize("options", [{"per_head": True}, {"gpu_memory": "1GiB"}])
def test_recall_needs_per_layer_untiered_caches(options):
    with pytest.raises(ValueError, match="recall_every"):
        AlisaConfig(policy="swa", caching_ratio=0.2, recall_every=4, **options)
