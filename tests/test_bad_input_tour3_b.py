"""Third bad-input tour, helper B: ``alisa serve``'s host flag and banner, prompts of token ids
with a bad item or none, no-op fields of the wrong JSON type, and the retrieve-model route.

HTTP cases run against one real server on loopback (:mod:`serve_support`), its model served
under a name holding slashes, as a ``--model`` directory or ``owner/name`` is by default.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from serve_support import load, model_dir, request, running_server
from test_bad_input import ERR, Case, check_case, models  # noqa: F401 - models is a fixture

from alisa.serve import ServeSettings
from alisa.serve.server import base_url

REPO = Path(__file__).parents[1]
NAME = "/models/owner/tiny"  # slashes, a leading one too: the route must take them all

# ---- the command line: --host ---------------------------------------------------------------

CASES = {
    "serve-host-empty": Case(
        "serve --model {model} --host '' --port 0",
        ERR,
        ("--host '' is empty", "127.0.0.1: this machine", "0.0.0.0: every interface"),
        unsaid=("http://",),  # refused before it listens anywhere
    ),
    "serve-host-blank": Case(
        "serve --model {model} --host '  ' --port 0", ERR, ("--host '", "' is empty")
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_serve_host(name, tmp_path, models, capsys, monkeypatch):  # noqa: F811
    check_case(CASES[name], tmp_path, models, capsys, monkeypatch)


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("127.0.0.1", "http://127.0.0.1:8000/v1"),
        ("::1", "http://[::1]:8000/v1"),
        ("::", "http://[::]:8000/v1"),
    ],
)
def test_the_address_given_to_clients_brackets_an_ipv6_host(host, url):
    assert base_url(host, 8000) == url


# ---- HTTP: the request bodies and the retrieve-model route ---------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model, tokenizer = load(model_dir(tmp_path_factory.mktemp("serve")))
    with running_server(model, tokenizer, ServeSettings(model_name=NAME)) as served:
        yield served


BAD = {
    # name: (body, param, message)
    "token-ids-float": (
        {"prompt": [5, 1.5]},
        "prompt[1]",
        "prompt[1]=1.5 must be a token id (an integer >= 0)",
    ),
    "token-ids-bool": (
        {"prompt": [5, True]},
        "prompt[1]",
        "prompt[1]=true must be a token id (an integer >= 0)",
    ),
    "token-ids-text": (
        {"prompt": [5, "a"]},
        "prompt[1]",
        'prompt[1]="a" must be a token id (an integer >= 0)',
    ),
    "token-ids-first-bool": (
        {"prompt": [True, 5]},
        "prompt[0]",
        "prompt[0]=true must be a token id (an integer >= 0)",
    ),
    "prompt-empty-list": ({"prompt": []}, "prompt", "prompt is empty"),
    "prompt-list-of-empty-string": ({"prompt": [""]}, "prompt[0]", "prompt[0] is empty"),
    "presence-penalty-string": (
        {"prompt": "hi", "presence_penalty": "0"},
        "presence_penalty",
        'presence_penalty="0" must be a number (0: penalties are not implemented)',
    ),
    "frequency-penalty-false": (
        {"prompt": "hi", "frequency_penalty": False},
        "frequency_penalty",
        "frequency_penalty=false must be a number (0: penalties are not implemented)",
    ),
    "best-of-string": (
        {"prompt": "hi", "best_of": "1"},
        "best_of",
        'best_of="1" must be a number (1: one completion per request)',
    ),
    "echo-string": (
        {"prompt": "hi", "echo": "false"},
        "echo",
        'echo="false" must be a boolean (false: the prompt is not echoed)',
    ),
}


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_prompt_or_no_op_field_is_a_400_naming_it(served, name):
    body, param, message = BAD[name]
    status, answer = request(served.port, "POST", "/v1/completions", {"model": NAME, **body})
    assert status == 400, answer
    assert answer["error"]["param"] == param
    assert answer["error"]["message"] == message


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (
            {"parallel_tool_calls": "yes"},
            "parallel_tool_calls",
            'parallel_tool_calls="yes" must be true or false',
        ),
        (
            {"response_format": "text"},
            "response_format",
            'response_format="text" must be an object ({"type": "text"}: structured output is '
            "not supported)",
        ),
    ],
)
def test_a_chat_no_op_field_of_the_wrong_type_is_told_its_type(served, body, param, message):
    messages = [{"role": "user", "content": "hi"}]
    status, answer = request(
        served.port, "POST", "/v1/chat/completions", {"messages": messages, **body}
    )
    assert status == 400, answer
    assert (answer["error"]["param"], answer["error"]["message"]) == (param, message)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"presence_penalty": 0.5}, "presence_penalty=0.5 is not supported: it must be 0"),
        ({"best_of": True}, "best_of=true must be a number"),
    ],
)
def test_a_no_op_field_of_the_right_type_but_not_the_no_op_is_still_unsupported(
    served, body, message
):
    status, answer = request(served.port, "POST", "/v1/completions", {"prompt": "hi", **body})
    assert status == 400 and answer["error"]["message"].startswith(message), answer


def test_the_no_op_values_and_token_ids_still_run(served):
    body = {"model": NAME, "prompt": [5, 6], "max_tokens": 2, "temperature": 0}
    body.update(presence_penalty=0.0, frequency_penalty=0, best_of=1, echo=False)
    status, answer = request(served.port, "POST", "/v1/completions", body)
    assert status == 200, answer
    assert answer["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}


def test_the_openai_client_retrieves_the_served_model(served):
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{served.port}/v1", api_key="none", max_retries=0
    )
    card = client.models.retrieve(NAME)  # the client escapes its slashes: %2F
    assert (card.id, card.object, card.owned_by) == (NAME, "model", "alisa")
    assert card.model_dump() == client.models.list().data[0].model_dump()


@pytest.mark.parametrize("path", ["/v1/models/gpt-4", "/v1/models/owner/tiny", "/v1/models/"])
def test_retrieving_another_model_is_an_openai_404(served, path):
    status, answer = request(served.port, "GET", path)
    assert status == 404, answer
    error = answer["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "not_found_error",
        "model_not_found",
        None,
    )
    name = path.removeprefix("/v1/models/")
    assert error["message"] == f"model={name!r} is not served here; this server serves {NAME!r}"


def test_the_openai_client_sees_not_found_for_another_model(served):
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{served.port}/v1", api_key="none", max_retries=0
    )
    with pytest.raises(openai.NotFoundError, match="gpt-4"):
        client.models.retrieve("gpt-4")
