"""``alisa serve`` on the command line: bad flags refused before or right after the model loads
(no traceback, the flag named), a port in use, and SIGTERM draining a real server process."""

from __future__ import annotations

import http.client
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from serve_support import (
    HOST,
    WAIT_S,
    metric_values,
    model_dir,
    next_event,
    open_stream,
    request,
    wait_for,
)
from test_bad_input import (  # noqa: F401 - models is a fixture
    ERR,
    USAGE,
    Case,
    check_case,
    models,
    run_cli,
)

REPO = Path(__file__).parents[1]

CASES = {
    "serve-port-out-of-range": Case("serve --model {model} --port 70000", ERR, ("--port=70000",)),
    "serve-port-text": Case("serve --model {model} --port http", USAGE, ("--port", "http")),
    "serve-max-queue-zero": Case(
        "serve --model {model} --max-queue 0", ERR, ("--max-queue=0", ">= 1")
    ),
    "serve-max-batch-zero": Case("serve --model {model} --max-batch 0", ERR, ("--max-batch=0",)),
    "serve-max-new-tokens-zero": Case(
        "serve --model {model} --max-new-tokens 0", ERR, ("--max-new-tokens=0",)
    ),
    "serve-reserve-tokens-negative": Case(
        "serve --model {model} --reserve-tokens -1", ERR, ("--reserve-tokens=-1",)
    ),
    "serve-kv-memory-text": Case(
        "serve --model {model} --kv-memory lots", ERR, ("--kv-memory", "'lots'")
    ),
    "serve-policy-unknown": Case(
        "serve --model {model} --policy magic", ERR, ("--policy", "'magic'", "swa")
    ),
    "serve-log-level-unknown": Case(
        "serve --model {model} --log-level loud", USAGE, ("--log-level", "loud")
    ),
    "serve-host-memory-without-host-retention": Case(
        "serve --model {model} --host-memory 1GiB", ERR, ("--host-memory", "--retention host")
    ),
    "serve-host-not-an-address": Case(
        "serve --model {model} --host 256.1.1.1 --port 0",
        ERR,
        ("--host 256.1.1.1", "cannot listen"),
    ),
    "serve-model-missing": Case(
        "serve --model no/such/model/here --port 0", ERR, ("no/such/model/here",)
    ),
    "serve-kv-memory-too-small": Case(
        "serve --model {model} --kv-memory 1KiB --port 0",
        ERR,
        ("cannot hold even a one-token request", "--kv-memory 1.0 KiB"),
    ),
    "serve-max-new-tokens-past-context": Case(
        "serve --model {short} --max-new-tokens 64 --port 0",
        ERR,
        ("--max-new-tokens=64", "context of 64"),
    ),
    "serve-max-cache-len-zero": Case(
        "serve --model {model} --max-cache-len 0", ERR, ("--max-cache-len=0", ">= 1")
    ),
    "serve-compile-on-host-retention": Case(
        "serve --model {model} --compile on --retention host --policy swa --caching-ratio 0.5 "
        "--port 0",
        ERR,
        ("compile='on' with continuous batching", "retention='host'"),
    ),
    "serve-dense-layers-past-the-model": Case(
        "serve --model {model} --policy swa --caching-ratio 0.5 --dense-layers 9 --port 0",
        ERR,
        ("dense_layers=9", "2 layers"),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_serve(name, tmp_path, models, capsys, monkeypatch):  # noqa: F811
    check_case(CASES[name], tmp_path, models, capsys, monkeypatch)


def test_a_port_in_use_is_refused_before_the_model_loads(models, capsys, monkeypatch):  # noqa: F811
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        argv = ["serve", "--model", "no/such/model", "--port", str(port)]
        code, out, err = run_cli(argv, capsys, monkeypatch, None)
    assert code == ERR and "Traceback" not in err
    assert f"--port {port}: cannot listen there" in err and "no/such/model" not in err


@contextmanager
def _serve(folder: Path) -> Iterator[tuple[subprocess.Popen, int, queue.Queue]]:
    """``alisa serve`` in a process of its own on a free loopback port; its stderr lines go to
    the queue given. Killed on leaving if it is still running (a failed test)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "alisa", "serve", "--model", str(folder), "--port", "0"]
    command += ["--dtype", "float32", "--threads", "1", "--log-level", "warning"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    lines: queue.Queue = queue.Queue()
    threading.Thread(
        target=lambda: [lines.put(line) for line in process.stderr], daemon=True
    ).start()
    try:
        while not (found := re.search(rf"http://{HOST}:(\d+)/v1", lines.get(timeout=WAIT_S))):
            pass
        yield process, int(found.group(1)), lines
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(WAIT_S)


def test_sigterm_drains_running_requests_refuses_new_ones_and_exits_0(tmp_path):
    with _serve(model_dir(tmp_path)) as (process, port, lines):
        body = {"prompt": "drain", "max_tokens": 300, "temperature": 0, "ignore_eos": True}
        options = {"stream_options": {"include_usage": True}}
        connection, response = open_stream(port, {**body, **options})
        events = [next_event(response)]  # it runs
        process.send_signal(signal.SIGTERM)
        wait_for(lambda: request(port, "GET", "/health")[0] == 503, "the drain to start")
        status, answer = request(port, "POST", "/v1/completions", {"prompt": "late"})
        assert status == 503 and answer["error"]["code"] == "draining"
        while events[-1] != "[DONE]":  # the running request still gets every token
            events.append(next_event(response))
        connection.close()
        usage = json.loads(events[-2])["usage"]
        assert usage["completion_tokens"] == 300
        assert json.loads(events[-3])["choices"][0]["finish_reason"] == "length"
        assert process.wait(WAIT_S) == 0
    err = "".join(iter_lines(lines))
    assert "Traceback" not in err and "drained, stopped" in err


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_second_sigterm_stops_at_once_without_a_traceback_or_a_500(tmp_path, stream):
    """The tenth tour's T1: a second SIGTERM while draining re-raised the signal inside a
    request being cancelled: an ASGI traceback in the log and a 500 to its client (a cut
    stream). Now the server stops at once, its client gets no answer (no status, no final
    event), and the exit status is the signal's."""
    answers: queue.Queue = queue.Queue()
    body = {"prompt": "stop", "max_tokens": 2000, "temperature": 0, "ignore_eos": True}

    def ask() -> None:
        try:
            if not stream:
                answers.put(request(port, "POST", "/v1/completions", body))
                return
            _, response = open_stream(port, body)
            answers.put(("events", [next_event(response) for _ in range(10**6)]))
        except (OSError, http.client.HTTPException, AssertionError) as error:  # no answer
            answers.put(error)

    with _serve(model_dir(tmp_path)) as (process, port, lines):
        threading.Thread(target=ask, daemon=True).start()
        wait_for(lambda: metric_values(port)[("alisa_requests_running", ())] == 1, "a request")
        process.send_signal(signal.SIGTERM)
        wait_for(lambda: request(port, "GET", "/health")[0] == 503, "the drain to start")
        process.send_signal(signal.SIGTERM)
        assert process.wait(WAIT_S) == 128 + signal.SIGTERM
        answer = answers.get(timeout=WAIT_S)
    err = "".join(iter_lines(lines))
    assert not isinstance(answer, tuple), answer  # no status at all, not a 500
    assert "Traceback" not in err and "Exception in ASGI" not in err, err
    assert "stopped at once by a second SIGTERM" in err and "drained, stopped" not in err


def test_sigterm_as_soon_as_the_address_is_printed_drains_too(tmp_path):
    """A SIGTERM sent the moment the address line appears (before uvicorn took the signal
    over) stopped the process as a plain SIGTERM would, instead of draining: exit 0 now."""
    with _serve(model_dir(tmp_path)) as (process, _, lines):
        process.send_signal(signal.SIGTERM)
        assert process.wait(WAIT_S) == 0
    err = "".join(iter_lines(lines))
    assert "drained, stopped" in err and "SIGTERM" not in err.split("drains and stops")[-1]


def iter_lines(lines: queue.Queue):
    """What is left in ``lines`` (the process has exited)."""
    while True:
        try:
            yield lines.get(timeout=1)
        except queue.Empty:
            return
