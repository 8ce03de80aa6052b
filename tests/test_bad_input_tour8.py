"""The eighth bad-input tour's findings (docs/bad-input-tour.md, "Eighth tour"), each a test."""

from __future__ import annotations

import socket
import warnings

import pytest
import torch
from architectures import FAMILIES, build
from conftest import byte_tokenizer, run_main, tiny_llama
from serve_support import HOST, request, running_server
from transformers import LlamaConfig, LlamaForCausalLM

from alisa import AlisaCache, AlisaConfig, generate, load_model
from alisa.jobs.runner import BatchJob, run_batch
from alisa.jobs.stream import stream_generate
from alisa.runtime.sampling import SamplingOptions
from alisa.serve import ServeSettings
from alisa.settings import IgnoredSettingWarning
from alisa.sizes import parse_bytes
from alisa.threads import use_threads

HUGE = 10**23  # past 2**63: numpy's int64 cannot hold it
SAMPLED = SamplingOptions(do_sample=True, seed=1)


def saved_llama(tmp_path):
    model_dir = tmp_path / "llama"
    build(FAMILIES["llama"]).save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    return model_dir


@pytest.mark.parametrize("field", ["sink_tokens", "score_window", "min_budget_tokens"])
def test_integers_past_int64_are_refused_naming_the_field(field):
    """T1: counts of 2**63 or more passed the lower-bound check and ended in numpy's
    OverflowError inside a step (the CLI's traceback, the server's 500)."""
    with pytest.raises(ValueError, match=rf"^{field}={HUGE} is too large: give at most 2\*\*62"):
        AlisaConfig(policy="swa", caching_ratio=0.5, **{field: HUGE})
    with pytest.raises(ValueError, match=r"budget_tokens=.* is too large"):
        AlisaConfig(policy="swa", budget_tokens=HUGE)
    AlisaConfig(policy="swa", caching_ratio=0.5, **{field: 2**62})  # the largest taken


def test_huge_integers_from_the_cli_and_a_request_are_refused(tmp_path, capsys):
    """T1 (CLI, plan, HTTP): one line naming the flag, exit 1, no traceback; a 400."""
    model_dir = saved_llama(tmp_path)
    base = ["--model", str(model_dir), "--policy", "swa", "--caching-ratio", "0.5"]
    code, err = run_main(["generate", "hi", *base, "--sink-tokens", str(HUGE)], capsys)
    assert code == 1 and "Traceback" not in err
    assert f"--sink-tokens: sink_tokens={HUGE} is too large" in err
    code, err = run_main(["plan", "--model", str(model_dir), "--batch", str(HUGE)], capsys)
    assert code == 1 and f"--batch={HUGE} is too large" in err and "Traceback" not in err
    model, tokenizer = tiny_llama(), byte_tokenizer()
    with running_server(model, tokenizer, ServeSettings(model_name="m")) as served:
        body = {"model": "m", "prompt": "hi", "max_tokens": 2}
        body["alisa"] = {"policy": "swa", "caching_ratio": 0.5, "sink_tokens": HUGE}
        status, answer = request(served.port, "POST", "/v1/completions", body)
    assert status == 400 and "sink_tokens" in answer["error"]["message"], answer


def test_run_batch_with_model_and_tokenizer_swapped_says_so(tmp_path):
    """T2: an AttributeError from the tokenizer's __getattr__; now generate's message."""
    source = tmp_path / "in.jsonl"
    source.write_text('{"id": 0, "prompt": "p 0", "max_new_tokens": 2}\n')
    job = BatchJob(input=str(source), output=str(tmp_path / "out.jsonl"), progress=False)
    with pytest.raises(ValueError, match="it looks like a tokenizer: pass the model here"):
        run_batch(byte_tokenizer(), tiny_llama(), job)
    assert not (tmp_path / "out.jsonl").exists()


def test_a_model_without_its_weights_is_refused(tmp_path):
    """T3: weights on the meta device (built under torch.device("meta"), or a max_memory that
    left them on disk) were accepted, then generate raised NotImplementedError."""
    with torch.device("meta"):
        empty = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=300,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
            )
        )
    with pytest.raises(ValueError, match="parameters on the meta device: its weights are not"):
        generate(empty, byte_tokenizer(), "hello", max_new_tokens=2)
    with pytest.raises(ValueError, match="meta device"):
        AlisaCache(empty)
    model_dir = saved_llama(tmp_path)
    with pytest.raises(ValueError, match=r"max_memory=\{'cpu': '1KB'\} does not hold the model"):
        load_model(str(model_dir), max_memory={"cpu": "1KB"}, dtype="float32")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"max_memory\[0\]: no such GPU here \(no GPU\)"):
            load_model(str(model_dir), max_memory={0: "1KB"})


def test_one_prompt_sampled_twice_with_one_seed_is_warned():
    """S1: identical prompts under one seed give identical samples (each row's generator is
    seeded with it, so a row's tokens do not depend on its batch): now said, once."""
    model, tokenizer = tiny_llama(), byte_tokenizer()
    with pytest.warns(UserWarning, match=r"prompts\[2\] repeats prompts\[0\], sampled with seed"):
        out = generate(model, tokenizer, ["hi", "yo", "hi"], sampling=SAMPLED, max_new_tokens=3)
    assert out.token_ids[0] == out.token_ids[2]  # what the warning says
    with pytest.warns(UserWarning, match=r"prompts\[1\] repeats prompts\[0\]") as caught:
        results = list(
            stream_generate(model, tokenizer, ["hi"] * 3, sampling=SAMPLED, max_new_tokens=3)
        )
    assert len(results) == 3
    assert sum("repeats" in str(w.message) for w in caught) == 1  # once per stream
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no seed, or distinct prompts: nothing to say
        generate(model, tokenizer, ["hi", "hi"], max_new_tokens=2)
        generate(model, tokenizer, ["hi", "yo"], sampling=SAMPLED, max_new_tokens=2)
        unseeded = SamplingOptions(do_sample=True)
        generate(model, tokenizer, ["hi", "hi"], sampling=unseeded, max_new_tokens=2)


def test_a_right_padding_tokenizer_gives_the_rows_their_own_answers():
    """S2: a tokenizer that pads on the right (AutoTokenizer's default for many) made a batch
    decode the shorter prompts from their padding; generate now left-pads whatever it says."""
    model = tiny_llama()
    left, right = byte_tokenizer(), byte_tokenizer()
    right.padding_side = "right"
    prompts = ["hello there friend", "a"]
    alone = [generate(model, left, p, max_new_tokens=3).token_ids[0] for p in prompts]
    assert generate(model, right, prompts, max_new_tokens=3).token_ids == alone
    swa = AlisaConfig(policy="swa", caching_ratio=0.5, min_budget_tokens=0)
    assert (
        generate(model, right, prompts, swa, max_new_tokens=3).token_ids
        == generate(model, left, prompts, swa, max_new_tokens=3).token_ids
    )
    assert right.padding_side == "right"  # the user's tokenizer is not changed


@pytest.mark.parametrize("setting", [{"recompute": "never"}, {"recompute": "always"}])
def test_tier_settings_without_gpu_memory_are_warned_by_a_running_cache(setting):
    """S3: recompute (and profile) without gpu_memory were silent in Python (the CLI warns):
    AlisaConfig leaves them to its user (the planner reads them), a cache that runs says so."""
    model, tokenizer = tiny_llama(), byte_tokenizer()
    config = AlisaConfig(**setting)
    with pytest.warns(IgnoredSettingWarning, match="has no effect without gpu_memory"):
        generate(model, tokenizer, "hi", config, max_new_tokens=2)


def test_a_profile_without_gpu_memory_is_warned_by_a_running_cache(tmp_path):
    model = tiny_llama()
    with pytest.warns(IgnoredSettingWarning, match=r"^profile=.* has no effect without gpu"):
        AlisaCache(model, AlisaConfig(profile=str(tmp_path / "absent.json")))


def test_more_threads_than_cpus_is_warned_from_python():
    """S4: use_threads(1000) on a small machine was silent (the CLI warns)."""
    before = torch.get_num_threads()
    try:
        with pytest.warns(RuntimeWarning, match=r"use_threads\(1000\): 1000 threads on \d+"):
            use_threads(1000)
    finally:
        torch.set_num_threads(before)


def test_a_static_cache_shorter_than_the_prompt_is_refused_at_once():
    """S5/U1: a 6-token prefill went into a static cache of 4 (get_seq_length then said 6),
    and generate refused only mid-run, in contradictory words."""
    model, tokenizer = tiny_llama(), byte_tokenizer()
    ids = tokenizer("abcdef", return_tensors="pt")["input_ids"]
    cache = AlisaCache(model, AlisaConfig(), max_cache_len=4)
    with pytest.raises(ValueError, match="max_cache_len=4: a prompt of 6 tokens per sequence"):
        model(ids, past_key_values=cache)
    small = AlisaCache(model, AlisaConfig(), max_cache_len=8)
    with pytest.raises(ValueError, match=r"max_cache_len=8: the longest prompt \(6 tokens"):
        generate(model, tokenizer, "abcdef", max_new_tokens=5, past_key_values=small)
    assert small.get_seq_length() == 0  # refused before the prefill


def test_plan_warns_of_a_floor_that_keeps_every_token(tmp_path, capsys):
    """S6: plan kept every token under a header saying caching ratio 0.1, without a word."""
    model_dir = saved_llama(tmp_path)
    argv = ["plan", "--model", str(model_dir), "--policy", "swa", "--caching-ratio", "0.1"]
    argv += ["--min-budget-tokens", "100000", "--gpu-memory", "1GiB", "--prompt-len", "64"]
    code, err = run_main(argv, capsys)
    assert code == 0, err
    assert "alisa plan: warning: --min-budget-tokens: min_budget_tokens=100000" in err


def test_a_torn_last_output_line_cut_off_is_said(tmp_path, capsys):
    """S7: the torn last row of an interrupted run was cut off without a word."""
    model_dir = saved_llama(tmp_path)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(f'{{"id": {i}, "prompt": "p {i}"}}\n' for i in range(2)))
    argv = ["batch", str(source), "-o", str(out), "--model", str(model_dir), "--no-progress"]
    assert run_main([*argv, "--max-new-tokens", "2"], capsys)[0] == 0
    with out.open("ab") as handle:
        handle.write(b'{"id": 9, "text": "par')
    code, err = run_main([*argv, "--max-new-tokens", "2"], capsys)
    assert code == 0, err
    assert "cut off the output's torn last line (22 bytes" in err
    assert out.read_bytes().endswith(b"}\n") and out.read_text().count("\n") == 2


def test_peta_and_exa_byte_units_are_read_and_the_units_listed():
    """U2: 1EiB was "not a byte size" while the cap's own message said "4 EiB"."""
    assert parse_bytes("1EiB") == 2**60 and parse_bytes("2PB") == 2 * 1000**5
    assert parse_bytes("1pib") == 2**50 and parse_bytes("3e") == 3 * 1000**6
    with pytest.raises(ValueError, match=r"more bytes than any machine holds \(4 EiB\)"):
        parse_bytes("5EiB", field="gpu_memory")
    with pytest.raises(ValueError, match="B, KB, MB, GB, TB, PB or EB .* KiB ... EiB"):
        parse_bytes("1ZB", field="gpu_memory")


def test_a_body_declared_past_the_limit_is_refused_before_it_is_sent():
    """H1: a Content-Length of 100 GB was awaited (the connection held open)."""
    settings = ServeSettings(model_name="m")
    with running_server(tiny_llama(), byte_tokenizer(), settings) as served:
        client = socket.create_connection((HOST, served.port), timeout=10)
        with client:
            client.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 99999999999\r\n\r\n{}"
            )
            answer = b""
            while b"body_too_large" not in answer and (more := client.recv(65536)):
                answer += more  # the headers and the body may come apart
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"body_too_large" in answer
