"""``alisa serve`` through the real ``openai`` client against a real server on 127.0.0.1.

One server for the module (the tiny random Llama, float32, r = 1): completions, chat,
streaming, 32 concurrent streams, per-request cache settings, stop strings, a client that
leaves mid-stream, bad requests, ``/metrics``. Every answer is compared with ``alisa.generate``
of the same prompt alone, on a second copy of the model (the server's runs on its own thread).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket

import openai
import pytest
import torch
from serve_support import (
    HOST,
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

from alisa import AlisaConfig, generate
from alisa.runtime.sampling import SamplingOptions
from alisa.serve import ServeSettings

SWA = {"policy": "swa", "caching_ratio": 0.1, "min_budget_tokens": 2}
# Host retention at a floor above every row's length: it never leaves a token out.
HOST_KV = {"policy": "swa", "caching_ratio": 0.2, "retention": "host", "min_budget_tokens": 256}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return model_dir(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def served(folder):
    model, tokenizer = load(folder)
    with running_server(model, tokenizer, ServeSettings(model_name=NAME)) as served:
        yield served


@pytest.fixture(scope="module")
def reference(folder):
    """The model and tokenizer again, for answers computed alone."""
    return load(folder)


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served.base_url, api_key="none", max_retries=0)


def alone(reference, prompt: str, max_tokens: int, *, config=None, sampling=None, chat=False):
    """What ``alisa generate`` gives for ``prompt`` alone: (token ids, text, finish reason)."""
    model, tokenizer = reference
    result = generate(
        model,
        tokenizer,
        prompt,
        None if config is None else AlisaConfig(**config),
        max_new_tokens=max_tokens,
        sampling=sampling,
        chat=chat,
    )
    return result.token_ids[0], result.texts[0], result.finish_reasons[0]


def prompts(count: int, seed: int = 3) -> list[str]:
    """Seeded lowercase texts of 3 to 40 characters (one byte token each)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 41, (count,), generator=generator).tolist()
    return [
        "".join(chr(c) for c in torch.randint(97, 123, (n,), generator=generator).tolist())
        for n in lengths
    ]


def test_completion_is_token_identical_to_generate_alone(client, reference):
    answer = client.completions.create(
        model=NAME,
        prompt="The quick brown fox",
        max_tokens=6,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    tokens, text, reason = alone(reference, "The quick brown fox", 6)
    choice = answer.choices[0]
    assert (choice.token_ids, choice.text, choice.finish_reason) == (tokens, text, reason)
    assert choice.prompt_token_ids == reference[1]("The quick brown fox")["input_ids"]
    assert answer.usage.prompt_tokens == len(choice.prompt_token_ids)
    assert answer.usage.completion_tokens == len(tokens)
    assert answer.object == "text_completion" and answer.model == NAME


def test_a_prompt_of_token_ids_is_the_same_request(client, reference):
    text = client.completions.create(model=NAME, prompt="abcdef", max_tokens=4, temperature=0)
    ids = reference[1]("abcdef")["input_ids"]
    for prompt in (ids, [ids], ["abcdef"]):
        again = client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0)
        assert again.choices[0].text == text.choices[0].text


def test_chat_runs_the_template_as_generate_chat_does(client, reference):
    answer = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "Hi there"}],
        max_tokens=5,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    tokens, text, reason = alone(reference, "Hi there", 5, chat=True)
    choice = answer.choices[0]
    assert (choice.token_ids, choice.message.content, choice.finish_reason) == (
        tokens,
        text,
        reason,
    )
    assert choice.message.role == "assistant" and answer.object == "chat.completion"
    # The template's text, tokenized: "[user]Hi there[assistant]" in bytes.
    assert answer.usage.prompt_tokens == len("[user]Hi there[assistant]")


def test_streamed_chunks_add_up_to_the_answer_with_usage_last(client, reference):
    stream = client.completions.create(
        model=NAME,
        prompt="Streaming text",
        max_tokens=7,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True},
    )
    chunks = list(stream)
    tokens, text, reason = alone(reference, "Streaming text", 7)
    *answer, last = chunks
    assert "".join(c.choices[0].text for c in answer) == text
    assert [t for c in answer for t in c.choices[0].token_ids] == tokens
    assert [c.choices[0].finish_reason for c in answer] == [None] * (len(answer) - 1) + [reason]
    assert all(c.usage is None for c in answer)
    assert last.choices == [] and last.usage.completion_tokens == len(tokens)
    assert last.usage.prompt_tokens == len("Streaming text")


def test_a_chat_stream_opens_with_the_role_and_ends_with_the_reason(client, reference):
    stream = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_tokens=6,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    model, tokenizer = reference
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    prompt = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == alone(reference, prompt, 6)[1]


def test_the_raw_stream_ends_with_done(served):
    connection, response = open_stream(
        served.port, {"model": NAME, "prompt": "abc", "max_tokens": 3, "temperature": 0}
    )
    events = []
    while not events or events[-1] != "[DONE]":
        events.append(next_event(response))
    connection.close()
    assert response.getheader("Content-Type").startswith("text/event-stream")
    assert len(events) >= 2 and '"finish_reason":"' in events[-2]


def test_32_concurrent_streams_each_identical_to_its_answer_alone(served, reference):
    texts = prompts(32)
    lengths = [3 + index % 4 for index in range(32)]

    async def one(client, prompt, max_tokens):
        stream = await client.completions.create(
            model=NAME,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"return_token_ids": True},
        )
        tokens, text, reasons = [], "", []
        async for chunk in stream:
            tokens += chunk.choices[0].token_ids
            text += chunk.choices[0].text
            reasons.append(chunk.choices[0].finish_reason)
        return tokens, text, reasons[-1]

    async def all_of_them():
        client = openai.AsyncOpenAI(base_url=served.base_url, api_key="none", max_retries=0)
        async with client:
            return await asyncio.gather(*map(one, [client] * 32, texts, lengths))

    steps = metric_values(served.port)[("alisa_scheduler_steps_total", ())]
    answers = asyncio.run(all_of_them())
    after = metric_values(served.port)
    for prompt, max_tokens, answer in zip(texts, lengths, answers, strict=True):
        assert answer == alone(reference, prompt, max_tokens), prompt
    # They shared batches: far fewer steps than the tokens generated.
    generated = sum(len(tokens) for tokens, _, _ in answers)
    assert after[("alisa_scheduler_steps_total", ())] - steps < generated / 2


def test_requests_of_other_settings_run_apart_each_as_alone(served, reference):
    sampled = SamplingOptions(do_sample=True, temperature=0.8, seed=11)
    cases = [
        ({"temperature": 0}, {}),
        ({"temperature": 0, "alisa": SWA}, {"config": SWA}),
        ({"temperature": 0, "alisa": HOST_KV}, {"config": HOST_KV}),
        ({"temperature": 0.8, "seed": 11}, {"sampling": sampled}),
        ({"temperature": 0}, {}),
    ]
    prompt = "a longer prompt, so that a ratio of 0.1 evicts tokens" * 2

    async def one(client, body):
        extra = {"return_token_ids": True, **({"alisa": body["alisa"]} if "alisa" in body else {})}
        sampling = {key: value for key, value in body.items() if key != "alisa"}
        return await client.completions.create(
            model=NAME, prompt=prompt, max_tokens=8, extra_body=extra, **sampling
        )

    async def together():
        client = openai.AsyncOpenAI(base_url=served.base_url, api_key="none", max_retries=0)
        async with client:
            return await asyncio.gather(*(one(client, body) for body, _ in cases))

    answers = asyncio.run(together())
    for (body, options), answer in zip(cases, answers, strict=True):
        assert answer.choices[0].token_ids == alone(reference, prompt, 8, **options)[0], body
    # Run in the wrong batch, the SWA and sampled requests would have given the greedy answer.
    tokens = [answer.choices[0].token_ids for answer in answers]
    assert tokens[1] != tokens[0] and tokens[3] != tokens[0] and tokens[4] == tokens[0]


def test_a_stop_string_ends_the_answer_before_it(client):
    full = client.completions.create(model=NAME, prompt="stop here", max_tokens=12, temperature=0)
    text = full.choices[0].text
    # The first character after the first that appears nowhere before it: the cut is there.
    cut = next(i for i in range(1, len(text)) if text[i] != "\ufffd" and text[i] not in text[:i])
    for stream in (False, True):
        answer = client.completions.create(
            model=NAME,
            prompt="stop here",
            max_tokens=12,
            temperature=0,
            stop=[text[cut]],
            stream=stream,
        )
        chunks = list(answer) if stream else [answer]
        assert "".join(c.choices[0].text for c in chunks) == text[:cut]
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_client_that_leaves_mid_stream_is_cancelled_and_its_kv_freed(served):
    before = metric_values(served.port)
    assert before[("alisa_requests_running", ())] == 0
    body = {"model": NAME, "prompt": "leave", "max_tokens": 1500, "temperature": 0}
    connection, response = open_stream(served.port, {**body, "ignore_eos": True})
    next_event(response)  # it runs
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    cancelled = ("alisa_requests_finished_total", (("reason", "cancelled"),))
    wait_for(lambda: metric_values(served.port)[cancelled] == before[cancelled] + 1, "a cancel")
    after = metric_values(served.port)
    device = ("alisa_kv_bytes", (("tier", "device"),))
    assert after[device] == before[device] and after[("alisa_requests_running", ())] == 0
    generated = ("alisa_generation_tokens_total", ())
    assert after[generated] - before[generated] < 1500  # it did not run to its end


def test_a_client_that_leaves_before_a_whole_answer_is_cancelled_too(served):
    before = metric_values(served.port)
    connection = http.client.HTTPConnection(HOST, served.port, timeout=60)
    body = {"prompt": "wait", "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
    connection.request("POST", "/v1/completions", body=json.dumps(body).encode())
    wait_for(lambda: metric_values(served.port)[("alisa_requests_running", ())] == 1, "its run")
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    cancelled = ("alisa_requests_finished_total", (("reason", "cancelled"),))
    wait_for(lambda: metric_values(served.port)[cancelled] == before[cancelled] + 1, "a cancel")
    assert metric_values(served.port)[("alisa_kv_bytes", (("tier", "device"),))] == 0


def test_metrics_parse_and_hold_every_metric(served, client):
    # EOS ignored: all 4 tokens come, whatever ran before this test; the first step brings
    # two (the prefill's and the decode step's), so 2 gaps are timed
    client.completions.create(
        model=NAME, prompt="count me", max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    values = metric_values(served.port)
    names = {name for name, _ in values}
    for name in (
        "alisa_requests_running",
        "alisa_requests_waiting",
        "alisa_requests_paused",
        "alisa_requests_finished_total",
        "alisa_requests_rejected_total",
        "alisa_preemptions_total",
        "alisa_kv_bytes",
        "alisa_kv_budget_bytes",
        "alisa_time_to_first_token_seconds_count",
        "alisa_inter_token_latency_seconds_count",
        "alisa_request_latency_seconds_count",
        "alisa_scheduler_step_seconds_count",
        "alisa_prompt_tokens_total",
        "alisa_generation_tokens_total",
        "alisa_cache_info",
    ):
        assert name in names, name
    for reason in ("stop", "length", "cancelled", "error"):
        assert ("alisa_requests_finished_total", (("reason", reason),)) in values
    assert values[("alisa_time_to_first_token_seconds_count", ())] >= 1
    assert values[("alisa_inter_token_latency_seconds_count", ())] >= 2
    # every iteration timed: as many step times as steps, each a positive duration
    steps = values[("alisa_scheduler_steps_total", ())]
    assert values[("alisa_scheduler_step_seconds_count", ())] == steps >= 3  # 4 tokens
    assert values[("alisa_scheduler_step_seconds_sum", ())] > 0
    assert values[("alisa_kv_budget_bytes", (("budget", "kv"),))] == float("inf")
    info = next(labels for name, labels in values if name == "alisa_cache_info")
    assert ("policy", "dense") in info and ("caching_ratio", "1.0") in info
    kernels = dict(info)["kernels_run"]  # the setting ("auto") resolved on this machine
    assert dict(info)["kernels"] == "auto" and kernels.startswith(("cpu (numba)", "cuda ("))


def test_models_and_health(served, client):
    assert [model.id for model in client.models.list()] == [NAME]
    assert request(served.port, "GET", "/health") == (200, {"status": "ok"})


LONG = "x" * 2100  # 2100 byte tokens: past the tiny model's context of 2048
BAD = {
    # name: (path, body, status, param, words in the message)
    "malformed-json": ("/v1/completions", b'{"prompt": "hi",', 400, None, ("not valid JSON",)),
    "not-utf8": ("/v1/completions", b'{"prompt": "\xff"}', 400, None, ("UTF-8",)),
    "body-not-object": ("/v1/completions", b"[1, 2]", 400, None, ("JSON object", "an array")),
    "unknown-field": (
        "/v1/completions",
        {"prompt": "hi", "max_tokenz": 3},
        400,
        "max_tokenz",
        ("unknown field 'max_tokenz'", "max_tokens"),
    ),
    "prompt-missing": ("/v1/completions", {"max_tokens": 3}, 400, "prompt", ("required",)),
    "prompt-empty": ("/v1/completions", {"prompt": ""}, 400, "prompt", ("empty",)),
    "prompt-number": ("/v1/completions", {"prompt": 7}, 400, "prompt", ("prompt=7",)),
    "prompt-two": ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt", ("2 prompts",)),
    "token-past-vocab": (
        "/v1/completions",
        {"prompt": [5, 99999]},
        400,
        "prompt[1]",
        ("99999", "vocabulary of 512"),
    ),
    "token-negative": ("/v1/completions", {"prompt": [5, -1]}, 400, "prompt[1]", ("-1",)),
    "max-tokens-text": (
        "/v1/completions",
        {"prompt": "hi", "max_tokens": "many"},
        400,
        "max_tokens",
        ('max_tokens="many"', "integer"),
    ),
    "max-tokens-negative": (
        "/v1/completions",
        {"prompt": "hi", "max_tokens": -3},
        400,
        "max_tokens",
        ("max_tokens=-3", ">= 1"),
    ),
    "max-tokens-float": (
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 2.5},
        400,
        "max_tokens",
        ("max_tokens=2.5",),
    ),
    "max-tokens-huge": (
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 10**12},
        400,
        "max_tokens",
        ("max_tokens=1000000000000", "context of 2048"),
    ),
    "prompt-past-context": (
        "/v1/completions",
        {"prompt": LONG, "max_tokens": 2},
        400,
        "prompt",
        ("2100 tokens", "context of 2048", "max_position_embeddings"),
    ),
    "chat-past-context": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": LONG}]},
        400,
        "messages",
        ("context of 2048",),
    ),
    "temperature-text": (
        "/v1/completions",
        {"prompt": "hi", "temperature": "hot"},
        400,
        "temperature",
        ('temperature="hot"',),
    ),
    "temperature-negative": (
        "/v1/completions",
        {"prompt": "hi", "temperature": -1},
        400,
        "temperature",
        ("temperature=-1",),
    ),
    "top-p-above-one": (
        "/v1/completions",
        {"prompt": "hi", "top_p": 2},
        400,
        "top_p",
        ("top_p=2", "(0, 1]"),
    ),
    "seed-negative": ("/v1/completions", {"prompt": "hi", "seed": -1}, 400, "seed", ("seed=-1",)),
    "stream-text": (
        "/v1/completions",
        {"prompt": "hi", "stream": "yes"},
        400,
        "stream",
        ('stream="yes"', "true or false"),
    ),
    "stream-options-without-stream": (
        "/v1/completions",
        {"prompt": "hi", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        ("stream=true",),
    ),
    "stop-not-strings": (
        "/v1/completions",
        {"prompt": "hi", "stop": [3]},
        400,
        "stop",
        ("stop[0]=3",),
    ),
    "n-two": ("/v1/completions", {"prompt": "hi", "n": 2}, 400, "n", ("n=2", "n=1")),
    "echo": ("/v1/completions", {"prompt": "hi", "echo": True}, 400, "echo", ("echo=true",)),
    "logprobs": (
        "/v1/completions",
        {"prompt": "hi", "logprobs": 1},
        400,
        "logprobs",
        ("logprobs",),
    ),
    "best-of": ("/v1/completions", {"prompt": "hi", "best_of": 2}, 400, "best_of", ("best_of=2",)),
    "penalty": (
        "/v1/completions",
        {"prompt": "hi", "frequency_penalty": 0.5},
        400,
        "frequency_penalty",
        ("frequency_penalty=0.5", "not implemented"),
    ),
    "alisa-policy-unknown": (
        "/v1/completions",
        {"prompt": "hi", "alisa": {"policy": "magic"}},
        400,
        "alisa.policy",
        ("alisa.policy='magic'", "swa"),
    ),
    "alisa-ratio-range": (
        "/v1/completions",
        {"prompt": "hi", "alisa": {"policy": "swa", "caching_ratio": 1.5}},
        400,
        "alisa.caching_ratio",
        ("caching_ratio=1.5",),
    ),
    "alisa-budget-is-the-servers": (
        "/v1/completions",
        {"prompt": "hi", "alisa": {"gpu_memory": "1GiB"}},
        400,
        "alisa.gpu_memory",
        ("server's",),
    ),
    "alisa-dense-layers-past-the-model": (
        "/v1/completions",
        {"prompt": "hi", "alisa": {"policy": "swa", "caching_ratio": 0.5, "dense_layers": 9}},
        400,
        "alisa.dense_layers",
        ("dense_layers=9", "2 layers"),
    ),
    "alisa-not-object": (
        "/v1/completions",
        {"prompt": "hi", "alisa": "swa"},
        400,
        "alisa",
        ('alisa="swa"',),
    ),
    "model-unknown": (
        "/v1/completions",
        {"prompt": "hi", "model": "gpt-4"},
        404,
        "model",
        ("'gpt-4'", "'tiny'"),
    ),
    "messages-missing": ("/v1/chat/completions", {"model": NAME}, 400, "messages", ("required",)),
    "messages-empty": ("/v1/chat/completions", {"messages": []}, 400, "messages", ("non-empty",)),
    "message-role": (
        "/v1/chat/completions",
        {"messages": [{"role": "robot", "content": "hi"}]},
        400,
        "messages[0].role",
        ('"robot"', "user"),
    ),
    "message-content-image": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "messages[0].content[0]",
        ("text part",),
    ),
    "chat-tools": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
        400,
        "tools",
        ("tool calls are not supported",),
    ),
    "chat-prompt-field": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "prompt": "hi"},
        400,
        "prompt",
        ("unknown field 'prompt'",),
    ),
    "tokens-disagree": (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "max_completion_tokens": 4,
        },
        400,
        "max_completion_tokens",
        ("disagree",),
    ),
    "unknown-path": ("/v1/embeddings", {"input": "hi"}, 404, None, ("/v1/embeddings",)),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_requests_get_a_400_naming_the_field(served, name):
    path, body, status, param, words = BAD[name]
    got, answer = request(served.port, "POST", path, body)
    assert got == status, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    for word in words:
        assert word in error["message"], (word, error["message"])
    assert "Traceback" not in error["message"]


def test_the_wrong_method_is_a_json_405(served):
    status, answer = request(served.port, "GET", "/v1/completions")
    assert status == 405 and "GET" in answer["error"]["message"]


def test_the_openai_client_sees_a_bad_request_error(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=NAME, prompt="hi", max_tokens=-3)
    assert caught.value.body["param"] == "max_tokens"
