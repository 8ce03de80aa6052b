"""The sixteenth bad-input tour's findings (an independent tester's tour 88: S1-S3, T1, U1,
U2), each a test."""

from __future__ import annotations

import argparse
import io
import sys
from types import SimpleNamespace

import pytest
from architectures import FAMILIES, build
from conftest import byte_tokenizer, tiny_llama
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from alisa import AlisaCache, AlisaConfig
from alisa.commands.generate import read_prompt
from alisa.jobs.stream import ByteBudget, stream_generate
from alisa.model.adapter import model_shape
from alisa.planning.spec import model_spec
from alisa.serve import ServeSettings
from alisa.serve.errors import APIError
from alisa.serve.metrics import ServeMetrics
from alisa.serve.protocol import parse_chat
from alisa.sizes import parse_budget, parse_bytes

HOST = AlisaConfig(policy="swa", caching_ratio=0.5, retention="host", host_memory="30KB")


def test_a_prompt_on_stdin_loses_its_byte_order_mark_as_a_prompt_file_does(monkeypatch):
    """S1: piped, ``\\ufeffhello`` kept the mark (three more prompt tokens)."""
    stdin = SimpleNamespace(isatty=lambda: False, buffer=io.BytesIO(b"\xef\xbb\xbfhello bom"))
    monkeypatch.setattr(sys, "stdin", stdin)
    args = argparse.Namespace(prompt=None, prompt_file=None)
    assert read_prompt(args) == "hello bom"


def test_metrics_carry_the_host_budget_beside_the_kv_and_device_ones():
    """S2: ``alisa_kv_budget_bytes`` listed kv and device only, where --host-memory limits
    admission."""
    settings = ServeSettings(model_name="m", config=HOST.with_overrides(host_memory="60KB"))
    assert settings.budgets == {"kv": None, "device": None, "host": 60_000}
    metrics = ServeMetrics(settings.config, settings.budgets)
    samples = {
        (sample.name, tuple(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
        for sample in family.samples
    }
    assert samples[("alisa_kv_budget_bytes", (("budget", "host"),))] == 60_000
    assert samples[("alisa_kv_budget_bytes", (("budget", "kv"),))] == float("inf")


def test_a_host_budget_on_a_model_of_sliding_layers_only_is_refused():
    """S3: Mistral with a window keeps no host region under ``retention="host"``; its
    ``--host-memory`` limited nothing, unsaid (without ``--retention host`` it was an error)."""
    model = build(FAMILIES["mistral"])
    message = r"host_memory='30KB' \(--host-memory\) has no effect: no layer of this model"
    with pytest.raises(ValueError, match=message):
        AlisaCache(model, HOST)  # generate's cache
    spec = model_spec(model, model_shape(model))
    with pytest.raises(ValueError, match=message):
        ByteBudget(spec=spec, config=HOST)  # batch, stream and serve admission
    with pytest.raises(ValueError, match=message):
        next(stream_generate(model, byte_tokenizer(), "hi", HOST))
    AlisaCache(model, HOST.with_overrides(host_memory=None))  # the mode alone runs
    AlisaCache(tiny_llama(), HOST)  # a model of full layers keeps a host region


def test_a_used_cache_given_to_another_model_is_refused_naming_its_model():
    """T1: a fresh cache given to another model was refused clearly; one already used failed
    with torch's ``cannot reshape tensor of 0 elements`` (HF's generate cut the input, no longer
    than the cache, to nothing before the first layer)."""
    model, other = tiny_llama(), tiny_llama(seed=1)
    ids = byte_tokenizer()("hello there", return_tensors="pt")
    cache = AlisaCache(model, AlisaConfig(policy="swa", caching_ratio=0.5, min_budget_tokens=0))
    model.generate(**ids, max_new_tokens=2, past_key_values=cache, do_sample=False)
    with pytest.raises(ValueError, match=r"was built for LlamaForCausalLM .* without passing"):
        other.generate(**ids, max_new_tokens=2, past_key_values=cache, do_sample=False)


@pytest.mark.parametrize("value", ["-5GiB", "0", -1])
def test_a_budget_below_one_byte_is_told_the_same_bound_whatever_its_sign(value):
    """U1: ``-5GiB`` was told ``>= 0``, and 0, given next, ``> 0``."""
    with pytest.raises(ValueError, match=r"must be a (finite number of bytes|byte size) > 0"):
        parse_budget(value, field="host_memory")
    with pytest.raises(ValueError, match=r"host_memory=.* > 0"):
        AlisaConfig(policy="swa", caching_ratio=0.5, retention="host", host_memory=value)
    if value != "0":  # a size that may be 0 still says so
        with pytest.raises(ValueError, match=r">= 0"):
            parse_bytes(value, field="size")


@pytest.mark.parametrize("key", ["content", "role"])
def test_a_chat_message_missing_a_key_is_told_it_is_required(key):
    """U2: a message without ``content`` was told ``content=null`` (nothing was sent)."""
    message = {"role": "user", "content": "hi"}
    del message[key]
    with pytest.raises(APIError) as caught:
        parse_chat({"messages": [message], "max_tokens": 2})
    assert caught.value.param == f"messages[0].{key}"
    assert caught.value.message == f"messages[0].{key} is required"
