"""The keeper protocol: a third keeper, written here, runs in the cache untouched."""

import numpy as np
import torch
from conftest import hf_generate, padded_batch, tiny_llama

from alisa import AlisaCache, AlisaConfig
from alisa.kv.layer import Keeper
from alisa.ops.reference import top_k, with_protections


class NewestKeeper(Keeper):
    """Keeps each sequence's newest ``k`` tokens and deletes the rest (no scores, no policy)."""

    def __init__(self, policy, k: int) -> None:
        super().__init__(policy)
        self.k = k

    @property
    def frees_slots(self) -> bool:
        return True

    def after_attention(self, slots, store, query, probabilities, *, prefilling) -> None:
        excess = np.maximum(slots.kept - self.k, 0)
        if excess.max() == 0:
            return
        positions = slots.positions  # (B, 1, S); empty and padding slots are negative
        oldest = with_protections(positions.to(torch.float32), positions < 0)
        victims, taken = top_k(oldest, excess, largest=False)
        slots.free(victims, taken, excess)
        self.evicted += int(excess.sum())


def newest(k: int):
    return lambda config, policy: NewestKeeper(policy, k)


def test_a_keeper_that_never_reaches_its_budget_is_exact():
    model = tiny_llama()
    ids, mask = padded_batch()
    reference = hf_generate(model, ids, mask, max_new_tokens=12)
    cache = AlisaCache(model, AlisaConfig(), keeper=newest(10_000))
    assert torch.equal(hf_generate(model, ids, mask, cache, max_new_tokens=12), reference)
    assert cache.evicted_tokens() == 0


def test_a_third_keeper_holds_its_newest_tokens_and_decodes_as_the_local_window():
    """Keeping the newest 8 tokens is the ``local`` policy with an 8-token budget: same tokens
    generated, and each layer holds exactly the 8 newest positions of every sequence."""
    model = tiny_llama()
    ids, mask = padded_batch()
    cache = AlisaCache(model, AlisaConfig(), keeper=newest(8))
    ours = hf_generate(model, ids, mask, cache, max_new_tokens=12)
    local = AlisaConfig(policy="local", budget_tokens=8, preset="paper")
    assert torch.equal(
        ours, hf_generate(model, ids, mask, AlisaCache(model, local), max_new_tokens=12)
    )
    for layer in cache.layers:
        seen = layer.slots.seen
        for row in range(ids.shape[0]):
            held = layer.slots.positions[row, 0]
            assert sorted(held[held >= 0].tolist()) == list(range(seen - 8, seen))
    assert cache.evicted_tokens() > 0
