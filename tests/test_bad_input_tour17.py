"""The seventeenth bad-input tour's findings (an independent tester's tour 90: S1-S3, U1), each
a test (S2, a stop string in the first token, is
``tests/test_serve_units.py::test_a_stop_string_in_the_first_token_ends_the_answer_there``)."""

from __future__ import annotations

import http.client
import io
import json
import sys
from types import SimpleNamespace

import pytest
from conftest import run_main
from serve_support import NAME, load, model_dir, running_server

from alisa import StreamRequest
from alisa.serve import ServeSettings
from alisa.serve.protocol import IGNORED_HEADER, parse_completion


def test_generate_dash_reads_the_prompt_from_stdin(tmp_path, capsys, monkeypatch):
    """S1: ``alisa generate -`` took "-" as the prompt and never read the piped text."""
    folder = str(model_dir(tmp_path))
    argv = ["generate", "-", "--model", folder, "--max-new-tokens", "1", "--dtype", "float32"]
    piped = SimpleNamespace(isatty=lambda: False, buffer=io.BytesIO(b"hello there"))
    monkeypatch.setattr(sys, "stdin", piped)
    code, err = run_main(argv, capsys)
    assert code == 0 and "prompt 11 tok" in err, err
    monkeypatch.setattr(sys, "stdin", SimpleNamespace(isatty=lambda: True))
    code, err = run_main(argv, capsys)
    assert code == 1 and "the prompt '-' reads stdin, which is a terminal" in err


def test_a_requests_own_cache_settings_that_change_nothing_are_said(tmp_path_factory):
    """S3: ``"alisa": {"policy": "swa", "caching_ratio": 0.5}`` on a short prompt evicts
    nothing (the default floor keeps every token): the CLI warns; the server said nothing.
    The response's ``X-Alisa-Ignored`` header says it now, in the request's words."""
    model, tokenizer = load(model_dir(tmp_path_factory.mktemp("notes")))
    with running_server(model, tokenizer, ServeSettings(model_name=NAME)) as served:
        body = {"prompt": "hello", "max_tokens": 2, "temperature": 0}
        own = {**body, "alisa": {"policy": "swa", "caching_ratio": 0.5}}
        said = _headers(served.port, own).get(IGNORED_HEADER.lower(), "")
        assert said.startswith("alisa.min_budget_tokens=64 (the default preset's floor)"), said
        assert "evicts nothing" in said
        assert IGNORED_HEADER.lower() not in _headers(served.port, body)  # the server's own: unsaid
    assert parse_completion({"prompt": "x", "alisa": {"policy": "swa"}}).cache


def _headers(port: int, body: dict) -> dict[str, str]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        response.read()
        assert response.status == 200
        return {name.lower(): value for name, value in response.getheaders()}
    finally:
        connection.close()


def test_an_arrival_given_as_an_offset_is_told_the_range():
    """U1: ``arrival_s=-5`` was told to be "a time.perf_counter() reading taken already"."""
    message = r"arrival_s=-5 .* must be in \[0, [\d.]+\]: .*\(not an offset"
    with pytest.raises(ValueError, match=message):
        StreamRequest(prompt_ids=[1, 2], max_new_tokens=2, arrival_s=-5)
