"""Bad input to generate / stream_generate / StreamRequest / the settings dataclasses, from the
second bad-input tour (issue 67, docs/bad-input-tour.md): each is refused with a ValueError naming
the argument and its value, or, where the value is fine (numpy numbers, a 1-D tensor of ids),
taken as the Python value it equals."""

import numpy as np
import pytest
import torch
from conftest import tiny_llama

from alisa import AlisaConfig, SamplingOptions, generate
from alisa.jobs.sizing import running_memory
from alisa.jobs.stream import stream_generate
from alisa.model.adapter import model_shape
from alisa.planning.spec import model_spec
from alisa.runtime.requests import StreamRequest

SURROGATE = "Hi \ud800"  # a JSON "\ud800" escape without its pair: no tokenizer encodes it


def _stream(tokenizer, prompts, **options):
    return list(stream_generate(tiny_llama(), tokenizer, prompts, **options))


# ---- #2, #3: a prompt holding a lone surrogate ----------------------------------------------


@pytest.mark.parametrize("prompts", [SURROGATE, ["Hi", SURROGATE]])
def test_generate_refuses_a_lone_surrogate_naming_the_prompt(tokenizer, prompts):
    index = 0 if isinstance(prompts, str) else 1
    match = rf"prompts\[{index}\] holds a lone surrogate '\\ud800' at character 3"
    with pytest.raises(ValueError, match=match):
        generate(tiny_llama(), tokenizer, prompts, max_new_tokens=2)


@pytest.mark.parametrize("prompts", [SURROGATE, ["Hi", SURROGATE]])
def test_stream_generate_refuses_a_lone_surrogate_naming_the_prompt(tokenizer, prompts):
    index = 0 if isinstance(prompts, str) else 1
    with pytest.raises(ValueError, match=rf"prompts\[{index}\] holds a lone surrogate '\\ud800'"):
        _stream(tokenizer, prompts, max_new_tokens=2)


# ---- #20, #21, #23: flags that are not True or False ----------------------------------------


@pytest.mark.parametrize(
    ("flag", "value"),
    [("stop_at_eos", None), ("stop_at_eos", "no"), ("prune_finished", "yes"), ("chat", 1)],
)
def test_generate_refuses_a_flag_that_is_no_bool(tokenizer, flag, value):
    with pytest.raises(ValueError, match=rf"{flag}={value!r} must be True or False"):
        generate(tiny_llama(), tokenizer, "Hi", max_new_tokens=2, **{flag: value})


@pytest.mark.parametrize("value", ["no", None, 0])
def test_stream_generate_refuses_a_stop_at_eos_that_is_no_bool(tokenizer, value):
    with pytest.raises(ValueError, match=rf"stop_at_eos={value!r} must be True or False"):
        _stream(tokenizer, "Hi", max_new_tokens=2, stop_at_eos=value)


# ---- #22: prompts in a dict or a set ----------------------------------------------------------


@pytest.mark.parametrize(
    ("prompts", "kind"),
    [({"prompt": "Hi"}, r"a dict \(iterating it gives its keys\)"), ({"Hi"}, "a set")],
)
def test_stream_generate_refuses_prompts_in_a_dict_or_a_set(tokenizer, prompts, kind):
    match = rf"prompts={prompts!r} must be a string, a StreamRequest or an iterable of them, not"
    with pytest.raises(ValueError, match=rf"{match} {kind}"):
        _stream(tokenizer, prompts, max_new_tokens=2)


def test_generate_refuses_prompts_in_a_dict(tokenizer):
    match = r"prompts=\{'prompt': 'Hi'\} must be a string or a list of strings, not a dict"
    with pytest.raises(ValueError, match=match):
        generate(tiny_llama(), tokenizer, {"prompt": "Hi"}, max_new_tokens=2)


# ---- #24: two requests with one id -----------------------------------------------------------


def test_stream_generate_refuses_an_id_given_twice(tokenizer):
    requests = [
        StreamRequest(prompt_ids=[5], max_new_tokens=2, id="x"),
        StreamRequest(prompt_ids=[6], max_new_tokens=2, id="x"),
    ]
    with pytest.raises(ValueError, match=r"prompts\[1\] has id='x', as an earlier prompt does"):
        _stream(tokenizer, requests)


def test_stream_generate_refuses_an_id_that_a_request_without_one_would_take(tokenizer):
    """A request without an id is named by its arrival index, which may be an id given."""
    requests = [
        StreamRequest(prompt_ids=[5], max_new_tokens=2, id=1),
        StreamRequest(prompt_ids=[6], max_new_tokens=2),
    ]
    with pytest.raises(ValueError, match=r"prompts\[1\] has id=1, as an earlier prompt does"):
        _stream(tokenizer, requests)


def test_stream_generate_refuses_an_id_that_names_no_result():
    """Refused where the request is built (fourth tour: the request itself accepted it)."""
    with pytest.raises(ValueError, match=r"id=\['x'\] of a StreamRequest must be a string"):
        StreamRequest(prompt_ids=[5], max_new_tokens=2, id=["x"])


def test_stream_generate_names_requests_without_an_id_by_their_index(tokenizer):
    requests = [
        StreamRequest(prompt_ids=[5], max_new_tokens=2),
        StreamRequest(prompt_ids=[6], max_new_tokens=2, id="b"),
        StreamRequest(prompt_ids=[7], max_new_tokens=2),
    ]
    results = _stream(tokenizer, requests)
    assert sorted(map(str, (result.id for result in results))) == ["0", "2", "b"]
    assert {result.id: result.prompt_tokens for result in results} == {0: 1, "b": 1, 2: 1}


# ---- #25, #26, #46: StreamRequest's prompt_ids ----------------------------------------------


@pytest.mark.parametrize(
    ("ids", "kind"),
    [({5, 6}, r"a set \(its order is arbitrary\)"), ({5: 1}, r"a dict \(iterating it gives")],
)
def test_a_stream_request_refuses_ids_in_a_set_or_a_dict(ids, kind):
    match = rf"prompt_ids={ids!r} of request 'r' must be a list of token ids \(integers >= 0\)"
    with pytest.raises(ValueError, match=rf"{match} in prompt order, not {kind}"):
        StreamRequest(prompt_ids=ids, max_new_tokens=2, id="r")


def test_a_stream_request_takes_a_1d_tensor_of_ids_as_the_list_it_holds(tokenizer):
    ids = tokenizer("Hello", return_tensors="pt")["input_ids"][0]
    request = StreamRequest(prompt_ids=ids, max_new_tokens=2)
    assert request.prompt_ids == ids.tolist() and type(request.prompt_ids[0]) is int
    model = tiny_llama()
    model.generation_config.eos_token_id = None
    [result] = stream_generate(model, tokenizer, request)
    assert result.token_ids == generate(model, tokenizer, "Hello", max_new_tokens=2).token_ids[0]


def test_a_stream_request_refuses_a_tensor_of_several_prompts(tokenizer):
    ids = tokenizer("Hello", return_tensors="pt")["input_ids"]  # (1, n): a batch of one
    shape = rf"is a tensor of shape \(1, {ids.shape[1]}\); give one"
    match = rf"prompt_ids of a request with no id {shape}"
    with pytest.raises(ValueError, match=match):
        StreamRequest(prompt_ids=ids, max_new_tokens=2)


def test_a_stream_request_refuses_a_tensor_of_floats_naming_the_id():
    unnamed = r"the request with no id whose prompt_ids are \[5.0, 6.0\]"
    with pytest.raises(ValueError, match=rf"prompt_ids\[0\]=5.0 of {unnamed} must be a token"):
        StreamRequest(prompt_ids=torch.tensor([5.0, 6.0]), max_new_tokens=2)


# ---- #44, #45: budgets too small for a request, or for the weights --------------------------


def test_stream_generate_quotes_the_bytes_and_the_kv_budget_a_prompt_exceeds(tokenizer):
    model = tiny_llama()
    [result] = stream_generate(model, tokenizer, "Hi", max_new_tokens=2, kv_memory="1KB")
    tokens = len(tokenizer("Hi")["input_ids"])
    need = running_memory(model_spec(model, model_shape(model)), AlisaConfig(), [], [(tokens, 2)])
    assert result.finish_reason == "did_not_fit" and result.token_ids == []
    assert result.error == (
        f"a prompt of {tokens} tokens with max_new_tokens=2 needs about {need.kv} bytes of KV, "
        "over the KV budget kv_memory='1KB' (1000 bytes) even alone"
    )


def test_stream_generate_quotes_the_device_budget_a_prompt_exceeds(tokenizer):
    model = tiny_llama()
    spec = model_spec(model, model_shape(model))
    need = running_memory(spec, AlisaConfig(), [], [(1, 8)])
    budget = need.total - 1  # room for the weights, not for the prompt beside them
    request = StreamRequest(prompt_ids=[5], max_new_tokens=8, id="a")
    [result] = stream_generate(model, tokenizer, request, gpu_memory=budget)
    assert result.finish_reason == "did_not_fit"
    assert result.error == (
        f"a prompt of 1 tokens with max_new_tokens=8 needs about {need.total} bytes "
        f"({need.kv} of KV), over the device budget gpu_memory={budget} ({budget} bytes) even alone"
    )


def test_stream_generate_refuses_a_device_budget_the_weights_fill(tokenizer):
    model = tiny_llama()
    weights = model_spec(model, model_shape(model)).total_weight_bytes
    match = rf"gpu_memory='1KB' \(1000 bytes\) is smaller than the weights \({weights} bytes\)"
    with pytest.raises(ValueError, match=match):
        list(stream_generate(model, tokenizer, "Hi", max_new_tokens=2, gpu_memory="1KB"))


# ---- #43, #47, #48: numpy numbers are numbers -----------------------------------------------


def test_a_config_takes_numpy_numbers_as_the_python_ones_they_equal():
    values = {"caching_ratio": 0.5, "sink_tokens": 2, "kv_bits": 8, "recent_fraction": 0.25}
    kinds = {"caching_ratio": np.float32, "sink_tokens": np.int64, "kv_bits": np.int32}
    numpy_values = {**values, **{name: kind(values[name]) for name, kind in kinds.items()}}
    numpy_values["recent_fraction"] = np.float64(0.25)  # a float subclass: stored as a float
    given = AlisaConfig(policy="swa", gpu_memory=np.int64(10**9), **numpy_values)
    plain = AlisaConfig(policy="swa", gpu_memory=10**9, **values)
    assert given == plain and repr(given) == repr(plain)
    assert [type(given.caching_ratio), type(given.sink_tokens)] == [float, int]
    assert [type(given.recent_fraction), type(given.gpu_memory)] == [float, int]


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("caching_ratio", np.bool_(True), r"caching_ratio=np.True_ must be a number"),
        ("caching_ratio", np.float32("nan"), r"caching_ratio=nan must be a finite number"),
        ("caching_ratio", torch.tensor(0.5), r"caching_ratio=tensor\(0.5000\) must be a number"),
        ("sink_tokens", np.float64(2.0), r"sink_tokens=np.float64\(2.0\) must be an integer"),
        ("sink_tokens", np.int64(-1), r"sink_tokens=-1 must be an integer >= 0"),
    ],
)
def test_a_config_still_refuses_what_is_no_number_of_its_kind(field, value, match):
    with pytest.raises(ValueError, match=match):
        AlisaConfig(policy="swa", **{field: value})


def test_numpy_integers_are_taken_as_counts_and_seeds(tokenizer):
    request = StreamRequest(prompt_ids=[5], max_new_tokens=np.int64(2))
    assert request.max_new_tokens == 2 and type(request.max_new_tokens) is int
    sampling = SamplingOptions(do_sample=True, seed=np.int64(3), top_k=np.uint8(5))
    assert sampling == SamplingOptions(do_sample=True, seed=3, top_k=5)
    model = tiny_llama()
    model.generation_config.eos_token_id = None
    numpy_run = generate(model, tokenizer, "Hi", max_new_tokens=np.int64(3), sampling=sampling)
    plain_run = generate(model, tokenizer, "Hi", max_new_tokens=3, sampling=sampling)
    assert numpy_run.token_ids == plain_run.token_ids and len(numpy_run.token_ids[0]) == 3


@pytest.mark.parametrize("count", [np.bool_(True), True, np.float64(2.0)])
def test_a_count_that_is_no_integer_is_still_refused(count):
    with pytest.raises(ValueError, match=r"max_new_tokens=.* must be an integer >= 0"):
        StreamRequest(prompt_ids=[5], max_new_tokens=count)


def test_a_seed_that_is_no_integer_is_still_refused():
    with pytest.raises(ValueError, match=r"seed=np.float64\(3.0\) must be an integer or None"):
        SamplingOptions(do_sample=True, seed=np.float64(3.0))
