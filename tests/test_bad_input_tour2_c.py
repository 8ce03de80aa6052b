"""``alisa serve`` cases of the second bad-input tour (issue 67, cases 10-13, 17, 38, 39).

A request body the server cannot read is the client's fault: a 400 naming the field where one is
at fault, never a 500, and no traceback in the server's log (a lone surrogate, an integer past
Python's int-string limit, nesting too deep to parse, a client that hangs up mid-body). Flags no
server could run under are refused at start-up, telling the operator what to raise.
"""

from __future__ import annotations

import logging
import re
import socket

import pytest
from serve_support import HOST, request, wait_for
from test_bad_input import ERR, Case, check_case, models  # noqa: F401 - models is a fixture
from test_serve import folder, served  # noqa: F401 - module-scoped fixtures: one real server

from alisa.serve import ServeSettings
from alisa.serve.errors import APIError
from alisa.serve.protocol import read_json

SURROGATE = "lone surrogate '\\ud800'"
LONG_INTEGER = b"1" + b"0" * 5000  # 5001 digits: past Python's int-string limit of 4300
DEEP = b"[" * 100_000 + b"]" * 100_000

BAD_BODIES = {
    # name: (path, raw body, param, words in the message)
    "prompt-surrogate": (
        "/v1/completions",
        b'{"prompt": "Hi \\ud800", "max_tokens": 1}',
        "prompt",
        ("prompt holds a", SURROGATE, "character 3"),
    ),
    "prompt-list-surrogate": (
        "/v1/completions",
        b'{"prompt": ["Hi \\ud800"], "max_tokens": 1}',
        "prompt[0]",
        ("prompt[0] holds a", SURROGATE),
    ),
    "chat-content-surrogate": (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "Hi \\ud800"}], "max_tokens": 1}',
        "messages[0].content",
        ("messages[0].content holds a", SURROGATE),
    ),
    "chat-content-part-surrogate": (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
        "messages[0].content[0].text",
        ("messages[0].content[0].text holds a", "lone surrogate '\\udc00'"),
    ),
    "stop-surrogate": (
        "/v1/completions",
        b'{"prompt": "Hi", "stop": "\\ud800", "max_tokens": 1}',
        "stop",
        ("stop holds a", SURROGATE),
    ),
    "stop-list-surrogate": (
        "/v1/completions",
        b'{"prompt": "Hi", "stop": ["a", "x\\ud800"], "max_tokens": 1}',
        "stop[1]",
        ("stop[1] holds a", SURROGATE, "character 1"),
    ),
    "field-name-surrogate": (
        "/v1/completions",
        b'{"prompt": "Hi", "alisa": {"\\ud800": 1}}',
        "alisa",
        ("a field name in alisa holds a", SURROGATE),
    ),
    "max-tokens-5001-digits": (
        "/v1/completions",
        b'{"prompt": "Hi", "max_tokens": ' + LONG_INTEGER + b"}",
        "max_tokens",
        ("max_tokens is an integer of 5001 digits", "at most 4300 digits"),
    ),
    "token-id-5001-digits": (
        "/v1/completions",
        b'{"prompt": [5, 6, ' + LONG_INTEGER + b"]}",
        "prompt[2]",
        ("prompt[2] is an integer of 5001 digits",),
    ),
    "prompt-nested-100000-deep": (
        "/v1/completions",
        b'{"prompt": ' + DEEP + b"}",
        None,
        ("nests arrays or objects too deeply",),
    ),
}


@pytest.fixture
def server_log(caplog):
    """What the server logs while a test runs: uvicorn's error log (it does not propagate to
    the root logger, where caplog listens) and alisa's own, info lines included."""
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="alisa.serve")
    try:
        yield caplog
    finally:
        uvicorn_log.removeHandler(caplog.handler)


def no_tracebacks(log) -> None:
    loud = [r.getMessage() for r in log.records if r.levelno >= logging.ERROR or r.exc_info]
    assert loud == []


@pytest.mark.parametrize("name", list(BAD_BODIES))
def test_an_unreadable_body_is_a_400_naming_the_field(served, server_log, name):  # noqa: F811
    path, raw, param, words = BAD_BODIES[name]
    status, answer = request(served.port, "POST", path, raw)
    assert status == 400, answer
    error = answer["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    for word in words:
        assert word in error["message"], (word, error["message"])
    assert "Error" not in error["message"]  # no Python exception type
    no_tracebacks(server_log)


def test_an_escaped_surrogate_pair_is_text(served):  # noqa: F811
    """Only a lone half is refused: an emoji escaped as its UTF-16 pair is one character."""
    escaped = b'{"prompt": "Hi \\ud83d\\ude00", "max_tokens": 3, "temperature": 0}'
    status, answer = request(served.port, "POST", "/v1/completions", escaped)
    assert status == 200, answer
    plain = {"prompt": "Hi \U0001f600", "max_tokens": 3, "temperature": 0}
    assert request(served.port, "POST", "/v1/completions", plain)[1]["choices"] == answer["choices"]


def test_a_client_that_hangs_up_mid_body_leaves_one_info_line(served, server_log):  # noqa: F811
    with socket.create_connection((HOST, served.port)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 500\r\n\r\n{"prompt": '
        )
    said = "a client disconnected before sending its whole request body"
    wait_for(lambda: said in server_log.messages, "the server to see the client leave")
    assert [r.levelno for r in server_log.records] == [logging.INFO]
    assert request(served.port, "GET", "/health") == (200, {"status": "ok"})


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (
            b'{"alisa": {"policy": "swa", "caching_ratio": ' + LONG_INTEGER + b"}}",
            "alisa.caching_ratio",
        ),
        (b'{"seed": -' + LONG_INTEGER + b"}", "seed"),
        (
            b'{"messages": [{"role": "user", "content": "a", "name": "\\udfff"}]}',
            "messages[0].name",
        ),
        (b'{"\\ud800": 1}', None),
    ],
)
def test_read_json_names_the_field_at_any_depth(raw, param):
    with pytest.raises(APIError) as caught:
        read_json(raw)
    assert (caught.value.status, caught.value.param) == (400, param)


def test_read_json_leaves_a_clean_body_alone():
    raw = b'{"prompt": "Hi \\u00e9 \\\\ud800", "max_tokens": 12, "stop": ["\\ud83d\\ude00"]}'
    assert read_json(raw) == {"prompt": "Hi é \\ud800", "max_tokens": 12, "stop": ["😀"]}


@pytest.mark.parametrize(
    ("name", "words"),
    [("", "model_name='' must be a non-empty name"), ("\udcff", "lone surrogate '\\udcff'")],
)
def test_serve_settings_refuse_a_name_no_response_can_carry(name, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        ServeSettings(model_name=name)


NO_CLIENT_ADVICE = ("lower max_tokens", "shorten the")
CASES = {
    "serve-served-model-name-empty": Case(
        "serve --model {model} --served-model-name '' --port 0",
        ERR,
        ("--served-model-name", "model_name=''", "non-empty name"),
    ),
    "serve-served-model-name-blank": Case(
        "serve --model {model} --served-model-name '  ' --port 0",
        ERR,
        ("--served-model-name: model_name=", "non-empty name"),
    ),
    "serve-gpu-memory-below-the-weights": Case(
        "serve --model {model} --gpu-memory 1KB --port 0",
        ERR,
        (
            "--gpu-memory 1000 B cannot hold even a one-token request",
            "the model's weights alone are 545.2 KiB",
            "raise --gpu-memory",
        ),
        unsaid=NO_CLIENT_ADVICE,
    ),
    "serve-gpu-memory-only-the-weights": Case(
        "serve --model {model} --gpu-memory 560000 --port 0",
        ERR,
        ("--gpu-memory 546.9 KiB", "the model's weights are 545.2 KiB", "raise --gpu-memory"),
        unsaid=NO_CLIENT_ADVICE,
    ),
    "serve-kv-memory-1-byte": Case(
        "serve --model {model} --kv-memory 1B --port 0",
        ERR,
        ("--kv-memory 1 B cannot hold even a one-token request", "KV needs 17.5 KiB", "raise"),
        unsaid=NO_CLIENT_ADVICE,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_tour2_serve(name, tmp_path, models, capsys, monkeypatch):  # noqa: F811
    check_case(CASES[name], tmp_path, models, capsys, monkeypatch)
