"""The thirteenth bad-input tour's findings (an independent tester's tour 82: U1-U3, S1-S3,
T1), each a test, and the silent case found while fixing them (``alisa batch --gpu-memory
... --recompute always`` said nothing)."""

from __future__ import annotations

import http.client
import json
import logging
import socket

import pytest
from conftest import byte_tokenizer, run_main, saved_tiny_llama, tiny_llama
from serve_support import HOST, WAIT_S, running_server

from alisa import AlisaConfig, load_model
from alisa.jobs import BatchJob
from alisa.jobs.stream import stream_generate
from alisa.serve import ServeSettings
from alisa.serve.protocol import IGNORED_HEADER, parse_chat, parse_completion

ROWS = [{"id": "a", "prompt": "Hello"}, {"id": "b", "prompt": "World is", "max_new_tokens": 3}]
HOST_SWA = ["--policy", "swa", "--caching-ratio", "0.5"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(saved_tiny_llama(tmp_path_factory.mktemp("tour13")))


def _batch(tmp_path, model_dir, *flags):
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    out = tmp_path / "out.jsonl"
    argv = ["batch", str(source), "-o", str(out), "--model", model_dir, "--no-progress"]
    argv += ["--max-new-tokens", "3", *flags]
    return out, argv


@pytest.mark.parametrize(
    "flags",
    [[*HOST_SWA, "--retention", "host"], [*HOST_SWA, "--per-head"]],
    ids=["host-retention", "per-head"],
)
def test_batch_takes_gpu_memory_as_its_budget_beside_any_cache_mode(
    tmp_path, model_dir, capsys, flags
):
    """U1, U2: ``--gpu-memory`` sizes ``alisa batch``'s batches; the config's tier rules
    (host retention or per-head selection cannot be tiered) refused it, naming a tier planner
    the command never runs. It runs, as ``run_batch`` does from Python."""
    out, argv = _batch(tmp_path, model_dir, "--gpu-memory", "1GB", *flags)
    code, err = run_main(argv, capsys)
    assert code == 0, err
    assert "tier" not in err and "batches sized to fit" in err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(row["id"] for row in rows if "text" in row) == ["a", "b"]


def test_batch_says_tier_flags_do_nothing_under_its_gpu_memory(tmp_path, model_dir, capsys):
    """Found beside U1: with ``--gpu-memory`` the config was tiered until the command took the
    budget back, so ``--recompute always`` was accepted without a word."""
    out, argv = _batch(tmp_path, model_dir, "--gpu-memory", "1GB", "--recompute", "always")
    code, err = run_main(argv, capsys)
    assert code == 0, err
    assert (
        "alisa batch: warning: --recompute: recompute='always' has no effect in alisa batch, "
        "which sizes its batches to --gpu-memory and never splits a cache into device/host "
        "tiers"
    ) in err


def test_serve_takes_gpu_memory_as_its_budget_beside_host_retention(model_dir, capsys):
    """U3: ``alisa serve --gpu-memory 1GB --retention host`` was refused with the tier
    planner's message; its settings are accepted now, so the command reaches its next check
    (a port in use, refused before the model loads)."""
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        argv = ["serve", "--model", model_dir, "--gpu-memory", "1GB", "--retention", "host"]
        code, err = run_main([*argv, *HOST_SWA, "--port", str(port)], capsys)
    assert code == 1 and f"--port {port}: cannot listen there" in err and "tier" not in err


@pytest.mark.parametrize(
    ("build", "runner"),
    [
        (
            lambda: BatchJob(
                input="in.jsonl",
                output="out.jsonl",
                gpu_memory="1GB",
                config=AlisaConfig(gpu_memory="2GB"),
            ),
            "a batch job sizes its batches to BatchJob(gpu_memory=...)",
        ),
        (
            lambda: ServeSettings(model_name="m", config=AlisaConfig(gpu_memory="2GB")),
            "a server sizes its batches to device_bytes (--gpu-memory)",
        ),
        (
            lambda: next(
                stream_generate(
                    tiny_llama(), byte_tokenizer(), ["hi"], AlisaConfig(gpu_memory="2GB")
                )
            ),
            "stream_generate sizes its batches to stream_generate(gpu_memory=...)",
        ),
    ],
    ids=["batch-job", "serve-settings", "stream-generate"],
)
def test_a_config_gpu_memory_beside_a_batch_budget_is_refused(build, runner):
    """S1: ``BatchJob(gpu_memory="1GB", config=AlisaConfig(gpu_memory="2GB"))`` ran on 1 GB
    without a word; every runner that sizes batches to its own budget refuses the config's,
    one rule (:func:`alisa.settings.check_untiered`)."""
    with pytest.raises(ValueError) as refused:
        build()
    message = str(refused.value)
    assert message.startswith("config.gpu_memory='2GB': " + runner)
    assert message.endswith("and leave the config's gpu_memory unset")


@pytest.mark.parametrize(
    ("fields", "ignored"),
    [
        ({"temperature": 0, "top_p": 0.5}, ("top_p",)),
        ({"temperature": 0, "seed": 5}, ("seed",)),
        ({"temperature": 0, "top_k": 3, "top_p": 0.9, "seed": 1}, ("top_p", "top_k", "seed")),
        ({"temperature": 0, "top_p": 1, "top_k": -1}, ()),  # no limit either way
        ({"temperature": 0.7, "top_p": 0.5, "seed": 5}, ()),
        ({"top_p": 0.5}, ()),
    ],
)
def test_sampling_fields_greedy_decoding_ignores_are_named(fields, ignored):
    """S2, S3: at ``temperature`` 0 (greedy) ``top_p``, ``top_k`` and ``seed`` change nothing:
    accepted (OpenAI's API and vLLM accept them; lm-evaluation-harness sends a seed), and
    named in the parsed request."""
    assert parse_completion({"prompt": "x", **fields}).ignored == ignored
    chat = {"messages": [{"role": "user", "content": "x"}], **fields}
    assert parse_chat(chat).ignored == ignored


def _post(port: int, body: dict) -> http.client.HTTPResponse:
    connection = http.client.HTTPConnection(HOST, port, timeout=WAIT_S)
    connection.request("POST", "/v1/completions", body=json.dumps(body).encode())
    response = connection.getresponse()
    response.read()
    connection.close()
    return response


def test_the_server_says_which_sampling_fields_changed_nothing(caplog):
    """S2, S3: the answer is greedy's, its ``X-Alisa-Ignored`` header names the fields, and the
    server's log says each field once (a client such as lm-evaluation-harness sends its seed
    with every request)."""
    model = tiny_llama()
    with (
        caplog.at_level(logging.WARNING, logger="alisa.serve"),
        running_server(model, byte_tokenizer(), ServeSettings(model_name="m")) as served,
    ):
        greedy = _post(served.port, {"prompt": "Hi", "max_tokens": 2, "temperature": 0})
        first = _post(
            served.port,
            {"prompt": "Hi", "max_tokens": 2, "temperature": 0, "top_p": 0.5, "seed": 5},
        )
        again = _post(served.port, {"prompt": "Hi", "max_tokens": 2, "temperature": 0, "seed": 6})
    assert greedy.status == first.status == again.status == 200
    assert greedy.getheader(IGNORED_HEADER) is None
    said = "top_p, seed: no effect at temperature=0 (greedy decoding)"
    assert first.getheader(IGNORED_HEADER) == said
    assert again.getheader(IGNORED_HEADER) == "seed: no effect at temperature=0 (greedy decoding)"
    logged = [r.getMessage() for r in caplog.records if "no effect at temperature=0" in r.message]
    assert logged == [
        f"a request set {said}; said once per field here, and in every response's "
        f"{IGNORED_HEADER} header"
    ]


def test_an_attention_implementation_that_cannot_load_is_a_value_error(model_dir):
    """T1: ``attn_implementation="flash_attention_2"`` without its package raised
    transformers' ``ImportError``; a ValueError naming the field and what to give instead."""
    with pytest.raises(ValueError, match=r"attn_implementation='flash_attention_2' cannot be"):
        load_model(model_dir, attn_implementation="flash_attention_2")
