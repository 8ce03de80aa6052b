"""The fifth bad-input tour's findings (docs/bad-input-tour.md, "Fifth tour"), each a test."""

from __future__ import annotations

import json
import time

import pytest
from conftest import byte_tokenizer, tiny_llama

from alisa import AlisaConfig, generate
from alisa.cli import main
from alisa.jobs.runner import BatchJob, run_batch
from alisa.runtime.requests import StreamRequest


@pytest.mark.parametrize(
    "config", [AlisaConfig(), AlisaConfig(policy="swa", caching_ratio=0.5)], ids=["dense", "swa"]
)
def test_a_one_token_prompt_compiles_its_decode_steps_only(config):
    """A one-token prompt's prefill feeds one token, as a decode step does: it runs eager
    (it lays the slots out) and the steps after it compiled, with the eager tokens."""
    model, tokenizer = tiny_llama(), byte_tokenizer()
    run = dict(max_new_tokens=3, stop_at_eos=False)
    compiled = generate(model, tokenizer, "H", config, compile="on", **run)
    eager = generate(model, tokenizer, "H", config, compile="off", **run)
    assert compiled.prompt_tokens == [1] and compiled.compile.compiled
    assert compiled.token_ids == eager.token_ids


@pytest.mark.parametrize("name", ["cache_factory", "on_step"])
def test_run_batch_callbacks_must_be_callable(tmp_path, name):
    source = tmp_path / "in.jsonl"
    source.write_text('{"id": "a", "prompt": "hi"}\n')
    job = BatchJob(input=source, output=tmp_path / "o.jsonl", max_new_tokens=2, progress=False)
    with pytest.raises(ValueError, match=rf"{name}='x' must be callable or None"):
        run_batch(tiny_llama(), byte_tokenizer(), job, **{name: "x"})
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize("arrival", [-1.0, "future"])
def test_an_arrival_not_yet_or_never_read_is_refused(arrival):
    """TTFT counts from ``arrival_s``: one before any perf_counter reading gave the machine's
    uptime as TTFT, one in the future a negative TTFT."""
    value = time.perf_counter() + 1000 if arrival == "future" else arrival
    with pytest.raises(ValueError, match=r"arrival_s=.* must be in \[0, .*\]: a time.perf_count"):
        StreamRequest(prompt_ids=[4], max_new_tokens=1, arrival_s=value)
    StreamRequest(prompt_ids=[4], max_new_tokens=1, arrival_s=time.perf_counter())


def saved_llama(tmp_path):
    from architectures import FAMILIES, build

    model_dir = tmp_path / "llama"
    build(FAMILIES["llama"]).save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    return model_dir


def test_a_batch_host_memory_refusal_quotes_the_jobs_new_tokens(tmp_path, capsys):
    """It quoted ``max_new_tokens=256`` (the cache's default) for a job of 2 new tokens. Since
    admission counts the host regions (tests/test_host_admission.py), the row is a did_not_fit
    row sized for the job's 2 new tokens, as a --kv-memory refusal is (exit 3: rows failed)."""
    model_dir = saved_llama(tmp_path)
    source = tmp_path / "in.jsonl"
    source.write_text('{"id": "a", "prompt": "hello there"}\n')
    flags = ["--policy", "swa", "--caching-ratio", "0.5", "--retention", "host"]
    code = main(
        ["batch", "--model", str(model_dir), "--no-progress", "--max-new-tokens", "2"]
        + [str(source), "-o", str(tmp_path / "o.jsonl"), *flags, "--host-memory", "1KB"]
    )
    message = capsys.readouterr().err
    assert code == 3 and "256" not in message
    assert (
        "needs about 5120 bytes of host region (retention='host'), over the host budget " in message
    )
    assert "--host-memory 1KB (1000 bytes) even alone" in message


def test_a_resume_with_other_settings_names_only_what_differs(tmp_path, capsys, monkeypatch):
    """The refusal named the model as differing (``... there, None now``: it is not loaded
    when a resume is checked) and a cache setting at its default as None."""
    model_dir = saved_llama(tmp_path)
    source = tmp_path / "in.jsonl"
    source.write_text("".join(f'{{"id": "r{i}", "prompt": "row {i}"}}\n' for i in range(2)))
    out = tmp_path / "o.jsonl"
    base = ["batch", "--model", str(model_dir), "--no-progress", "--max-new-tokens", "2"]
    assert main([*base, str(source), "-o", str(out)]) == 0
    before = out.read_bytes()
    code = main([*base, str(source), "-o", str(out), "--policy", "swa", "--caching-ratio", "0.5"])
    message = capsys.readouterr().err
    assert code == 1 and out.read_bytes() == before
    assert "cache.caching_ratio: 1.0 there, 0.5 now" in message
    assert "cache.policy: dense there, swa now" in message
    assert "model:" not in message and "None" not in message


def test_a_tokenizer_given_as_the_model_is_named_shortly():
    """``generate(tokenizer, model, ...)`` printed the tokenizer's 2.3 KB repr."""
    model, tokenizer = tiny_llama(), byte_tokenizer()
    with pytest.raises(ValueError) as refusal:
        generate(tokenizer, model, ["Hi"], max_new_tokens=2)
    message = str(refusal.value)
    assert len(message) < 300 and message.startswith("model=<")
    assert "it looks like a tokenizer: pass the model here" in message


def test_a_state_space_model_is_refused_with_alisas_reason_at_load(tmp_path):
    """A Mamba checkpoint failed at load with transformers' SDPA message (pointing the user at
    ``attn_implementation="eager"``, which would not help); now alisa's reason, as ``alisa
    plan`` gives it."""
    from transformers import MambaConfig, MambaForCausalLM

    from alisa import load_model

    config = MambaConfig(
        vocab_size=300, hidden_size=16, num_hidden_layers=2, state_size=4, intermediate_size=32
    )
    MambaForCausalLM(config).save_pretrained(tmp_path / "mamba")
    byte_tokenizer().save_pretrained(tmp_path / "mamba")
    with pytest.raises(ValueError, match=r"not supported: it has layers of kind linear_attention"):
        load_model(str(tmp_path / "mamba"))


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("static", [False, True], ids=["continuous", "static"])
def test_a_batch_row_records_the_settings_it_was_made_with(tmp_path, static):
    """S3 of the fifth tour: a row's ``settings`` held the job's ``max_new_tokens`` and
    ``chat``, not the row's own; a resume changing only ``--max-new-tokens`` was refused
    though no row read it. Rows record their own; a resume compares each done row's."""
    source, output = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    source.write_text(
        '{"id": "own", "prompt": "hi", "max_new_tokens": 3, "chat": false, "temperature": 0.5,'
        ' "do_sample": true, "seed": 1}\n{"id": "job", "prompt": "yo"}\n'
    )
    model, tokenizer = tiny_llama(), byte_tokenizer()
    job = dict(input=source, output=output, progress=False, static=static)
    run_batch(model, tokenizer, BatchJob(max_new_tokens=2, **job))
    made = {row["id"]: row["settings"] for row in _rows(output)}
    assert made["own"]["max_new_tokens"] == 3 and made["job"]["max_new_tokens"] == 2
    assert made["own"]["sampling"] == {"do_sample": True, "temperature": 0.5, "seed": 1}
    assert made["job"]["sampling"] == {} and made["job"]["chat"] is False
    # Only the row that sets its own length done: --max-new-tokens is read by no done row.
    output.write_text(json.dumps({**_rows(output)[0], "id": "own"}) + "\n")
    summary = run_batch(model, tokenizer, BatchJob(max_new_tokens=5, **job))
    assert summary.already_done == 1 and _rows(output)[1]["settings"]["max_new_tokens"] == 5
    before = output.read_bytes()
    with pytest.raises(ValueError, match=r"row id='job': max_new_tokens: 5 there, 4 now"):
        run_batch(model, tokenizer, BatchJob(max_new_tokens=4, **job))
    assert output.read_bytes() == before
