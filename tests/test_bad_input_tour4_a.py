"""Issue 67, fourth tour: settings accepted and ignored, raw library errors, messages that named
what the user never set, and a request body that held the server's event loop.

Each case the tour found is a row here: the cache's ``max_new_tokens`` and a request id are
checked as the rest of their objects are; a JSON body giving a field twice is refused (the last
value silently won); a damaged tokenizer file is named; a compiled run of a mode without a
static step names the user's setting, not a ``max_cache_len`` that ``generate`` chose; a plan
whose workload cannot fit names the workload; a quantization group names the head size it must
divide; a prompt too long for any tokenization to fit is refused before it is tokenized; and
sampling fields that greedy decoding ignores are said.
"""

from __future__ import annotations

import pytest
from conftest import byte_tokenizer, tiny_llama
from serve_support import CHAT_TEMPLATE
from test_bad_input import ERR, OK, Case, check_case, models  # noqa: F401 - models is a fixture

from alisa import AlisaCache, AlisaConfig, generate, load_model, stream_generate
from alisa.runtime.requests import StreamRequest
from alisa.runtime.sampling import SamplingOptions
from alisa.serve import ServeSettings
from alisa.serve.errors import APIError
from alisa.serve.prepare import Preparer
from alisa.serve.protocol import parse_chat, parse_completion, read_json
from alisa.settings import IgnoredSettingWarning

CASES = {
    "plan-workload-past-the-device": Case(
        "plan --model opt-13b --hardware v100-32gb --batch 100000000000",
        ERR,
        ("short by", "(for the workload --batch 100000000000, --prompt-len"),
    ),
    "quant-group-not-dividing-the-head": Case(
        "generate Hi --max-new-tokens 2 --kv-bits 8 --quant-group-size 7",
        ERR,
        ("quant_group_size=7 must divide the model's head size (16)",),
    ),
    "profile-a-model-too-short-to-calibrate": Case(
        "profile --model {short} --context 100 --output {tmp}/p.json",
        ERR,
        ("a calibration needs --context >= 130, which this model cannot hold",),
        absent=("p.json",),
        unsaid=("must be >= 130",),
    ),
    "batch-sampling-flags-without-do-sample": Case(
        "batch {tmp}/in.jsonl -o {tmp}/o.jsonl --no-progress --max-new-tokens 2 --temperature 0.5",
        OK,
        ("alisa batch: warning: --temperature ignored without --do-sample (greedy decoding)",),
        {"in.jsonl": b'{"id": "a", "prompt": "Hi"}\n'},
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_tour4_a(name, tmp_path, models, capsys, monkeypatch):  # noqa: F811
    check_case(CASES[name], tmp_path, models, capsys, monkeypatch)


def test_a_cache_checks_its_max_new_tokens():
    with pytest.raises(ValueError, match="max_new_tokens=-1 must be"):
        AlisaCache(tiny_llama(), AlisaConfig(), max_new_tokens=-1)
    with pytest.raises(ValueError, match="max_new_tokens='8' must be"):
        AlisaCache(tiny_llama(), AlisaConfig(), max_new_tokens="8")


@pytest.mark.parametrize("bad", [[1], {"a": 1}, {1, 2}])
def test_a_request_id_must_key_a_result(bad):
    """Results are told apart (and duplicates refused) by id in a dict: a list cannot be one."""
    with pytest.raises(ValueError, match="must be a string, an integer or None, not a"):
        StreamRequest(prompt_ids=[5], max_new_tokens=2, id=bad)


def test_a_json_field_given_twice_is_refused():
    with pytest.raises(APIError) as refused:
        read_json(b'{"prompt": "Hi", "max_tokens": 2, "max_tokens": 3}')
    assert refused.value.status == 400 and refused.value.param == "max_tokens"
    assert "gives the field 'max_tokens' more than once" in refused.value.message
    nested = b'{"prompt": "Hi", "alisa": {"caching_ratio": 0.2, "caching_ratio": 1}}'
    with pytest.raises(APIError, match="'caching_ratio' more than once"):
        read_json(nested)
    assert read_json(b'{"a": {"b": 1}, "b": 2}') == {"a": {"b": 1}, "b": 2}  # other levels


def test_a_damaged_tokenizer_file_is_named(tmp_path):
    tiny_llama().save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read the tokenizer saved in .*tokenizer.json"):
        load_model(str(tmp_path), dtype="float32")


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        (
            {"kv_bits": 4, "policy": "swa", "caching_ratio": 0.3, "retention": "host"},
            "kv_bits=4 with retention='host', host_bits=8 and quant_group_size=None "
            "has no static (compiled) decode step yet (kv_bits=8 over host_bits=8, one scale a "
            "row, has): run it eager",
        ),
        ({"gpu_memory": "1GB"}, "gpu_memory='1GB' has no static (compiled) decode step: its"),
        (
            {"policy": "swa", "caching_ratio": 0.5, "retention": "host", "host_bits": 4},
            "retention='host' with host_bits=4 has no static (compiled) decode step yet",
        ),
    ],
    ids=["int8", "tiers", "host"],
)
def test_compile_on_names_the_setting_without_a_static_step(fields, needle):
    """The user asked compile='on'; the max_cache_len generate chose, and the keeper's class
    name, mean nothing to them."""
    model, tokenizer = tiny_llama(), byte_tokenizer()
    with pytest.raises(ValueError) as refused:
        generate(model, tokenizer, "Hi", AlisaConfig(**fields), compile="on", max_new_tokens=2)
    assert needle in str(refused.value)
    assert "max_cache_len=" not in str(refused.value) and "Keeper" not in str(refused.value)


def test_a_prompt_no_tokenization_fits_is_refused_before_tokenizing():
    """Tokenizing runs on the server's event loop: 30 MiB of one letter held every request for
    minutes. A text longer than the context times the longest token (twice) cannot fit."""
    model, tokenizer = tiny_llama(), byte_tokenizer()  # context 2048, one byte a token
    calls = []
    original = type(tokenizer).__call__

    class Counting(type(tokenizer)):
        def __call__(self, *args, **kwargs):
            calls.append(args)
            return original(self, *args, **kwargs)

    tokenizer.__class__ = Counting
    tokenizer.chat_template = CHAT_TEMPLATE
    preparer = Preparer(model, tokenizer, ServeSettings(model_name="tiny"))
    assert preparer.max_text_chars == 2 * 2048 * preparer.longest_token
    too_long = "a" * (preparer.max_text_chars + 1)
    for parsed in (
        parse_completion({"prompt": too_long}),
        parse_chat({"messages": [{"role": "user", "content": too_long}]}),
    ):
        with pytest.raises(APIError) as refused:
            preparer.prompt_ids(parsed)
        assert refused.value.status == 400 and refused.value.code == "context_length_exceeded"
        assert "more than any tokenization of them fits in the model's context of 2048" in (
            refused.value.message
        )
    assert calls == []  # refused before the tokenizer ran
    assert len(preparer.prompt_ids(parse_completion({"prompt": "a" * 100}))) >= 1


def test_sampling_fields_greedy_decoding_ignores_are_said():
    """As HF's generate warns: temperature without do_sample is greedy, and says so."""
    model, tokenizer = tiny_llama(), byte_tokenizer()
    with pytest.warns(IgnoredSettingWarning, match="temperature=0.5 ignored without do_sample"):
        generate(
            model, tokenizer, "Hi", sampling=SamplingOptions(temperature=0.5), max_new_tokens=1
        )
    with pytest.warns(IgnoredSettingWarning, match="top_k=3, seed=1 ignored"):
        list(
            stream_generate(
                model,
                tokenizer,
                ["Hi"],
                sampling=SamplingOptions(top_k=3, seed=1),
                max_new_tokens=1,
            )
        )


def test_a_policy_that_evicts_nothing_in_this_run_is_said():
    """As ``alisa generate`` warns: a budget covering every token runs as dense."""
    model, tokenizer = tiny_llama(), byte_tokenizer()
    config = AlisaConfig(policy="swa", budget_tokens=10**9, min_budget_tokens=0)
    with pytest.warns(IgnoredSettingWarning, match="budget_tokens=1000000000 keeps all 4 tokens"):
        generate(model, tokenizer, "Hi", config, max_new_tokens=2)
