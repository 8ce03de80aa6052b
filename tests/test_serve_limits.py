"""``alisa serve`` at its limits: a full queue answers 503 at once, a request the KV budget can
never hold answers 400 with its size and the budget, and neither disturbs what runs."""

from __future__ import annotations

import socket
import threading

import openai
import pytest
from serve_support import (
    NAME,
    load,
    metric_values,
    model_dir,
    next_event,
    open_stream,
    request,
    running_server,
    wait_for,
)

from alisa import AlisaConfig
from alisa.jobs.sizing import running_memory
from alisa.model.adapter import model_shape
from alisa.planning.spec import model_spec
from alisa.serve import ServeSettings

ROOM = (8, 600)  # the largest (prompt, max_tokens) request the KV budget holds


@pytest.fixture(scope="module")
def tight(tmp_path_factory):
    """One row at a time, one request waiting at most, a KV budget of one ROOM-sized row."""
    model, tokenizer = load(model_dir(tmp_path_factory.mktemp("tight")))
    spec = model_spec(model, model_shape(model))
    kv = running_memory(spec, AlisaConfig(), [], [ROOM]).kv
    settings = ServeSettings(model_name=NAME, kv_bytes=kv, max_rows=1, max_queue=1)
    with running_server(model, tokenizer, settings) as served:
        yield served


def test_a_full_queue_answers_503_at_once_and_loses_nothing(tight):
    body = {"model": NAME, "prompt": "first", "max_tokens": 600, "temperature": 0}
    connection, response = open_stream(tight.port, {**body, "ignore_eos": True})
    next_event(response)  # the only row runs
    client = openai.OpenAI(base_url=tight.base_url, api_key="none", max_retries=0)
    waited = []
    second = threading.Thread(
        target=lambda: waited.append(
            client.completions.create(model=NAME, prompt="second", max_tokens=2, temperature=0)
        )
    )
    second.start()
    wait_for(lambda: metric_values(tight.port)[("alisa_requests_waiting", ())] == 1, "a wait")
    status, answer = request(tight.port, "POST", "/v1/completions", {"prompt": "third"})
    assert status == 503
    assert answer["error"]["code"] == "queue_full" and "--max-queue 1" in answer["error"]["message"]
    connection.sock.shutdown(socket.SHUT_RDWR)  # the first leaves: the waiting one runs
    connection.close()
    second.join(60)
    assert not second.is_alive() and waited[0].choices[0].finish_reason in ("stop", "length")
    assert metric_values(tight.port)[("alisa_requests_rejected_total", (("status", "503"),))] == 1


def test_a_request_the_budget_never_holds_is_a_400_with_its_size_and_the_budget(tight):
    status, answer = request(
        tight.port, "POST", "/v1/completions", {"prompt": "x" * 8, "max_tokens": 1500}
    )
    error = answer["error"]
    assert status == 400 and error["param"] == "max_tokens" and error["code"] == "exceeds_budget"
    for word in ("8 tokens", "max_tokens=1500", "KiB of KV", "--kv-memory", "even alone"):
        assert word in error["message"], (word, error["message"])
    # A prompt that alone outgrows the budget is the prompt's fault, not max_tokens'.
    status, answer = request(
        tight.port, "POST", "/v1/completions", {"prompt": "x" * 1200, "max_tokens": 1}
    )
    assert status == 400 and answer["error"]["param"] == "prompt"


def test_a_request_at_the_budget_runs(tight):
    client = openai.OpenAI(base_url=tight.base_url, api_key="none", max_retries=0)
    answer = client.completions.create(
        model=NAME, prompt="x" * ROOM[0], max_tokens=3, temperature=0
    )
    assert answer.usage.prompt_tokens == ROOM[0]
    assert answer.choices[0].finish_reason in ("stop", "length")
