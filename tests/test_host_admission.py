"""``host_memory`` under continuous batching: admission counts the host regions of
``retention="host"`` over the running rows (``alisa batch``, ``stream_generate``, ``alisa serve``),
as it counts device and KV bytes, so the budget holds whatever joins the batch."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import byte_tokenizer, run_main, saved_tiny_llama, tiny_llama
from serve_support import NAME, load, model_dir, request, running_server
from test_continuous import prompts, requests

from alisa import AlisaCache, AlisaConfig
from alisa.jobs.runner import BatchJob
from alisa.jobs.sizing import rows_host, running_memory
from alisa.jobs.stream import ByteBudget, stream_generate
from alisa.model.adapter import model_shape
from alisa.planning.spec import model_spec
from alisa.runtime.continuous import ContinuousScheduler
from alisa.runtime.engine import DecodeState, Engine
from alisa.serve import ServeSettings
from alisa.sizes import format_bytes

HOST = AlisaConfig(policy="swa", caching_ratio=0.5, retention="host")


def spec_of(model):
    return model_spec(model, model_shape(model))


def with_host(config: AlisaConfig, budget: int) -> AlisaConfig:
    return config.with_overrides(host_memory=budget)


@pytest.mark.parametrize("rows", [1, 3])
def test_the_prediction_is_what_the_cache_checks_for_itself(rows):
    """``rows_host`` and ``AlisaCache``'s own check (``generate``'s) count one formula: the
    cache takes a batch at exactly the predicted bytes and refuses it one byte lower."""
    model = tiny_llama()
    need = rows_host(spec_of(model), HOST, [(20, 8)] * rows)
    assert need > 0 and rows_host(spec_of(model), AlisaConfig(), [(20, 8)] * rows) == 0
    ids = torch.tensor(prompts((20,) * rows))
    engine = Engine(model, byte_tokenizer(), stop_at_eos=False)
    with torch.inference_mode():
        cache = AlisaCache(model, with_host(HOST, need), max_new_tokens=8)
        engine.run(DecodeState.start(ids), cache, 8)
        assert 0 < cache.tier_bytes()["host"] <= need
        with pytest.raises(ValueError, match=r"host_memory=\d+ \(--host-memory"):
            engine.run(
                DecodeState.start(ids),
                AlisaCache(model, with_host(HOST, need - 1), max_new_tokens=8),
                8,
            )


def test_admission_keeps_the_host_regions_within_host_memory():
    """Rows join a running batch only while the host regions of all of them, each at its full
    length, fit ``host_memory``: the budget holds at every step, rows still share batches."""
    model = tiny_llama()
    spec = spec_of(model)
    lengths, new_tokens = (90, 12, 60, 33, 120, 8, 75, 40), (30, 50, 20, 44, 16, 60, 25, 36)
    budget = rows_host(spec, HOST, [(120, 60)] * 3)  # about three of the longest rows
    admission = ByteBudget(spec=spec, config=with_host(HOST, budget))
    assert admission.host_bytes == budget and admission.cache_config.host_memory is None
    engine = Engine(model, byte_tokenizer(), stop_at_eos=False)
    scheduler = ContinuousScheduler(
        engine, lambda: AlisaCache(model, admission.cache_config), admission
    )
    for item in requests(prompts(lengths), new_tokens):
        scheduler.submit(item)
    finished, widest, peak = [], 0, 0
    while not scheduler.idle:
        finished += scheduler.step()
        rows = [(len(row.request.prompt_ids), row.request.max_new_tokens) for row in scheduler.rows]
        held = scheduler.cache.tier_bytes()["host"] if scheduler.cache is not None else 0
        assert held <= rows_host(spec, HOST, rows) <= budget
        widest, peak = max(widest, len(rows)), max(peak, held)
    assert 2 <= widest < len(lengths) and peak > 0
    assert [len(r.token_ids) for r in sorted(finished, key=lambda r: r.id)] == list(new_tokens)


def test_a_stream_row_over_host_memory_alone_is_reported_and_the_others_run():
    model = tiny_llama()
    budget = rows_host(spec_of(model), HOST, [(20, 8)])
    config = with_host(HOST, budget)
    texts = ["x" * 10, "y" * 200, "z" * 12]
    stream = stream_generate(model, byte_tokenizer(), texts, config, max_new_tokens=8)
    results = {r.id: r for r in stream}
    assert [results[i].finish_reason for i in range(3)] == ["length", "did_not_fit", "length"]
    error = results[1].error
    assert "of host region (retention='host'), over the host budget" in error
    assert f"config.host_memory={budget!r} ({budget} bytes)" in error


def test_reserve_tokens_beside_host_memory_is_refused_where_batches_are_admitted(tmp_path, capsys):
    """Rows that outgrow ``reserve_tokens`` are paused in host memory, which no budget counts."""
    config = with_host(HOST, "1MB")
    message = r"reserve_tokens=4 \(--reserve-tokens\) pauses rows .* host_memory='1MB'"
    with pytest.raises(ValueError, match=message):
        BatchJob(input="in.jsonl", output="out.jsonl", config=config, reserve_tokens=4)
    with pytest.raises(ValueError, match=message):
        ServeSettings(model_name="m", config=config, reserve_tokens=4)
    with pytest.raises(ValueError, match=message):
        next(stream_generate(tiny_llama(), byte_tokenizer(), "hi", config, reserve_tokens=4))
    folder = str(saved_tiny_llama(tmp_path / "model"))
    (tmp_path / "in.jsonl").write_text('{"id": "a", "prompt": "hi"}\n')
    argv = ["batch", str(tmp_path / "in.jsonl"), "--model", folder]
    argv += ["-o", str(tmp_path / "out.jsonl"), "--policy", "swa", "--caching-ratio", "0.5"]
    argv += ["--retention", "host", "--host-memory", "1MB", "--reserve-tokens", "4"]
    code, err = run_main(argv, capsys)
    assert code == 1 and "Traceback" not in err and "--reserve-tokens" in err
    assert not (tmp_path / "out.jsonl").exists()


def test_a_server_admits_under_host_memory_and_answers_400_past_it(tmp_path_factory):
    """``alisa serve --retention host --host-memory N`` was refused at start (its admission
    did not count the host region); now a request the host budget never holds is a 400
    naming it, and one it holds runs."""
    model, tokenizer = load(model_dir(tmp_path_factory.mktemp("host")))
    budget = rows_host(spec_of(model), HOST, [(8, 40)])
    settings = ServeSettings(model_name=NAME, config=with_host(HOST, budget))
    assert running_memory(spec_of(model), HOST, [], [(8, 40)]).host == budget
    with running_server(model, tokenizer, settings) as served:
        status, answer = request(
            served.port, "POST", "/v1/completions", {"prompt": "x" * 8, "max_tokens": 600}
        )
        error = answer["error"]
        assert status == 400 and error["code"] == "exceeds_budget", answer
        assert error["param"] == "max_tokens" and "--host-memory" in error["message"]
        assert "of host region" in error["message"]
        status, answer = request(
            served.port,
            "POST",
            "/v1/completions",
            {"prompt": "x" * 8, "max_tokens": 4, "temperature": 0},
        )
        assert status == 200 and answer["choices"][0]["finish_reason"] in ("stop", "length")
        # A request keeping no host region is not held to the server's host budget.
        body = {"prompt": "x" * 8, "max_tokens": 600, "alisa": {"retention": "drop"}}
        status, answer = request(served.port, "POST", "/v1/completions", body)
        assert status == 200, answer


def test_a_host_budget_without_host_retention_is_still_refused_in_a_stream():
    """The caches of a stream are built without ``host_memory`` only where admission counts it
    (``retention="host"``); elsewhere the cache refuses it as having no effect, as before."""
    config = AlisaConfig(policy="swa", caching_ratio=0.5, host_memory="1MB")
    with pytest.raises(ValueError, match=r"host_memory='1MB' \(--host-memory\) has no effect"):
        next(stream_generate(tiny_llama(), byte_tokenizer(), "hi", config, max_new_tokens=2))


@pytest.mark.parametrize("static", [True, False])
def test_alisa_batch_sizes_its_batches_to_host_memory(tmp_path, capsys, static):
    """Four rows whose host regions fit ``--host-memory`` two at a time: static batches are
    planned two rows each (a batch of four failed at its prefill: the cache's own check), and
    continuous batching admits two at a time; every row is written."""
    model = tiny_llama()
    budget = rows_host(spec_of(model), HOST, [(24, 6)] * 2)
    folder = str(saved_tiny_llama(tmp_path / "model"))
    rows = [f'{{"id": "{i}", "prompt": "{chr(97 + i) * 20}"}}' for i in range(4)]
    (tmp_path / "in.jsonl").write_text("\n".join(rows) + "\n")
    argv = ["batch", str(tmp_path / "in.jsonl"), "--model", folder, "--max-new-tokens", "6"]
    argv += ["-o", str(tmp_path / "out.jsonl"), "--policy", "swa", "--caching-ratio", "0.5"]
    argv += ["--retention", "host", "--host-memory", str(budget), "--dtype", "float32"]
    code, err = run_main([*argv, *(["--static"] if static else [])], capsys)
    assert code == 0, err
    assert f"; host regions within {format_bytes(budget)} (--host-memory {budget})" in err
    written = (tmp_path / "out.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["id"] for line in written) == ["0", "1", "2", "3"]
