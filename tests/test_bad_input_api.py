"""Bad input to the Python API: a clear ValueError naming the argument and its value, never a
torch error from deep inside, and never a setting accepted and ignored."""

import pytest
from conftest import VOCAB, tiny_llama
from transformers import DynamicCache

from alisa import AlisaCache, AlisaConfig, generate
from alisa.jobs.stream import stream_generate
from alisa.runtime.requests import StreamRequest

# ---- generate(config=..., past_key_values=...) --------------------------------------------


def test_generate_refuses_a_config_that_a_foreign_cache_would_ignore(tokenizer):
    model = tiny_llama()
    with pytest.raises(ValueError, match=r"config and past_key_values=DynamicCache were both"):
        generate(
            model,
            tokenizer,
            "Hello",
            AlisaConfig(policy="swa", caching_ratio=0.2),
            past_key_values=DynamicCache(),
        )


def test_generate_refuses_a_config_other_than_the_caches_own_naming_the_fields(tokenizer):
    model = tiny_llama()
    cache = AlisaCache(model, AlisaConfig(policy="h2o", caching_ratio=0.5))
    asked = AlisaConfig(policy="swa", caching_ratio=0.5)
    with pytest.raises(ValueError, match=r"policy='swa' \(the cache's: 'h2o'\)"):
        generate(model, tokenizer, "Hello", asked, past_key_values=cache)
    assert cache.get_seq_length() == 0  # refused before the prefill


def test_generate_takes_a_config_that_is_the_caches_own(tokenizer):
    model = tiny_llama()
    config = AlisaConfig(policy="swa", caching_ratio=0.5)
    ours = generate(model, tokenizer, "Hello", config, max_new_tokens=4)
    given = generate(
        model,
        tokenizer,
        "Hello",
        config,
        max_new_tokens=4,
        past_key_values=AlisaCache(model, config),
    )
    assert given.token_ids == ours.token_ids


@pytest.mark.parametrize("make", [DynamicCache, lambda model: AlisaCache(model)])
def test_generate_refuses_a_cache_that_already_holds_tokens(tokenizer, make):
    """generate prefills its prompts into the cache; appended to a filled one, the prompt
    would be read as a continuation of the earlier text."""
    model = tiny_llama()
    cache = make() if make is DynamicCache else make(model)
    generate(model, tokenizer, "Hello", max_new_tokens=3, past_key_values=cache)
    with pytest.raises(ValueError, match=r"past_key_values already holds \d+ tokens"):
        generate(model, tokenizer, "Hello there", max_new_tokens=3, past_key_values=cache)


def test_generate_refuses_a_past_key_values_that_is_no_cache(tokenizer):
    with pytest.raises(ValueError, match=r"past_key_values=tuple must be a transformers Cache"):
        generate(tiny_llama(), tokenizer, "Hello", past_key_values=())


# ---- stream_generate with one string -------------------------------------------------------


def test_stream_generate_takes_one_string_as_one_prompt(tokenizer):
    model = tiny_llama()
    results = list(stream_generate(model, tokenizer, "Hi there", max_new_tokens=3))
    assert len(results) == 1
    assert results[0].prompt_tokens == len(tokenizer("Hi there")["input_ids"])


def test_stream_generate_takes_one_request_as_one_prompt(tokenizer):
    request = StreamRequest(prompt_ids=[5, 6, 7], max_new_tokens=2, id="only")
    results = list(stream_generate(tiny_llama(), tokenizer, request))
    assert [(result.id, result.prompt_tokens) for result in results] == [("only", 3)]


@pytest.mark.parametrize("prompts", [b"Hi", 7])
def test_stream_generate_refuses_prompts_of_another_type(tokenizer, prompts):
    with pytest.raises(ValueError, match=r"prompts=.* must be a string, a StreamRequest or an"):
        list(stream_generate(tiny_llama(), tokenizer, prompts))


# ---- StreamRequest token ids ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([5, -1], r"prompt_ids\[1\]=-1 of request 'r' must be a token id \(an integer >= 0\)"),
        ([5.0], r"prompt_ids\[0\]=5.0 of request 'r' must be a token id"),
        ([3, True], r"prompt_ids\[1\]=True of request 'r' must be a token id"),
        ([[3, 4]], r"prompt_ids\[0\]=\[3, 4\] of request 'r' must be a token id"),
        ("hello", r"prompt_ids='hello' of request 'r' must be a list of token ids"),
        (7, r"prompt_ids=7 of request 'r' must be a list of token ids"),
        ([], r"prompt_ids of request 'r' is empty"),
    ],
)
def test_a_stream_request_refuses_ids_that_are_no_token_ids(ids, match):
    with pytest.raises(ValueError, match=match):
        StreamRequest(prompt_ids=ids, max_new_tokens=2, id="r")


def test_a_stream_request_takes_numpy_and_python_integers():
    import numpy as np

    request = StreamRequest(prompt_ids=np.array([4, 5], dtype=np.int64), max_new_tokens=1)
    assert len(request.prompt_ids) == 2


def test_a_stream_request_refuses_an_arrival_that_is_no_time():
    with pytest.raises(ValueError, match=r"arrival_s='now' must be a finite number"):
        StreamRequest(prompt_ids=[4], max_new_tokens=1, arrival_s="now")


def test_stream_generate_refuses_an_id_past_the_vocabulary_naming_it(tokenizer):
    request = StreamRequest(prompt_ids=[5, VOCAB + 3, 6], max_new_tokens=2, id="x")
    match = rf"prompt_ids\[1\]={VOCAB + 3} of request 'x' is past the model's vocabulary of"
    with pytest.raises(ValueError, match=rf"{match} {VOCAB} tokens \(ids 0..{VOCAB - 1}\)"):
        list(stream_generate(tiny_llama(), tokenizer, [request]))


def test_the_last_id_of_the_vocabulary_is_a_token(tokenizer):
    request = StreamRequest(prompt_ids=[VOCAB - 1], max_new_tokens=1)
    request.check_vocabulary(VOCAB)
    unnamed = r"the request with no id whose prompt_ids are \[511\]"
    with pytest.raises(ValueError, match=rf"prompt_ids\[0\]=511 of {unnamed} is past"):
        request.check_vocabulary(VOCAB - 1)


def test_a_valid_request_still_gives_generates_tokens(tokenizer):
    """The checks read the ids once per request, before the model: a valid request's answer
    is generate's own greedy one."""
    model = tiny_llama()
    model.generation_config.eos_token_id = None
    ids = tokenizer("Hello")["input_ids"]
    stream = stream_generate(model, tokenizer, [StreamRequest(prompt_ids=ids, max_new_tokens=4)])
    expected = generate(model, tokenizer, "Hello", max_new_tokens=4).token_ids[0]
    assert [result.token_ids for result in stream] == [expected]
