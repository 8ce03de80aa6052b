"""Issue 67, second tour (helper A): batch rows, batch jobs and flags a new user got wrong.

Rows with a lone UTF-16 surrogate, a key given twice or a mis-cased ``"ID"`` are refused naming
the file, the line and the key, before the model is loaded; a job that is not a BatchJob, a
static job with a prefill bound, an empty output path, a negative byte size after its flag and a
``--data-dir`` that names a file are refused saying so; the default ``--max-new-tokens`` refuses
a job only when some row takes it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import test_bad_input
from conftest import byte_tokenizer, tiny_llama
from test_bad_input import ERR, FAILED, OK, ONE, Case, check_case

from alisa.checks import check_text
from alisa.cli import join_negative_sizes
from alisa.jobs import BatchJob, read_requests, run_batch
from alisa.runtime.requests import PREFILL_TOKENS
from alisa.sizes import parse_bytes
from experiments.data import data_dir

models = test_bad_input.models  # the tiny models saved, as a user's would be

# A model path that does not exist: a row refused with this model was refused before loading.
NO_MODEL = "--model {tmp}/no-such-model --no-progress"
BATCH = "batch {tmp}/in.jsonl -o {tmp}/o.jsonl --no-progress"
SURROGATE_PROMPT = b'{"id": "a", "prompt": "Hi \\ud800"}\n'  # a JSON escape without its pair
SURROGATE_ID = b'{"id": "\\ud800", "prompt": "Hi"}\n'
OWN_TOKENS = b'{"id": "a", "prompt": "Hi", "max_new_tokens": 2}\n'
TWO_TOKENS_B = b'{"id": "b", "prompt": "Yo", "max_new_tokens": 2}\n'
SMOKE = "experiment --config {repo}/experiments/configs/smoke.toml"

CASES = {
    # 1: a row's prompt that no tokenizer can encode
    "row-prompt-lone-surrogate": Case(
        "batch {tmp}/in.jsonl -o {tmp}/o.jsonl " + NO_MODEL,
        ERR,
        ("in.jsonl:1: 'prompt' holds a lone surrogate '\\ud800' at character 3", "(id 'a')"),
        {"in.jsonl": SURROGATE_PROMPT},
        absent=("o.jsonl",),
        unsaid=("no-such-model",),
    ),
    # 42: a row's id that no UTF-8 output can hold
    "row-id-lone-surrogate": Case(
        "batch {tmp}/in.jsonl -o {tmp}/o.jsonl " + NO_MODEL,
        ERR,
        ("in.jsonl:1: 'id' holds a lone surrogate '\\ud800' at character 0", "not valid Unicode"),
        {"in.jsonl": SURROGATE_ID},
        absent=("o.jsonl",),
        unsaid=("no-such-model", "codec"),
    ),
    # 15: a key given twice would silently lose one value
    "row-key-given-twice": Case(
        "batch {tmp}/in.jsonl -o {tmp}/o.jsonl " + NO_MODEL,
        ERR,
        ("in.jsonl:2: key 'prompt' given twice (id 'b')",),
        {"in.jsonl": ONE + b'{"id": "b", "prompt": "Hi", "prompt": "Yo", "max_new_tokens": 2}\n'},
        absent=("o.jsonl",),
    ),
    # 34: "ID" for "id"
    "row-id-upper-case": Case(
        "batch {tmp}/in.jsonl -o {tmp}/o.jsonl " + NO_MODEL,
        ERR,
        ("in.jsonl:1: missing 'id'", "'ID' is an unknown key", "case-sensitive"),
        {"in.jsonl": b'{"ID": "a", "prompt": "Hi"}\n'},
        absent=("o.jsonl",),
        unsaid=("got None",),
    ),
    "row-prompt-upper-case": Case(
        "batch {tmp}/in.jsonl -o {tmp}/o.jsonl " + NO_MODEL,
        ERR,
        ("in.jsonl:1: missing or empty 'prompt' for id 'a'", "'Prompt' is an unknown key"),
        {"in.jsonl": b'{"id": "a", "Prompt": "Hi"}\n'},
        absent=("o.jsonl",),
    ),
    # 16: static batches never read --prefill-tokens
    "static-prefill-tokens": Case(
        BATCH + " --static --prefill-tokens 8",
        ERR,
        ("--prefill-tokens", "prefill_tokens=8 applies to continuous batching"),
        {"in.jsonl": ONE},
        absent=("o.jsonl",),
    ),
    "static-prefill-tokens-default": Case(
        BATCH + f" --static --prefill-tokens {PREFILL_TOKENS} --max-new-tokens 2",
        OK,
        ('"id": "a"',),
        {"in.jsonl": ONE},
    ),
    # 32: a negative byte size after its flag reaches the size check
    "gpu-memory-negative": Case(
        "generate hi --gpu-memory -5GB",
        ERR,
        ("--gpu-memory", "gpu_memory='-5GB' must be a byte size > 0"),
        unsaid=("expected one argument",),
    ),
    "host-memory-negative": Case(
        "generate hi --retention host --host-memory -1.5KiB",
        ERR,
        ("--host-memory", "host_memory='-1.5KiB' must be a byte size > 0"),
    ),
    "kv-memory-negative": Case(
        BATCH + " --kv-memory -1",
        ERR,
        ("--kv-memory='-1' must be a byte size > 0",),
        {"in.jsonl": ONE},
    ),
    # 35: an empty output path is not a directory
    "output-empty": Case(
        "batch {tmp}/in.jsonl -o '' --no-progress",
        ERR,
        ("-o/--output: output='' is empty; give a file path",),
        {"in.jsonl": ONE},
        unsaid=("directory",),
    ),
    "input-empty": Case(
        "batch '' -o {tmp}/o.jsonl --no-progress",
        ERR,
        ("input='' is empty", "'-' for stdin"),
        absent=("o.jsonl",),
    ),
    # 37: every row sets its own max_new_tokens: the default of 64 applies to none
    "short-model-rows-with-their-own-tokens": Case(
        BATCH + " --model {short}",
        OK,
        ('"id": "a"', '"id": "b"'),
        {"in.jsonl": OWN_TOKENS + TWO_TOKENS_B},
        unsaid=("--max-new-tokens",),
    ),
    # 36: a row past the context fails alone, as with an explicit --max-new-tokens
    "short-model-row-past-the-context": Case(
        BATCH + " --model {short}",
        FAILED,
        ("in.jsonl:1: id 'a' context_exceeded", "max_new_tokens=500", '"id": "b"'),
        {"in.jsonl": OWN_TOKENS.replace(b"2}", b"500}") + TWO_TOKENS_B},
    ),
    "short-model-a-row-takes-the-default": Case(
        BATCH + " --model {short}",
        ERR,
        ("--max-new-tokens=64 leaves no room", "1 row(s) set no max_new_tokens", "line 2, id 'b'"),
        {"in.jsonl": OWN_TOKENS + b'{"id": "b", "prompt": "Yo"}\n'},
        absent=("o.jsonl",),
    ),
    # 40: profile --output ''
    "profile-output-empty": Case(
        "profile --model none --output ''", ERR, ("--output '' is empty; give a file path",)
    ),
    # 41: --data-dir naming a file
    "experiment-data-dir-is-a-file": Case(
        SMOKE + " --data-dir {tmp}/notjson.json --set runtime.results_dir='{tmp}/results'",
        ERR,
        ("data directory", "notjson.json' is a file, not a directory", "--data-dir"),
        {"notjson.json": b"{}\n"},
        absent=("results",),
        unsaid=("does not exist",),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_tour2_a(name, tmp_path, models, capsys, monkeypatch):
    check_case(CASES[name], tmp_path, models, capsys, monkeypatch)


# 4, 5: run_batch with something that is not a BatchJob
@pytest.mark.parametrize("job", [None, {"input": "in.jsonl", "output": "out.jsonl"}])
def test_run_batch_refuses_a_job_that_is_not_a_batchjob(job):
    with pytest.raises(ValueError, match=r"job=.* must be a BatchJob, e\.g\. BatchJob\(input="):
        run_batch(tiny_llama(), byte_tokenizer(), job)


# 27: static batches never read prefill_tokens
def test_a_static_job_refuses_a_prefill_bound(tmp_path):
    paths = {"input": str(tmp_path / "in.jsonl"), "output": str(tmp_path / "out.jsonl")}
    with pytest.raises(ValueError, match="prefill_tokens=5 applies to continuous batching"):
        BatchJob(**paths, static=True, prefill_tokens=5)
    assert BatchJob(**paths, static=True).prefill_tokens == PREFILL_TOKENS  # the default
    assert BatchJob(**paths, static=True, prefill_tokens=None).static  # no bound: as static is
    assert BatchJob(**paths, prefill_tokens=5).prefill_tokens == 5  # continuous reads it


# 49: BatchJob(output="")
@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"input": "in.jsonl", "output": ""}, "output='' is empty; give a file path"),
        ({"input": "", "output": "out.jsonl"}, "input='' is empty; give a JSONL file path"),
    ],
)
def test_a_job_refuses_an_empty_path(fields, message):
    with pytest.raises(ValueError, match=message):
        BatchJob(**fields)


def test_check_text_names_the_field_the_surrogate_and_its_place():
    check_text("Hi \U0001f600", "prompts[0]")  # a pair, decoded: one valid character
    with pytest.raises(ValueError, match=r"prompts\[0\] holds a lone surrogate '\\udc80' at char"):
        check_text("Hi \udc80", "prompts[0]")


def test_a_row_with_a_surrogate_pair_escape_is_valid_text(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_bytes(b'{"id": "\\ud83d\\ude00", "prompt": "Hi \\ud83d\\ude00"}\n')
    (request,) = read_requests(source)
    assert request.id == "\U0001f600" and request.prompt == "Hi \U0001f600"


def test_a_key_given_twice_in_a_nested_object_is_named(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"id": 7, "prompt": "Hi"})[:-1] + ', "x": {"k": 1, "k": 2}}\n')
    with pytest.raises(ValueError, match=r"in\.jsonl:1: key 'k' given twice \(id 7\)"):
        read_requests(source)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["generate", "--gpu-memory", "-5GB"], ["generate", "--gpu-memory=-5GB"]),
        (["batch", "i", "--kv-memory", "-.5"], ["batch", "i", "--kv-memory=-.5"]),
        (["generate", "--gpu-memory", "-x"], ["generate", "--gpu-memory", "-x"]),  # a flag
        (["generate", "--threads", "-5GB"], ["generate", "--threads", "-5GB"]),  # not a size
        (["generate", "--", "--gpu-memory", "-5GB"], ["generate", "--", "--gpu-memory", "-5GB"]),
    ],
)
def test_join_negative_sizes(argv, expected):
    assert join_negative_sizes(argv) == expected


@pytest.mark.parametrize("value", ["-5GB", "-1", " -0.5 KiB"])
def test_a_negative_byte_size_text_says_it_must_be_at_least_zero(value):
    with pytest.raises(ValueError, match=r"gpu_memory='.*' must be a byte size >= 0"):
        parse_bytes(value, field="gpu_memory")


def test_data_dir_names_a_file_given_for_a_directory(tmp_path: Path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="'.*notes.txt' is a file, not a directory"):
        data_dir(tmp_path / "notes.txt")
    with pytest.raises(ValueError, match="'.*none' does not exist"):
        data_dir(tmp_path / "none")
