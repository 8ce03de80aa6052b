"""The tenth bad-input tour's findings (docs/bad-input-tour.md, "Tenth tour"), each a test
(T1, a second SIGTERM while draining, is in tests/test_serve_cli.py)."""

from __future__ import annotations

import http.client
import json

import pytest
from conftest import byte_tokenizer, run_main, tiny_llama
from serve_support import HOST, WAIT_S, request, running_server
from transformers import DynamicCache

from alisa.jobs.runner import BatchJob, run_batch
from alisa.serve import ServeSettings


def test_profile_context_0_is_refused_as_0(tmp_path, capsys):
    """U1: ``--context 0`` was taken for "not given" and a short model's refusal named the
    default, 1024, which the user never gave."""
    model_dir = tmp_path / "llama"
    tiny_llama(max_position_embeddings=512).save_pretrained(model_dir)  # shorter than 1024
    byte_tokenizer().save_pretrained(model_dir)
    argv = ["profile", "--model", str(model_dir), "--output", str(tmp_path / "p.json")]
    code, err = run_main([*argv, "--context", "0"], capsys)
    assert code == 1 and "--context=0 must be >= " in err and "1024" not in err


def test_a_cache_factory_that_returns_nothing_is_refused(tmp_path):
    """S1: a ``cache_factory`` returning None (a forgotten ``return``) ran every batch with
    the job's own cache without a word."""
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"id": "a", "prompt": "hello", "max_new_tokens": 2}) + "\n")
    output = tmp_path / "out.jsonl"
    job = BatchJob(input=str(source), output=str(output), progress=False)
    model, tokenizer = tiny_llama(), byte_tokenizer()
    with pytest.raises(ValueError, match=r"^cache_factory returned None, not a transformers Cache"):
        run_batch(model, tokenizer, job, cache_factory=lambda: None)
    assert not output.exists()  # nothing written, and the output it made removed
    summary = run_batch(model, tokenizer, job, cache_factory=DynamicCache)
    assert summary.completed == 1


@pytest.mark.parametrize(
    ("kind", "status"),
    [
        ("text/plain", 415),
        ("application/x-www-form-urlencoded", 415),  # curl -d without -H
        ("application/json; charset=utf-8", 200),
        ("application/vnd.api+json", 200),
        (None, 200),  # no header: read as JSON
    ],
)
def test_a_body_declared_as_another_type_than_json_is_refused(kind, status):
    """S2: a JSON body sent as ``Content-Type: text/plain`` was served: a client's wrong header
    went unnoticed (FastAPI-based servers refuse it). Now a 415 naming the type."""
    body = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
    with running_server(tiny_llama(), byte_tokenizer(), ServeSettings(model_name="m")) as served:
        connection = http.client.HTTPConnection(HOST, served.port, timeout=WAIT_S)
        headers = {} if kind is None else {"Content-Type": kind}
        connection.request("POST", "/v1/completions", body=body, headers=headers)
        response = connection.getresponse()
        answer = json.loads(response.read())
        connection.close()
        assert response.status == status, answer
        if status == 415:
            error = answer["error"]
            assert error["code"] == "unsupported_media_type"
            assert error["message"].startswith(f"Content-Type {kind!r} is not JSON")
        assert request(served.port, "GET", "/health")[0] == 200  # still serving
