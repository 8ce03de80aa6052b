"""A real ``alisa serve`` server on 127.0.0.1 for tests: uvicorn on a free port in a thread, the
tiny random Llama saved to a directory and loaded as a user's model is, and plain HTTP helpers
(``http.client``: raw bodies, status codes, server-sent events line by line)."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from conftest import byte_tokenizer, tiny_llama
from prometheus_client.parser import text_string_to_metric_families

from alisa import load_model
from alisa.serve import AlisaServer, ServeSettings, bind

HOST = "127.0.0.1"  # tests listen on loopback only
NAME = "tiny"
# A chat template for the byte tokenizer (it has none): roles in brackets, then the answer's.
CHAT_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
WAIT_S = 60  # the most any helper waits for the server (a loaded 2-core machine is slow)


def model_dir(root: Path) -> Path:
    """The tiny Llama and the byte tokenizer (with :data:`CHAT_TEMPLATE`) saved under ``root``,
    as a user's model directory."""
    folder = root / "tiny"
    tiny_llama().save_pretrained(folder)
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def load(folder: Path):
    """(model, tokenizer) as ``alisa serve --model folder --dtype float32`` loads them."""
    model, tokenizer = load_model(str(folder), dtype="float32")
    assert tokenizer.chat_template == CHAT_TEMPLATE
    return model, tokenizer


@dataclass(frozen=True)
class Served:
    """A running server: its address and the object serving."""

    port: int
    server: AlisaServer
    thread: threading.Thread  # the one that called server.run: where the model computes

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}/v1"


@contextmanager
def running_server(model, tokenizer, settings: ServeSettings) -> Iterator[Served]:
    """Serve ``model`` on a free loopback port in a background thread; stopped on exit."""
    server = AlisaServer(model, tokenizer, settings, log_level="warning")
    sock = bind(HOST, 0)
    thread = threading.Thread(target=server.run, args=(sock,), daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield Served(sock.getsockname()[1], server, thread)
    finally:
        server.stop()
        thread.join(WAIT_S)
        sock.close()


def request(port: int, method: str, path: str, body: bytes | dict | None = None):
    """(status, parsed JSON or text) of one request on a connection of its own."""
    connection = http.client.HTTPConnection(HOST, port, timeout=WAIT_S)
    try:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        connection.request(method, path, body=data, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        text = response.read().decode()
        kind = response.getheader("Content-Type", "")
        return response.status, json.loads(text) if "json" in kind else text
    finally:
        connection.close()


def open_stream(
    port: int, body: dict
) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A streamed completion, its response open to read line by line."""
    connection = http.client.HTTPConnection(HOST, port, timeout=WAIT_S)
    connection.request(
        "POST", "/v1/completions", body=json.dumps({**body, "stream": True}).encode()
    )
    response = connection.getresponse()
    assert response.status == 200, response.read()
    return connection, response


def next_event(response: http.client.HTTPResponse) -> str:
    """The payload of the next ``data:`` line of a server-sent event stream."""
    while True:
        line = response.fp.readline().decode()
        assert line, "the stream ended"
        if line.startswith("data: "):
            return line[len("data: ") :].strip()


def metric_values(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of ``/metrics``, parsed by prometheus_client: (name, labels) -> value."""
    status, text = request(port, "GET", "/metrics")
    assert status == 200
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def wait_for(condition, what: str = "it") -> None:
    """Poll ``condition()`` until it holds (bounded: a server that never gets there fails)."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
