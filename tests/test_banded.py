"""A long prompt's sliding-window prefill by blocks (alisa.kv.banded) is the full SDPA call's
result bit for bit, and a sliding-window model generates the tokens of HF's dense generate."""

import pytest
import torch
from architectures import FAMILIES, build
from conftest import hf_generate, padded_batch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import alisa.kv.attention as attention_module
from alisa import AlisaCache, AlisaConfig
from alisa.kv.banded import KEY_BLOCK, banded_prefill


class Attention(nn.Module):
    """What SDPA reads of an attention module: the query heads per KV head."""

    num_key_value_groups = 2
    is_causal = True


def sliding_mask(lengths: tuple[int, ...], window: int) -> torch.Tensor:
    """(B, 1, L, L) HF's left-padded sliding-window mask: causal, (p - window, p], no padding."""
    width = max(lengths)
    positions = torch.arange(width)
    query, key = positions.view(-1, 1), positions.view(1, -1)
    visible = (key <= query) & (key > query - window)
    real = torch.stack([positions >= width - n for n in lengths])  # (B, L)
    return (visible.unsqueeze(0) & real.unsqueeze(1)).unsqueeze(1)


def inputs(lengths: tuple[int, ...], seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    batch, width = len(lengths), max(lengths)
    query = torch.randn(batch, 4, width, 32, generator=generator)
    key = torch.randn(batch, 2, width, 32, generator=generator)
    value = torch.randn(batch, 2, width, 32, generator=generator)
    return query, key, value


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [300, KEY_BLOCK, KEY_BLOCK + 2, 700])
def test_the_banded_prefill_is_the_full_calls_output_bit_for_bit(window, dtype):
    lengths = (2 * KEY_BLOCK + window + 77, 2 * KEY_BLOCK + window - 40)  # one row padded
    query, key, value = (tensor.to(dtype) for tensor in inputs(lengths))
    mask = sliding_mask(lengths, window)
    full, _ = sdpa_attention_forward(Attention(), query, key, value, mask, scaling=0.2)
    banded = banded_prefill(Attention(), query, key, value, mask, window, scaling=0.2)
    assert banded is not None and banded.shape == full.shape
    # The padded row's padding queries see no key: NaN in both, in the same places.
    torch.testing.assert_close(banded, full, rtol=0, atol=0, equal_nan=True)


def test_the_full_call_is_left_where_blocks_would_not_help_or_could_differ():
    window = 64
    length = 2 * KEY_BLOCK + window
    query, key, value = inputs((length,))
    mask = sliding_mask((length,), window)
    attend = Attention()

    def banded(*args, window=window, **kwargs):
        return banded_prefill(attend, *args, window, scaling=None, **kwargs)

    assert banded(query, key, value, mask) is not None
    assert banded(query, key, value, mask, window=None) is None  # a global layer
    assert banded(query, key, value, None) is None  # no mask: SDPA's causal flag
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    assert banded(query, key, value, additive) is None
    short = length - 1
    assert (
        banded(
            query[:, :, :short], key[:, :, :short], value[:, :, :short], mask[..., :short, :short]
        )
        is None
    )
    later = mask.clone()
    later[0, 0, KEY_BLOCK - 5, KEY_BLOCK + 2] = True  # a later key, past the query's block
    assert banded(query, key, value, later) is None
    past = torch.cat([key, key[:, :, :5]], dim=2)  # more keys than queries: a chunk after a past
    assert banded(query, past, torch.cat([value, value[:, :, :5]], dim=2), mask) is None


def test_a_sliding_window_model_decodes_a_long_prompt_as_hf_does(monkeypatch):
    """Gemma 3's layer pattern (two sliding layers of window 8, one global) over prompts past
    two key blocks: alisa's cache, with the sliding layers' prefill by blocks, generates HF's
    tokens, dropping (at an unreached budget) and keeping every token on the host."""
    model = build(FAMILIES["gemma3_text"])
    window = model.config.sliding_window
    ids, mask = padded_batch(lengths=(2 * KEY_BLOCK + window + 40, 2 * KEY_BLOCK + window + 1))
    reference = hf_generate(model, ids, mask, max_new_tokens=4)
    calls = []

    def counted(*args, **kwargs):
        output = banded_prefill(*args, **kwargs)
        calls.append(output is not None)
        return output

    monkeypatch.setattr(attention_module, "banded_prefill", counted)
    for config in (AlisaConfig(), AlisaConfig(policy="swa", caching_ratio=1.0, retention="host")):
        calls.clear()
        cache = AlisaCache(model, config, max_new_tokens=4)
        assert torch.equal(hf_generate(model, ids, mask, cache, max_new_tokens=4), reference)
        assert calls.count(True) == 2  # each sliding layer's prefill went by blocks


def test_each_capped_or_sink_prefill_chunk_reads_the_keys_its_queries_see():
    """The soft-capped / sink prefill's chunks (``_chunk_bands``): from the first key any of a
    chunk's queries sees to the last; a chunk that sees none reads every key."""
    causal = sliding_mask((10,), window=3)  # keys (p - 3, p]
    assert attention_module._chunk_bands(causal, 4) == [(0, 4), (2, 8), (6, 10)]
    padded = sliding_mask((10, 6), window=3)  # the second sequence's 4 pads see nothing
    assert attention_module._chunk_bands(padded, 4) == [(0, 4), (2, 8), (6, 10)]
    only_pads = padded[1:]
    assert attention_module._chunk_bands(only_pads, 4) == [(0, 10), (4, 8), (6, 10)]
    full = torch.ones(1, 1, 3, 5, dtype=torch.bool)  # a bidirectional mask: every key
    assert attention_module._chunk_bands(full, 2) == [(0, 5), (0, 5)]


# SEED_CHUNK_VALUES for chunks of 5 queries: 2 sequences x 4 query heads x 60 keys x 5 queries.
FIVE_QUERY_CHUNKS = 2 * 4 * 60 * 5


@pytest.mark.parametrize("name", ["gemma2", "gpt_oss"])
def test_a_capped_or_sink_prefill_by_chunk_bands_gives_hfs_tokens(name, monkeypatch):
    """Gemma 2 (soft-capping) and GPT-OSS (sinks) prefill by chunks of a few queries, each
    reading only its band of keys (narrower than the prompt on both the sliding and the full
    layers), generate HF's tokens from a padded batch, dropping or keeping on the host."""
    monkeypatch.setattr(attention_module, "SEED_CHUNK_VALUES", FIVE_QUERY_CHUNKS)
    bands = []
    chunk_bands = attention_module._chunk_bands

    def recorded(visible, chunk):
        mine = chunk_bands(visible, chunk)
        bands.extend(mine)
        return mine

    monkeypatch.setattr(attention_module, "_chunk_bands", recorded)
    model = build(FAMILIES[name])
    ids, mask = padded_batch(lengths=(60, 41))
    reference = hf_generate(model, ids, mask, max_new_tokens=8)
    for config in (AlisaConfig(), AlisaConfig(policy="swa", caching_ratio=1.0, retention="host")):
        bands.clear()
        ours = hf_generate(model, ids, mask, AlisaCache(model, config), max_new_tokens=8)
        assert torch.equal(ours, reference), config
        assert len(bands) == 2 * 12  # two layers, 60 queries in chunks of 5
        assert all(high - low < 60 for low, high in bands[1:12])  # sliding: (p - 8, p]
        assert any(high - low < 60 for low, high in bands[12:])  # full: causal
