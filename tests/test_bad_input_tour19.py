"""The nineteenth bad-input tour's findings (an independent tester's tour 94: T1, U1, U2, S1-S4),
each a test."""

from __future__ import annotations

import warnings

import pytest
from conftest import byte_tokenizer, tiny_llama

from alisa import AlisaCache, AlisaConfig, generate
from alisa.cli import main
from alisa.jobs.stream import stream_generate
from alisa.runtime.generate import run_notes
from alisa.runtime.sampling import SamplingOptions
from alisa.settings import IgnoredSettingWarning


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-45])
def test_a_temperature_too_small_for_float32_samples_its_limit_greedy(temperature):
    """T1, U1: a positive temperature below float32's range (1e-300 is 0 there) made the
    logits inf and the softmax NaN: torch's ``RuntimeError`` from ``multinomial`` in
    ``generate``, ``stream_generate``, the CLI and a batch row, a 500 from the server. Its limit
    is greedy decoding, which such a row now takes; other rows sample as HF does."""
    model, tokenizer = tiny_llama(), byte_tokenizer()
    prompts, run = ["hi", "there"], dict(max_new_tokens=4, stop_at_eos=False)
    greedy = generate(model, tokenizer, prompts, **run).token_ids
    sampling = SamplingOptions(do_sample=True, temperature=temperature, seed=3)
    assert generate(model, tokenizer, prompts, sampling=sampling, **run).token_ids == greedy
    streamed = {
        result.id: result.token_ids
        for result in stream_generate(model, tokenizer, prompts, sampling=sampling, **run)
    }
    assert [streamed[0], streamed[1]] == greedy


def test_an_odd_int4_group_names_the_packing_not_the_head_size():
    """U2: ``kv_bits=4, quant_group_size=1`` said "must divide the model's head size" (1
    divides 16); the reason is the packing, said when the config is built."""
    with pytest.raises(ValueError, match=r"quant_group_size=1 must be even with kv_bits=4"):
        AlisaConfig(kv_bits=4, quant_group_size=1)
    AlisaConfig(kv_bits=8, quant_group_size=1)  # one code a byte: any group
    with pytest.raises(ValueError, match=r"quant_group_size=7 must divide the model's head size"):
        AlisaCache(tiny_llama(), AlisaConfig(kv_bits=8, quant_group_size=7))


@pytest.mark.parametrize("share", [0, 0.0, -0.0])
def test_history_share_zero_without_host_retention_is_refused_as_other_values(share):
    """S1: ``history_share=0`` with ``retention='drop'`` was accepted and unread (any other
    value was refused), in Python, the CLI and a request's ``"alisa"`` settings."""
    with pytest.raises(ValueError, match=r"history_share=.*0 needs retention='host'"):
        AlisaConfig(history_share=share)
    with pytest.raises(ValueError, match=r"needs an attention-scored policy"):
        AlisaConfig(policy="local", caching_ratio=0.5, retention="host", history_share=share)
    AlisaConfig(policy="swa", caching_ratio=0.5, retention="host", history_share=share)


def test_a_stride_past_every_sequence_is_said():
    """S2: ``policy='strided'`` with a stride past every sequence kept the first token and the
    most recent ones (as ``local``), unsaid; a stride within the run says nothing."""
    model = tiny_llama()
    from alisa.model.adapter import ModelAdapter

    shape = ModelAdapter.of(model).shape
    long = AlisaConfig(policy="strided", caching_ratio=0.5, stride=10**6)
    (note,) = run_notes(model, long, shape, 355)
    assert note.startswith("stride=1000000 is at least as long as every sequence of this run")
    short = AlisaConfig(policy="strided", caching_ratio=0.5, stride=3)
    assert run_notes(model, short, shape, 355) == []


def test_a_coded_cache_larger_than_the_dense_one_warns(capsys):
    """S3: ``quant_group_size`` of 1 or 2 gave INT8/INT4 KV a scale and a zero point every value
    or two: 1.1-2.25x the dense cache's bytes, unsaid. The cache warns when built, the CLI
    prints it; the head-size group does not."""
    model = tiny_llama()
    with pytest.warns(IgnoredSettingWarning, match=r"quant_group_size=1 .* saves no memory"):
        AlisaCache(model, AlisaConfig(kv_bits=8, quant_group_size=1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", IgnoredSettingWarning)
        AlisaCache(model, AlisaConfig(kv_bits=8))


def test_plan_says_when_recompute_never_forbids_nothing(capsys):
    """S4: ``alisa plan --recompute never`` on a workload the device holds whole printed the
    plan without a word (``--host-memory`` there is said); a workload that would recompute
    does not warn."""
    plan = ["plan", "--model", "opt-13b", "--hardware", "v100-32gb", "--recompute", "never"]
    assert main([*plan, "--prompt-len", "10", "--gen-len", "10"]) == 0
    assert "--recompute never has no effect on this plan" in capsys.readouterr().err
    assert main([*plan, "--batch", "64", "--prompt-len", "1024", "--gen-len", "128"]) == 0
    assert "--recompute never" not in capsys.readouterr().err
