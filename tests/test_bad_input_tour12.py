"""The twelfth bad-input tour's findings (an independent tester's tour 80: S1, S7, S8, U1, U2,
U6), each a test."""

from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import pytest
import torch
from conftest import byte_tokenizer, run_main, saved_tiny_llama, tiny_llama
from serve_support import request, running_server

from alisa import AlisaCache, AlisaConfig
from alisa.commands.plan import weight_placement
from alisa.jobs.sizing import ring_refusal_note, running_memory
from alisa.model.adapter import model_shape
from alisa.planning.spec import model_spec
from alisa.serve import ServeSettings
from alisa.settings import IgnoredSettingWarning, unread_kernels_note

ROWS = [
    {"id": 1, "prompt": "AB", "max_new_tokens": 2},
    {"id": 2, "prompt": "ABCDEF", "max_new_tokens": 3},
]


def rows_file(tmp_path, rows=ROWS):
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return source


def saved_mistral(folder):
    """A Mistral whose 2 layers are both 16-token sliding windows, saved with the byte
    tokenizer."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_hidden_layers=2,
        num_key_value_heads=2,
        sliding_window=16,
    )
    MistralForCausalLM(config).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (
            ["--kv-bits", "8"],
            "alisa batch: warning: --residual-tokens: residual_tokens=64 keeps all",
        ),
        (
            ["--sink-tokens", "100000", "--min-budget-tokens", "0"],
            "alisa batch: warning: --sink-tokens: sink_tokens=100000 keeps all",
        ),
        ([], "alisa batch: warning: --min-budget-tokens: min_budget_tokens=64 (the default"),
    ],
)
def test_batch_warns_of_a_ring_floor_or_sinks_keeping_every_token(tmp_path, capsys, flags, said):
    """S1 (b, c): ``alisa batch`` ran INT8 KV whose ring kept every token (and a larger KV than
    16 bits), and sinks or a floor that kept every token, without the warning ``alisa
    generate`` gives; said once, for the longest row, in the command's words."""
    model_dir = saved_tiny_llama(tmp_path / "llama")
    argv = ["batch", str(rows_file(tmp_path)), "-o", str(tmp_path / "o.jsonl"), "--no-progress"]
    code, err = run_main(
        [*argv, "--model", str(model_dir), "--policy", "swa", "--caching-ratio", "0.2", *flags],
        capsys,
    )
    assert code == 0
    assert said in err and err.count(said) == 1
    assert "IgnoredSettingWarning" not in err


def test_batch_warns_of_a_policy_that_evicts_in_no_layer(tmp_path, capsys):
    """S1 (a): a model whose every layer is a sliding window keeps its windows, so the policy
    evicts in no layer; ``alisa batch`` now says it as ``alisa generate`` does."""
    model_dir = saved_mistral(tmp_path / "mistral")
    argv = ["batch", str(rows_file(tmp_path)), "-o", str(tmp_path / "o.jsonl"), "--no-progress"]
    flags = ["--policy", "swa", "--caching-ratio", "0.3", "--min-budget-tokens", "0"]
    code, err = run_main([*argv, "--model", str(model_dir), *flags], capsys)
    assert code == 0
    assert "alisa batch: warning: policy='swa' evicts in no layer of this model: all its 2" in err


def test_batch_is_quiet_when_the_settings_act(tmp_path, capsys):
    """S1: rows longer than the floor, the sinks and the ring get no warning."""
    model_dir = saved_tiny_llama(tmp_path / "llama")
    rows = [{"id": 1, "prompt": "AB" * 50, "max_new_tokens": 2}]
    argv = ["batch", str(rows_file(tmp_path, rows)), "-o", str(tmp_path / "o.jsonl")]
    flags = ["--policy", "swa", "--caching-ratio", "0.2", "--kv-bits", "8"]
    code, err = run_main([*argv, "--no-progress", "--model", str(model_dir), *flags], capsys)
    assert code == 0 and "warning" not in err


def test_run_batch_warns_from_python(tmp_path):
    """S1 (Python): ``run_batch`` gives the same notes as ``generate``, as
    :class:`IgnoredSettingWarning`."""
    from alisa.jobs.runner import BatchJob, run_batch

    job = BatchJob(
        input=str(rows_file(tmp_path)),
        output=str(tmp_path / "o.jsonl"),
        config=AlisaConfig(policy="swa", caching_ratio=0.2, kv_bits=8, min_budget_tokens=0),
        progress=False,
    )
    with pytest.warns(IgnoredSettingWarning, match=r"residual_tokens=64 keeps all \d+ tokens"):
        run_batch(tiny_llama(), byte_tokenizer(), job)


def test_reserve_tokens_above_every_rows_answer_is_warned(tmp_path, capsys):
    """S7: ``--reserve-tokens`` at or above every row's ``max_new_tokens`` admits every row
    with room for its whole answer, as without it."""
    model_dir = saved_tiny_llama(tmp_path / "llama")
    argv = ["batch", str(rows_file(tmp_path)), "--model", str(model_dir), "--no-progress"]
    code, err = run_main([*argv, "-o", str(tmp_path / "o.jsonl"), "--reserve-tokens", "3"], capsys)
    assert code == 0
    assert (
        "alisa batch: warning: --reserve-tokens 3 has no effect: no row of " in err
        and "generates more than 3 tokens (max_new_tokens)" in err
    )
    code, err = run_main([*argv, "-o", str(tmp_path / "o2.jsonl"), "--reserve-tokens", "2"], capsys)
    assert code == 0 and "--reserve-tokens" not in err  # row 2 asks for 3: it acts


def test_kernels_is_warned_only_where_no_step_reads_it():
    """S8: ``kernels`` chooses host retention's kernels and, on a CPU, every mode's store and
    slot-map kernels (so a dense CPU run reads it); on CUDA only host retention reads it."""
    drop = AlisaConfig(kernels="reference")
    assert unread_kernels_note(drop, "cpu") is None  # numba's or PyTorch's store kernels
    assert unread_kernels_note(drop, "cuda") == (
        "kernels='reference' has no effect with retention='drop' on a cuda model: there only "
        "host retention's step (retention='host') reads it; leave it at 'auto'"
    )
    host = AlisaConfig(policy="swa", caching_ratio=0.2, retention="host", kernels="reference")
    assert unread_kernels_note(host, "cuda") is None
    assert unread_kernels_note(AlisaConfig(), "cuda") is None  # auto
    with warnings.catch_warnings():
        warnings.simplefilter("error", IgnoredSettingWarning)
        AlisaCache(tiny_llama(), drop)  # a CPU: it runs PyTorch's store kernels


def test_a_batch_row_refused_under_a_ring_names_the_ring(tmp_path, capsys):
    """U2 (batch): a row refused as did_not_fit under INT8 KV whose ring keeps all its tokens
    in full precision (needing more than 16-bit KV) was told to get a larger budget only."""
    model = tiny_llama()
    spec = model_spec(model, model_shape(model))
    coded = AlisaConfig(kv_bits=8)
    prompt = len(byte_tokenizer()("ABCDEF")["input_ids"])
    need = running_memory(spec, coded, [(prompt, 3)]).kv
    dense = running_memory(spec, AlisaConfig(), [(prompt, 3)]).kv
    assert dense < need  # the ring plus the codes: more than 16 bits
    model_dir = saved_tiny_llama(tmp_path / "llama")
    rows = [ROWS[1]]
    argv = ["batch", str(rows_file(tmp_path, rows)), "-o", str(tmp_path / "o.jsonl")]
    flags = ["--kv-bits", "8", "--kv-memory", str((dense + need) // 2), "--no-progress"]
    code, err = run_main([*argv, "--model", str(model_dir), *flags], capsys)
    assert code == 3 and "did_not_fit" in err
    assert (
        f"residual_tokens=64 keeps all {prompt + 3} tokens of this row in full precision, so "
        "kv_bits=8 codes nothing: residual_tokens=0 would need" in err
    )
    assert ring_refusal_note(spec, AlisaConfig(kv_bits=8, residual_tokens=0), prompt, 3) == ""


def test_a_request_refused_under_a_ring_names_the_ring():
    """U2 (HTTP): the 400 for a request the budget never holds said "lower max_tokens or
    shorten the prompt" when the request's INT8 ring was what made it large."""
    model = tiny_llama()
    spec = model_spec(model, model_shape(model))
    shape = (2, 10)
    need = running_memory(spec, AlisaConfig(kv_bits=8), [], [shape]).kv
    dense = running_memory(spec, AlisaConfig(), [], [shape]).kv
    settings = ServeSettings(model_name="tiny", kv_bytes=(dense + need) // 2)
    with running_server(model, byte_tokenizer(), settings) as served:
        body = {"prompt": [5, 6], "max_tokens": 10}
        assert request(served.port, "POST", "/v1/completions", body)[0] == 200
        body["alisa"] = {"kv_bits": 8}
        status, answer = request(served.port, "POST", "/v1/completions", body)
    message = answer["error"]["message"]
    assert status == 400 and answer["error"]["code"] == "exceeds_budget"
    assert "residual_tokens=64 keeps all 12 tokens of this row in full precision" in message
    assert message.endswith("; or lower max_tokens or shorten the prompt")


def test_a_keeper_that_is_not_callable_is_a_type_error_naming_it():
    """U6: ``AlisaCache(model, config, keeper="x")`` failed at the first layer with
    ``'str' object is not callable``."""
    with pytest.raises(TypeError, match=r"keeper='x' must be a callable \(config, policy\)"):
        AlisaCache(tiny_llama(), AlisaConfig(), keeper="x")


@pytest.mark.parametrize(
    ("fraction", "says"),
    [
        (0.067, "layer 0 on the device, layer 1 on the host (the plan's 7 % of the weights"),
        (0.89, "layer 0 on the device, layer 1 on the host (the plan's 89 % of the weights"),
        (0.5, "layer 0 on the device, layer 1 on the host (load"),
        (0.004, "every layer resident on the device"),  # shown as 0 % above
        (1.0, "all layers on the host"),
    ],
)
def test_the_plan_s_weight_lines_agree(fraction, says):
    """U1: ``alisa plan`` said ``weights: 93 % on device, 7 % on host`` and then ``weights:
    every layer resident on the device`` (7 % of 2 layers rounds to none)."""
    spec = SimpleNamespace(num_layers=2, total_weight_bytes=10)
    assert says in weight_placement(spec, fraction)


def test_the_plan_command_s_weight_lines_agree(tmp_path, capsys):
    """U1 (CLI): a plan that streams part of the weights names a layer on the host."""
    model_dir = saved_tiny_llama(tmp_path / "llama")
    argv = ["plan", "--model", str(model_dir), "--policy", "swa", "--caching-ratio", "0.2"]
    workload = ["--gpu-memory", "1.4MB", "--batch", "64", "--prompt-len", "300"]
    from alisa.cli import main

    assert main([*argv, *workload, "--gen-len", "100"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "weights:" in line]
    assert lines[0] == "  weights: 11 % on device, 89 % on host"
    assert lines[1].startswith(
        "  weights: layer 0 on the device, layer 1 on the host (the plan's 89 % of the weights"
    )
