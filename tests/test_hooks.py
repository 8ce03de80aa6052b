"""Attaching is undone: a model used with an AlisaCache and then without gives HF's outputs."""

import pytest
import torch
from conftest import hf_generate, padded_batch, tiny_gpt2, tiny_llama

from alisa import AlisaCache, AlisaConfig, attached, generate
from alisa.kv.attention import detach

NEW = 12


def plain_generate(model, cache=None):
    return hf_generate(model, *padded_batch(), cache, max_new_tokens=NEW, do_sample=False)


def no_hooks(model) -> bool:
    return all(not module._forward_pre_hooks for module in model.modules())


@pytest.mark.parametrize("architecture", [tiny_llama, tiny_gpt2], ids=["llama-gqa", "gpt2-mha"])
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_a_model_used_with_an_alisa_cache_then_without_gives_hf_outputs(
    architecture, implementation
):
    never = architecture(attn_implementation=implementation)
    reference = plain_generate(never)
    model = architecture(attn_implementation=implementation)
    cache = AlisaCache(model, AlisaConfig(policy="swa", caching_ratio=0.5))
    plain_generate(model, cache)
    assert torch.equal(plain_generate(model), reference)
    assert model.config._attn_implementation == implementation
    # A new cache on the same model routes attention through alisa again.
    dense = plain_generate(model, AlisaCache(model, AlisaConfig()))
    assert torch.equal(dense, reference)


def test_attached_restores_the_model_exactly():
    model = tiny_llama(attn_implementation="eager")
    with attached(model):
        assert model.config._attn_implementation == "alisa"
        AlisaCache(model, AlisaConfig())  # attaching again inside the block is harmless
    assert model.config._attn_implementation == "eager"
    assert no_hooks(model)


def test_detach_restores_the_previous_implementation():
    model = tiny_gpt2()
    AlisaCache(model, AlisaConfig())
    detach(model)
    assert model.config._attn_implementation == "sdpa"
    assert no_hooks(model)


def test_alisa_generate_leaves_the_model_as_it_found_it(tokenizer):
    model = tiny_llama(attn_implementation="eager")
    generate(model, tokenizer, ["hello there"], AlisaConfig(), max_new_tokens=4)
    assert model.config._attn_implementation == "eager"
    assert no_hooks(model)
