import pytest
import torch
from conftest import EOS, PAD, padded_batch, tiny_llama
from transformers import DynamicCache

from alisa import AlisaConfig, SamplingOptions, generate

PROMPTS = ["The quick brown fox jumps over", "Hello", "A somewhat longer prompt, to pad the others"]


def hf_greedy(model, tokenizer, prompts, max_new_tokens):
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=PAD)
    return out[:, batch["input_ids"].shape[1] :]


def test_greedy_matches_hf_generate_on_a_padded_batch(tiny_model, tokenizer):
    # EOS may appear early with random weights: forbid it so all 24 tokens are compared.
    tiny_model.generation_config.eos_token_id = None
    reference = hf_greedy(tiny_model, tokenizer, PROMPTS, 24)
    result = generate(tiny_model, tokenizer, PROMPTS, AlisaConfig(), max_new_tokens=24)
    assert [len(ids) for ids in result.token_ids] == [24, 24, 24]
    assert torch.equal(torch.tensor(result.token_ids), reference)
    assert result.finish_reasons == ["length"] * 3
    assert result.prompt_tokens == [len(tokenizer(p)["input_ids"]) for p in PROMPTS]


def test_output_reports_timings_and_memory(tokenizer):
    model = tiny_llama()
    result = generate(model, tokenizer, PROMPTS, max_new_tokens=8)
    assert result.ttft_s > 0
    assert len(result.step_times_s) == 7
    assert all(t > 0 for t in result.step_times_s)
    assert result.decode_tokens_per_s > 0
    assert result.kv_bytes > 0 and result.peak_kv_bytes >= result.kv_bytes
    assert result.peak_memory_bytes > 0
    assert result.texts == [
        tokenizer.decode(ids, skip_special_tokens=True) for ids in result.token_ids
    ]


def test_dynamic_cache_can_replace_the_alisa_cache(tokenizer):
    model = tiny_llama()
    ours = generate(model, tokenizer, PROMPTS, max_new_tokens=10)
    theirs = generate(model, tokenizer, PROMPTS, max_new_tokens=10, past_key_values=DynamicCache())
    assert ours.token_ids == theirs.token_ids
    assert theirs.kv_bytes > 0


def test_sampling_is_reproducible_with_a_seed(tokenizer):
    model = tiny_llama()
    sampling = SamplingOptions(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, seed=7)
    first = generate(model, tokenizer, PROMPTS, max_new_tokens=12, sampling=sampling)
    second = generate(model, tokenizer, PROMPTS, max_new_tokens=12, sampling=sampling)
    other = generate(
        model,
        tokenizer,
        PROMPTS,
        max_new_tokens=12,
        sampling=SamplingOptions(do_sample=True, seed=8),
    )
    assert first.token_ids == second.token_ids
    assert first.token_ids != other.token_ids


def test_sampling_matches_hf_generate_under_the_same_global_seed(tokenizer):
    model = tiny_llama()
    model.generation_config.eos_token_id = None
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    torch.manual_seed(3)
    reference = model.generate(
        **batch, max_new_tokens=10, do_sample=True, top_k=30, temperature=0.7, pad_token_id=PAD
    )[:, batch["input_ids"].shape[1] :]
    torch.manual_seed(3)
    result = generate(
        model,
        tokenizer,
        PROMPTS,
        max_new_tokens=10,
        sampling=SamplingOptions(do_sample=True, top_k=30, temperature=0.7),
    )
    assert torch.equal(torch.tensor(result.token_ids), reference)


def test_stops_at_eos_and_pads_after_it(tokenizer):
    model = tiny_llama()
    # Make EOS the argmax after the first step by boosting its output bias.
    ids, mask = padded_batch(lengths=(6, 9))
    prompts = [tokenizer.decode(row[m.bool()]) for row, m in zip(ids % 200 + 40, mask, strict=True)]
    with torch.no_grad():
        model.lm_head.weight[EOS] = model.lm_head.weight.mean(0) * 0 + 0.5
    result = generate(model, tokenizer, prompts, max_new_tokens=6)
    assert all(reason == "stop" for reason in result.finish_reasons)
    assert all(ids[-1] == EOS for ids in result.token_ids)


@pytest.mark.parametrize("prompts", [[], "", "   ", ["ok", ""]])
def test_empty_prompts_are_rejected(prompts, tokenizer):
    with pytest.raises(ValueError, match="prompts"):
        generate(tiny_llama(), tokenizer, prompts)


@pytest.mark.parametrize("count", [-1, 2.5, True])
def test_bad_max_new_tokens_is_rejected(count, tokenizer):
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(tiny_llama(), tokenizer, "hi", max_new_tokens=count)


@pytest.mark.parametrize(
    ("field", "value"), [("temperature", 0.0), ("top_k", -1), ("top_p", 0.0), ("top_p", 1.5)]
)
def test_bad_sampling_options_are_rejected(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingOptions(do_sample=True, **{field: value})


@pytest.mark.slow
def test_smollm2_says_paris(smollm2):
    model, tokenizer = smollm2
    result = generate(model, tokenizer, "The capital of France is", max_new_tokens=8)
    assert "Paris" in result.texts[0]


def test_pruning_finished_sequences_keeps_every_output(tokenizer):
    model = tiny_llama()
    prompts = ["alpha beta gamma", "x", "a much longer prompt than the others, to pad them"]
    # EOS becomes likely for some rows: compare pruned and unpruned runs row by row.
    with torch.no_grad():
        model.lm_head.weight[EOS] += 0.6
    full = generate(model, tokenizer, prompts, max_new_tokens=12)
    pruned = generate(model, tokenizer, prompts, max_new_tokens=12, prune_finished=True)
    assert pruned.token_ids == full.token_ids
    assert pruned.finish_reasons == full.finish_reasons


def test_stop_at_eos_false_generates_every_token(tokenizer):
    model = tiny_llama()
    with torch.no_grad():
        model.lm_head.weight[EOS] += 0.6
    result = generate(model, tokenizer, ["x", "yz"], max_new_tokens=7, stop_at_eos=False)
    assert [len(ids) for ids in result.token_ids] == [7, 7]
    assert result.finish_reasons == ["length", "length"]
