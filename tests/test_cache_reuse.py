"""A filled ``AlisaCache`` passed to HF's ``generate`` again (a second chat turn) continues as HF's
own ``DynamicCache`` does, token for token, or is refused before anything is stored."""

import numpy as np
import pytest
import torch
from architectures import FAMILIES, MODES, build, prompts
from conftest import PAD, VOCAB, padded_batch, tiny_llama
from transformers import DynamicCache

from alisa import AlisaCache, AlisaConfig
from alisa.kv.host import HostKeeper

NEW_TOKENS = 5
TURN_TOKENS = 6  # the second turn's own tokens, after the first answer

# Exact families of the architecture matrix whose attention differs in a way a continuation
# meets: RoPE with grouped KV heads (llama), learned absolute positions (gpt2, opt), soft-capping
# with sliding layers (gemma2), sliding and full layers (gemma3_text, qwen2-window), every layer
# sliding (mistral), sliding layers whose mask has no window (moshi), attention sinks (gpt_oss).
FAMILY_NAMES = (
    *("llama", "gpt2", "opt", "gemma2", "gemma3_text", "qwen2-window"),
    *("mistral", "moshi", "gpt_oss"),
)


def second_turn(first: torch.Tensor, mask: torch.Tensor, seed: int = 5):
    """The conversation so far (the first turn's prompt and answer) plus the user's next
    tokens, and its padding mask (the first turn's padding, then ones)."""
    generator = torch.Generator().manual_seed(seed)
    turn = torch.randint(3, VOCAB, (first.shape[0], TURN_TOKENS), generator=generator)
    ids = torch.cat([first, turn], dim=1)
    ones = torch.ones(first.shape[0], ids.shape[1] - mask.shape[1], dtype=mask.dtype)
    return ids, torch.cat([mask, ones], dim=1)


@torch.inference_mode()
def two_turns(model, cache, ids, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy ``generate`` twice with one cache, as HF users hold a chat: the second call gets
    the whole conversation and feeds only what the cache lacks."""
    options = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD)
    first = model.generate(ids, attention_mask=mask, past_key_values=cache, **options)
    ids, mask = second_turn(first, mask)
    second = model.generate(ids, attention_mask=mask, past_key_values=cache, **options)
    return first, second


@pytest.mark.parametrize("config", [AlisaConfig(), AlisaConfig(policy="swa", caching_ratio=1.0)])
def test_a_second_turn_continues_as_hfs_reused_dynamic_cache(config):
    model = tiny_llama()
    model.generation_config.eos_token_id = None  # every step compared
    ids, mask = padded_batch(lengths=(14, 9))
    reference = two_turns(model, DynamicCache(), ids, mask)
    cache = AlisaCache(model, config)
    first, second = two_turns(model, cache, ids, mask)
    assert torch.equal(first, reference[0]) and torch.equal(second, reference[1])
    # The second call fed only the new tokens: every layer saw each token once.
    assert [layer.get_seq_length() for layer in cache.layers] == [second.shape[1] - 1] * 2


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_each_familys_second_turn_is_hfs_in_every_exact_mode(name):
    """Drop and INT8 at r = 1 (modes the architecture matrix holds exact) against HF's
    ``DynamicCache`` reused the same way; host retention (the matrix's, at an unreached budget)
    refuses the second turn's several tokens at once, naming the mode, before storing any
    (a model whose layers all slide keeps its windows instead, and continues exactly)."""
    model = build(FAMILIES[name])
    model.generation_config.eos_token_id = None
    ids, mask = prompts()  # a left-padded batch of 2
    reference = two_turns(model, DynamicCache(config=model.config), ids, mask)
    for mode, fields in MODES.items():
        cache = AlisaCache(model, AlisaConfig(**fields))
        if any(isinstance(layer.keeper, HostKeeper) for layer in cache.layers):
            with pytest.raises(ValueError, match="retention='host' .* cannot continue"):
                two_turns(model, cache, ids, mask)
            continue
        tokens = two_turns(model, cache, ids, mask)
        assert torch.equal(tokens[1], reference[1]), f"{name}, {mode}"


def test_a_second_turn_under_eviction_keeps_the_budget():
    """Dropping continues as its prefill runs: the new tokens attend to every kept token, then
    each sequence's excess leaves."""
    model = tiny_llama()
    model.generation_config.eos_token_id = None
    ids, mask = padded_batch(lengths=(200, 150))
    config = AlisaConfig(policy="swa", caching_ratio=0.25, min_budget_tokens=16)
    cache = AlisaCache(model, config)
    two_turns(model, cache, ids, mask)
    seen = mask.sum(1).numpy() + 2 * NEW_TOKENS - 1 + TURN_TOKENS  # real tokens stored
    for layer in cache.layers:
        assert (layer.slots.kept == np.rint(seen * 0.25).astype(int)).all()
    assert cache.evicted_tokens() > 0


@torch.inference_mode()
def filled(model, config: AlisaConfig | None = None, lengths=(14, 9)):
    """A cache after one generate call, with its inputs and output."""
    ids, mask = padded_batch(lengths=lengths)
    cache = AlisaCache(model, config)
    first = model.generate(
        ids, attention_mask=mask, past_key_values=cache, max_new_tokens=4, do_sample=False
    )
    return cache, first, mask


def refused_untouched(cache, call, match: str) -> None:
    """``call`` raises ValueError matching ``match`` and the cache holds what it held."""
    held = [layer.get_seq_length() for layer in cache.layers]
    with pytest.raises(ValueError, match=match), torch.inference_mode():
        call()
    assert [layer.get_seq_length() for layer in cache.layers] == held


def test_another_batch_size_is_refused_naming_both():
    model = tiny_llama()
    cache, first, mask = filled(model)
    ids, mask = second_turn(first, mask)
    refused_untouched(
        cache,
        lambda: model.generate(
            ids[:1], attention_mask=mask[:1], past_key_values=cache, max_new_tokens=2
        ),
        r"holds a batch of 2 sequence\(s\) and this forward feeds 1",
    )


def test_an_input_no_longer_than_the_cache_is_refused():
    model = tiny_llama()
    cache, first, mask = filled(model)
    refused_untouched(
        cache,
        lambda: model.generate(
            first[:, :5], attention_mask=mask[:, :5], past_key_values=cache, max_new_tokens=2
        ),
        r"already holds 17 tokens per sequence and this forward adds none",
    )


def test_padding_among_the_new_tokens_is_refused():
    model = tiny_llama()
    cache, first, mask = filled(model)
    ids, mask = second_turn(first, mask)
    mask[1, -3] = 0  # HF would mask it; the cache masks by what it stored
    refused_untouched(
        cache,
        lambda: model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=2),
        r"attention_mask masks tokens other than the cached sequences' left padding",
    )


def test_a_forward_without_a_mask_on_a_padded_cache_is_refused():
    """No mask means HF attends to the cached padding too; the cache never would."""
    model = tiny_llama()
    cache, first, _ = filled(model)
    ids, _ = second_turn(first, torch.ones_like(first))
    refused_untouched(
        cache,
        lambda: model(input_ids=ids[:, cache.get_seq_length() :], past_key_values=cache),
        r"attention_mask masks tokens other than",
    )


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (dict(policy="swa", caching_ratio=0.5, retention="host"), r"retention='host'"),
        (
            dict(policy="swa", caching_ratio=0.5, retention="host", host_memory="1GiB"),
            r"host_memory='1GiB' was checked for one prompt",
        ),
        (dict(gpu_memory="1GiB"), r"gpu_memory='1GiB': device/host/recompute tiers"),
    ],
)
def test_modes_that_cannot_continue_are_refused_naming_the_mode(fields, match):
    model = tiny_llama()
    cache, first, mask = filled(model, AlisaConfig(**fields), lengths=(90, 70))
    ids, mask = second_turn(first, mask)
    refused_untouched(
        cache,
        lambda: model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=2),
        match,
    )


def test_those_modes_still_decode_one_token_at_a_time():
    """The refusal is of several new tokens at once: a decode step continues as always."""
    model = tiny_llama()
    config = AlisaConfig(policy="swa", caching_ratio=0.5, retention="host")
    cache, first, mask = filled(model, config, lengths=(90, 70))
    seen = cache.get_seq_length()
    with torch.inference_mode():
        model(
            input_ids=first[:, -1:],
            attention_mask=torch.cat([mask, torch.ones_like(mask[:, :4])], dim=1),
            past_key_values=cache,
        )
    assert cache.get_seq_length() == seen + 1
