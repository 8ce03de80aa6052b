"""The one decode loop: generate, parallel decode and profiling all step through ``Engine``."""

import torch
from conftest import padded_batch, tiny_llama

from alisa import AlisaCache, AlisaConfig, generate
from alisa.runtime.engine import DecodeState, Engine

PROMPT = "The quick brown fox jumps over"


def test_a_prefill_run_elsewhere_continues_to_the_same_tokens(tokenizer):
    # The parallel decodes hand the engine a prefill they ran themselves.
    model = tiny_llama()
    model.generation_config.eos_token_id = None
    reference = generate(model, tokenizer, PROMPT, max_new_tokens=9)
    input_ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    engine = Engine(model, tokenizer)
    cache = AlisaCache(model, AlisaConfig(), max_new_tokens=9)
    with torch.inference_mode():
        logits = engine.forward(DecodeState.start(input_ids), cache)
        result = engine.run(
            DecodeState.start(input_ids), cache, 9, prefill_logits=logits, prefill_s=0.5
        )
    assert result.token_ids == reference.token_ids
    assert result.ttft_s > 0.5 and len(result.step_times_s) == 8
    assert result.peak_kv_bytes >= result.kv_bytes > 0


def test_announce_says_whether_another_step_follows(tokenizer):
    model = tiny_llama()
    model.generation_config.eos_token_id = None
    input_ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    heard = []
    engine = Engine(model, tokenizer)
    cache = AlisaCache(model, AlisaConfig(), max_new_tokens=4)
    with torch.inference_mode():
        engine.run(DecodeState.start(input_ids), cache, 4, announce=heard.append)
    assert heard == [True, True, True, False]


def test_zero_new_tokens_runs_no_forward_pass(tokenizer):
    model = tiny_llama()
    result = generate(model, tokenizer, PROMPT, max_new_tokens=0)
    assert result.token_ids == [[]] and result.ttft_s == 0.0 and result.kv_bytes == 0


def test_a_state_without_mask_counts_positions_from_zero():
    state = DecodeState.start(torch.tensor([[5, 6, 7]]))
    assert state.positions.tolist() == [[0, 1, 2]] and state.prompt_tokens() == [3]
    state.advance(torch.tensor([8]))
    assert state.feed.tolist() == [[8]] and state.positions.tolist() == [[3]]


def test_a_foreign_cache_reports_its_bytes_by_where_they_are():
    """HF's offloaded cache keeps layers in CPU memory between uses: against a CUDA model those
    bytes are the host's (no CUDA needed to count them)."""
    from transformers import DynamicCache

    from alisa.runtime.engine import cache_kv_bytes, foreign_tier_bytes

    model = tiny_llama()
    ids, mask = padded_batch()
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    total = cache_kv_bytes(cache)
    assert total > 0
    assert foreign_tier_bytes(cache, torch.device("cpu")) == {"device": total, "host": 0}
    assert foreign_tier_bytes(cache, torch.device("cuda")) == {"device": 0, "host": total}
