"""The seventh bad-input tour's findings (docs/bad-input-tour.md, "Seventh tour"), each a test."""

from __future__ import annotations

import warnings

import pytest
from architectures import FAMILIES, build
from conftest import byte_tokenizer, tiny_llama
from serve_support import request, running_server

from alisa import AlisaCache, AlisaConfig, generate
from alisa.cli import main
from alisa.jobs.runner import BatchJob, run_batch
from alisa.runtime.requests import StreamRequest
from alisa.serve import ServeSettings
from alisa.settings import IgnoredSettingWarning

CONTEXT = 128  # a short context: the ring of residual_tokens reaches it


def saved_llama(tmp_path, **overrides):
    model_dir = tmp_path / "llama"
    build(FAMILIES["llama"]).save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    return model_dir


def test_a_ring_past_the_context_warns_once_and_holds_no_more_than_the_context():
    """S3: ``residual_tokens`` at or past the model's context keeps every token in full
    precision (``kv_bits`` codes nothing) and its ring held that many slots (750x a dense
    cache's bytes). Now the cache warns when built, naming both, and the ring is the context;
    a run shorter than the ring is warned by ``generate`` (one warning each, never both)."""
    model, tokenizer = tiny_llama(max_position_embeddings=CONTEXT), byte_tokenizer()
    past = AlisaConfig(kv_bits=8, residual_tokens=100_000)
    with pytest.warns(IgnoredSettingWarning) as caught:
        huge = generate(model, tokenizer, "Hello there", past, max_new_tokens=2)
    said = [str(w.message) for w in caught if w.category is IgnoredSettingWarning]
    assert len(said) == 1, said
    assert said[0].startswith(
        f"residual_tokens=100000 keeps every token of the model's {CONTEXT}-token context in "
        "full precision, so kv_bits=8 codes nothing"
    )
    at_context = AlisaConfig(kv_bits=8, residual_tokens=CONTEXT)
    with pytest.warns(IgnoredSettingWarning, match="codes nothing"):
        capped = generate(model, tokenizer, "Hello there", at_context, max_new_tokens=2)
    assert huge.kv_bytes == capped.kv_bytes  # the ring is the context's, not 100,000 slots
    assert huge.token_ids == capped.token_ids
    with pytest.warns(IgnoredSettingWarning, match=r"keeps all 13 tokens of each sequence in f"):
        generate(
            model,
            tokenizer,
            "Hello there",
            AlisaConfig(kv_bits=8, residual_tokens=20),
            max_new_tokens=2,
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error", IgnoredSettingWarning)  # a ring the run outgrows: quiet
        generate(
            model,
            tokenizer,
            "Hello there",
            AlisaConfig(kv_bits=8, residual_tokens=4),
            max_new_tokens=2,
        )


def test_a_ring_past_the_context_is_warned_by_the_cli_and_sized_to_it_in_a_batch(tmp_path, capsys):
    """S3 (CLI, batch): the CLI says it naming the flag; a batch sized every row's ring at the
    flag's value and refused rows as did_not_fit under a KV budget a dense row fits."""
    model_dir = saved_llama(tmp_path)
    base = ["--model", str(model_dir), "--kv-bits", "8", "--residual-tokens", "100000"]
    assert main(["generate", "Hello", *base, "--max-new-tokens", "2"]) == 0
    assert "warning: --residual-tokens: residual_tokens=100000 keeps" in capsys.readouterr().err
    source = tmp_path / "in.jsonl"
    source.write_text('{"id": 1, "prompt": "AB"}\n')
    out = tmp_path / "o.jsonl"
    argv = ["batch", str(source), "-o", str(out), *base, "--no-progress", "--max-new-tokens", "2"]
    assert main([*argv, "--kv-memory", "4MiB"]) == 0
    err = capsys.readouterr().err
    assert "alisa batch: warning: --residual-tokens: residual_tokens=100000 keeps every" in err
    assert "IgnoredSettingWarning" not in err  # said once, in the command's words
    assert '"finish_reason": "length"' in out.read_text()


def test_a_request_ring_past_the_context_is_a_400():
    """S3 (HTTP): a request's ``alisa.residual_tokens`` that codes nothing on this model is
    a 400 naming it, as other request settings that change nothing."""
    model = tiny_llama(max_position_embeddings=CONTEXT)
    with running_server(model, byte_tokenizer(), ServeSettings(model_name="tiny")) as served:
        body = {"prompt": [5, 6], "max_tokens": 2, "alisa": {"kv_bits": 8}}
        assert request(served.port, "POST", "/v1/completions", body)[0] == 200
        body["alisa"]["residual_tokens"] = 100_000
        status, answer = request(served.port, "POST", "/v1/completions", body)
        assert status == 400 and answer["error"]["param"] == "alisa.residual_tokens"
        assert "codes nothing" in answer["error"]["message"]


def test_a_static_cache_longer_than_the_context_is_refused_when_built():
    """T1: ``max_cache_len=10**12`` was accepted and the first forward asked the allocator for
    128 TB; now a ValueError naming it and the model's context."""
    model = tiny_llama(max_position_embeddings=CONTEXT)
    with pytest.raises(
        ValueError,
        match=rf"max_cache_len=1000000000000 is longer than the "
        rf"model's context of {CONTEXT} tokens \(max_position_embeddings\)",
    ):
        AlisaCache(model, AlisaConfig(), max_cache_len=10**12)
    AlisaCache(model, AlisaConfig(), max_cache_len=CONTEXT)  # the whole context: fine


def test_assisted_decoding_is_refused_with_a_value_error():
    """T2: HF's assisted decoding crops the cache: a NotImplementedError, now a ValueError
    saying which modes need a DynamicCache."""
    model, tokenizer = tiny_llama(), byte_tokenizer()
    inputs = tokenizer("Hello there Hello there", return_tensors="pt")
    with pytest.raises(ValueError, match=r"cannot be cropped .*prompt_lookup_num_tokens"):
        model.generate(
            **inputs,
            max_new_tokens=4,
            do_sample=False,
            prompt_lookup_num_tokens=2,
            past_key_values=AlisaCache(model, AlisaConfig()),
        )


def test_a_batch_flag_every_row_overrides_is_warned(tmp_path, capsys):
    """S1: ``--max-new-tokens`` did nothing without a word when every row set its own."""
    model_dir = saved_llama(tmp_path)
    source, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    source.write_text('{"id": 1, "prompt": "AB", "max_new_tokens": 2}\n')
    base = ["batch", str(source), "--model", str(model_dir), "--no-progress"]
    assert main([*base, "-o", str(out), "--max-new-tokens", "9"]) == 0
    assert "warning: --max-new-tokens 9 has no effect: every row of " in capsys.readouterr().err
    assert main([*base, "-o", str(tmp_path / "o2.jsonl")]) == 0  # not typed: nothing to say
    assert "--max-new-tokens" not in capsys.readouterr().err


def test_a_batch_output_of_stdin_s_name_is_refused(tmp_path, capsys):
    """S2: ``-o -`` wrote a file named ``-`` in the working directory."""
    source = tmp_path / "in.jsonl"
    source.write_text('{"id": 1, "prompt": "AB"}\n')
    with pytest.raises(ValueError, match=r"output='-' \(-o -\): the output must be a file"):
        BatchJob(input=source, output="-")
    code = main(["batch", str(source), "-o", "-", "--model", "smollm2-135m", "--no-progress"])
    assert code == 1
    assert "the output must be a file" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (
            ["generate", "hi", "there"],
            "alisa generate: error: unrecognized arguments: there; a "
            'prompt of several words goes in quotes (alisa generate "hi there")',
        ),
        (
            ["generate", "-hi"],
            "alisa generate: error: argument -h/--help: ignored explicit "
            "argument 'i'; a prompt that starts with '-' goes after '--'",
        ),
        (["serve", "--do-sample"], "alisa serve: error: unrecognized arguments: --do-sample"),
        (
            ["batch", "in.jsonl", "-o", "o.jsonl", "--truncate-prompt"],
            "alisa batch: error: unrecognized arguments: --truncate-prompt",
        ),
    ],
    ids=["two-words", "dash-prompt", "serve-flag", "batch-flag"],
)
def test_usage_errors_are_said_by_the_subcommand(argv, says, capsys):
    """U1, U2: an unknown argument was said by the top-level parser (``alisa: error``, its
    usage); a prompt starting with ``-`` got an error about ``--help``."""
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert says in err and f"usage: alisa {argv[0]}" in err


def test_experiment_errors_start_with_the_command_typed(tmp_path, capsys):
    """U3: ``alisa experiment`` errors began ``experiments.run: error:``."""
    config = tmp_path / "bad.toml"
    config.write_text('name = "bad"\n[sweep]\ntask = ["bogus_task"]\n')
    assert main(["experiment", "--config", str(config), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("alisa experiment: error: ") and "bogus_task" in err


def test_a_request_without_an_id_is_named_by_its_prompt():
    """U4: "of request None" could not tell which of many requests was bad."""
    with pytest.raises(
        ValueError,
        match=r"prompt_ids\[0\]=-1 of the request with no id whose "
        r"prompt_ids are \[-1, 5\] must be a token id",
    ):
        StreamRequest(prompt_ids=[-1, 5], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"prompt_ids of a request with no id is empty"):
        StreamRequest(prompt_ids=[], max_new_tokens=2)


def test_a_python_job_error_names_the_field(tmp_path):
    """U5: ``run_batch`` named only the CLI's ``--gpu-memory``."""
    source = tmp_path / "in.jsonl"
    source.write_text('{"id": 1, "prompt": "AB"}\n')
    job = BatchJob(input=source, output=tmp_path / "o.jsonl", gpu_memory="1KB", progress=False)
    with pytest.raises(ValueError, match=r"gpu_memory='1KB' \(--gpu-memory, 1000 bytes\)"):
        run_batch(tiny_llama(), byte_tokenizer(), job)
