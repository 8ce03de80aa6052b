"""Continuous batching compiled (issue 65): rows join and leave static caches, each decode step
runs over a bucket of rows, and every token is the eager scheduler's."""

from __future__ import annotations

import json
import queue

import pytest
import torch
from conftest import byte_tokenizer, run_main, tiny_llama
from test_continuous import prompts, requests
from test_serve_units import ends, job
from test_static_cache import MODES
from torch._dynamo.utils import counters

from alisa import AlisaCache, AlisaConfig
from alisa.jobs import BatchJob
from alisa.jobs.runner import job_compile, run_batch
from alisa.jobs.sizing import running_memory
from alisa.jobs.stream import ByteBudget, stream_generate
from alisa.model.adapter import model_shape
from alisa.planning.spec import model_spec
from alisa.runtime.compiled import ASKED_ON, CompileChoice, CompiledDecode, batch_bucket
from alisa.runtime.continuous import ContinuousScheduler
from alisa.runtime.engine import DecodeState, Engine
from alisa.runtime.requests import RowLimit, StreamRequest
from alisa.runtime.sampling import SamplingOptions
from alisa.serve import ServeSettings
from alisa.serve.engine import ServeEngine
from alisa.serve.metrics import ServeMetrics

CUDA_AUTO = CompileChoice(asked="auto", compiled=True, reason="auto: CUDA")
SWA = AlisaConfig(policy="swa", caching_ratio=0.3, min_budget_tokens=0)
# Rows of many lengths finishing at many steps: up to 7 run at once (buckets 1, 2, 4 and 7),
# prefilled three at a time (padded), so rows join a bucket holding copies, leave and change
# bucket throughout.
LENGTHS = (23, 6, 41, 12, 30, 3, 17, 9, 35, 14, 27, 5, 44, 19)
LONG = (155, 195, 125, 210, 145, 180, 110, 170, 200, 140, 190, 130, 160, 175)  # 2,285 tokens
SHORT = (9, 14, 4, 11, 6, 13, 8, 12, 5, 10, 7, 15, 3, 9)
CAPACITY = 256


def scheduled(model, config, new_tokens, *, compiled: bool):
    """Every request's tokens by id and the rows of each scheduler iteration, over static
    caches of CAPACITY tokens: eager, or compiled (traced by dynamo alone, which finds every
    graph break and recompile without generating code).

    The eager run is the reference, not the growing cache: a static layer attends over its
    whole slot space, a growing one over its width, so their sums may round apart (1e-7) and,
    over a hundred steps of eviction, flip a near tie (the same holds between batch shapes)."""
    traced = CompiledDecode(model, "default", ASKED_ON, backend="eager") if compiled else None
    engine = Engine(model, byte_tokenizer(), stop_at_eos=False, compiled=traced)
    steps = []
    scheduler = ContinuousScheduler(
        engine,
        lambda **static: AlisaCache(model, config, **static),
        RowLimit(7),
        prefill_rows=3,
        on_step=lambda record: steps.append(record.rows),
        max_cache_len=CAPACITY,
    )
    results = list(scheduler.run(requests(prompts(LENGTHS), new_tokens)))
    assert sorted(r.id for r in results) == list(range(len(LENGTHS)))
    return {r.id: r.token_ids for r in results}, steps


def eager_and_compiled(mode: str, new_tokens) -> tuple[dict, dict, list[int]]:
    """:func:`scheduled` eager and compiled in ``mode`` (the compile counters cleared between)."""
    model = tiny_llama()
    config = AlisaConfig(kernels="reference", **MODES[mode])
    eager, _ = scheduled(model, config, new_tokens, compiled=False)
    torch._dynamo.reset()
    counters.clear()
    compiled, steps = scheduled(model, config, new_tokens, compiled=True)
    return eager, compiled, steps


@pytest.mark.parametrize("mode", ["swa", "dense", "int8"])
def test_300_compiled_steps_of_rows_joining_and_leaving_give_the_eager_tokens(mode):
    """Over 300 scheduler iterations, rows joining (three prefilled together, padded) and leaving
    at every bucket size: every token of every row is the eager scheduler's, from one graph
    per bucket of rows (the first rows' padding mask is not fed past their prefill: a rotary
    model's positions are its position_ids), none recompiled."""
    eager, compiled, steps = eager_and_compiled(mode, LONG)
    assert len(steps) >= 300
    assert compiled == eager
    buckets = {batch_bucket(rows, 7) for rows in steps if rows}
    assert buckets == {1, 2, 4, 7}  # 7: the next power of two within the rows allowed
    assert counters["stats"]["unique_graphs"] == len(buckets)
    assert not counters["graph_break"]


@pytest.mark.parametrize(
    "mode", ["swa-exact-window", "swa-paper", "tova", "h2o-one-set", "streaming", "int4"]
)
def test_every_dropping_policy_and_coded_kv_joins_compiled_steps_exactly(mode):
    eager, compiled, _ = eager_and_compiled(mode, SHORT)
    assert compiled == eager
    assert counters["stats"]["unique_graphs"] <= 4 and not counters["graph_break"]


def test_the_bucket_is_the_next_power_of_two_and_the_filled_state_repeats_the_last_row():
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 33)] == [1, 2, 4, 4, 8, 8, 16, 64]
    assert [batch_bucket(n, 6) for n in (1, 3, 4, 5, 6)] == [1, 4, 4, 6, 6]
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=f"rows={bad!r} must be an integer >= 1"):
            batch_bucket(bad)
    state = DecodeState.start(torch.tensor([[5, 6], [7, 8], [9, 10]]))
    state.advance(torch.tensor([1, 2, 3]))
    filled = state.filled(4)
    assert filled.feed.view(-1).tolist() == [1, 2, 3, 3]
    assert filled.positions.view(-1).tolist() == [2, 2, 2, 2]
    assert state.feed.shape[0] == 3 and state.filled(3) is state


def test_static_caches_of_other_lengths_do_not_share_a_batch():
    model, tokenizer = tiny_llama(), byte_tokenizer()
    caches = []
    for capacity in (64, 96):
        engine = Engine(model, tokenizer, stop_at_eos=False)
        cache = AlisaCache(model, SWA, max_cache_len=capacity)
        engine.step(DecodeState.start(torch.tensor([[5, 6, 7]])), cache)
        caches.append(cache)
    with pytest.raises(ValueError, match="max_cache_len=64 and 96 cannot share a batch"):
        caches[0].extend(caches[1])


def test_host_retention_keeps_its_static_rows_and_settles_continuous_batching_eager(tmp_path):
    """Its static step's ring of tokens not coded yet does not follow rows joining or leaving:
    a static host cache refuses to change its rows, ``auto`` batches it continuously eager
    (naming why) and ``on`` is refused before any row is written."""
    model, tokenizer = tiny_llama(), byte_tokenizer()
    host = AlisaConfig(policy="swa", caching_ratio=0.3, retention="host")
    cache = AlisaCache(model, host, max_cache_len=64)
    Engine(model, tokenizer).step(DecodeState.start(torch.tensor([[5, 6, 7], [8, 9, 4]])), cache)
    with pytest.raises(ValueError, match="a static cache cannot change its rows: retention='host'"):
        cache.take_rows(torch.tensor([0]))
    source, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    source.write_text(json.dumps({"id": 0, "prompt": "word word"}) + "\n")
    job = BatchJob(input=source, output=out, config=host, progress=False)
    settled = job_compile(CUDA_AUTO, model, job, None)
    assert settled.describe().startswith("off (auto: retention='host' keeps its static step's")
    with pytest.raises(ValueError, match="compile='on' with continuous batching: retention='host'"):
        run_batch(model, tokenizer, BatchJob(input=source, output=out, config=host, compile="on"))
    assert not out.exists()


def test_a_batch_job_batched_continuously_runs_its_steps_compiled(tmp_path):
    """``alisa batch --compile on`` without ``--static``: continuous batching over static
    caches, compiled by inductor, writes the eager job's rows and says it compiled."""
    model, tokenizer = tiny_llama(), byte_tokenizer()
    source = tmp_path / "in.jsonl"
    words = (3, 9, 14, 22, 5)
    source.write_text(
        "".join(json.dumps({"id": i, "prompt": "word " * n}) + "\n" for i, n in enumerate(words))
    )
    job = dict(input=source, config=SWA, max_batch=3, max_new_tokens=10, progress=False)
    run_batch(model, tokenizer, BatchJob(output=tmp_path / "off.jsonl", compile="off", **job))
    torch._dynamo.reset()
    counters.clear()
    compiled = run_batch(
        model, tokenizer, BatchJob(output=tmp_path / "on.jsonl", compile="on", **job)
    )
    texts = [
        {row["id"]: row["text"] for row in map(json.loads, path.read_text().splitlines())}
        for path in (tmp_path / "off.jsonl", tmp_path / "on.jsonl")
    ]
    assert texts[0] == texts[1] and len(texts[0]) == 5
    assert compiled.compile == ASKED_ON and compiled.compile_s > 0
    assert "continuous batching" in compiled.describe()
    assert "decode steps compiled (first steps" in compiled.describe()
    assert counters["stats"]["unique_graphs"] <= 3  # buckets 1, 2 and 3


def test_stream_generate_compiles_and_ends_a_request_past_its_static_length():
    model, tokenizer = tiny_llama(), byte_tokenizer()
    ids = prompts((7, 12, 5))
    stream = [StreamRequest(prompt_ids=p, max_new_tokens=6, id=i) for i, p in enumerate(ids)]
    too_long = StreamRequest(prompt_ids=ids[0], max_new_tokens=200, id="long")
    run = dict(stop_at_eos=False, max_cache_len=100)
    off = stream_generate(model, tokenizer, stream, SWA, stop_at_eos=False, compile="off")
    eager = {r.id: r.token_ids for r in off}
    results = {
        r.id: r
        for r in stream_generate(model, tokenizer, [*stream, too_long], SWA, compile="on", **run)
    }
    assert {key: results[key].token_ids for key in eager} == eager
    assert results["long"].finish_reason == "context_exceeded"
    assert (
        "passes the max_cache_len=128 of the compiled step's static caches" in results["long"].error
    )
    with pytest.raises(ValueError, match="max_cache_len=0 must be an integer >= 1"):
        next(stream_generate(model, tokenizer, stream, compile="on", max_cache_len=0))


def test_the_cli_compiles_continuous_batching(tmp_path, capsys):
    model_dir = tmp_path / "model"
    tiny_llama().save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"id": 0, "prompt": "word word word"}) + "\n")
    out = tmp_path / "o.jsonl"
    argv = ["batch", str(source), "-o", str(out), "--model", str(model_dir), "--no-progress"]
    code, err = run_main([*argv, "--compile", "on", "--max-new-tokens", "4"], capsys)
    assert code == 0, err
    assert "decode steps compiled (first steps" in err and len(out.read_text().splitlines()) == 1


def served(settings: ServeSettings, prompts_: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """Each request's tokens (``prompts_``: name -> max_tokens) through a server's engine."""
    engine = ServeEngine(
        tiny_llama(), byte_tokenizer(), settings, ServeMetrics(settings.config, settings.budgets)
    )
    engine.start()
    events: queue.Queue = queue.Queue()
    for name, tokens in prompts_.items():
        engine.submit(job(events, name, tokens, ignore_eos=True))
    found = {name: event for name, event in ends(events, len(prompts_))}
    engine.stop(60)
    return {name: event.token_ids for name, event in found.items()}


def test_a_server_compiles_its_steps_once_for_every_group():
    """``ServeSettings(compile="on")``: the rows' tokens are the eager server's (static caches,
    so any rounding is the static layer's), every scheduler the server starts goes on with one
    compiled step, and a group whose mode has no static rows runs eager."""
    requests_ = {"short one": 5, "a much longer prompt than that": 9, "mid prompt": 7}
    eager = served(ServeSettings(model_name="tiny", config=SWA, compile="off"), requests_)
    settings = ServeSettings(model_name="tiny", config=SWA, compile="on", max_cache_len=100)
    assert served(settings, requests_) == eager
    engine = ServeEngine(tiny_llama(), byte_tokenizer(), settings, ServeMetrics(SWA, {}))
    assert engine.compile == ASKED_ON
    first = engine._scheduler(SWA, SamplingOptions(), False)
    later = engine._scheduler(SWA, SamplingOptions(do_sample=True, seed=1), True)
    assert first.engine.compiled is later.engine.compiled is not None
    assert first.max_cache_len == later.max_cache_len == 128
    host = engine._scheduler(
        AlisaConfig(policy="swa", caching_ratio=0.3, retention="host"), SamplingOptions(), False
    )
    assert host.engine.compiled is None and host.max_cache_len is None


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"compile": "maybe"}, "compile='maybe' must be one of 'auto', 'on', 'off'"),
        ({"max_cache_len": 0}, "max_cache_len=0 must be an integer >= 1"),
    ],
)
def test_bad_compile_settings_of_a_server_are_refused_naming_them(options, words):
    with pytest.raises(ValueError, match=words):
        ServeSettings(model_name="tiny", **options)


def test_admission_counts_the_static_rows_and_the_bucket_copies_within_the_kv_budget():
    """A static row holds its slot space for ``max_cache_len`` tokens whatever its length, and
    the copies filling a compiled step's bucket hold as much: admission counts both, so the KV
    held stays within the budget (it did not: 218 MiB under a 160 MiB budget, one run of
    experiments.bench_continuous before this rule)."""
    model = tiny_llama()
    spec = model_spec(model, model_shape(model))
    budget = running_memory(spec, SWA, [(CAPACITY, 0)] * 5).kv  # five static rows, not six
    admission = ByteBudget(spec=spec, config=SWA, kv_bytes=budget)
    traced = CompiledDecode(model, "default", ASKED_ON, backend="eager")
    engine = Engine(model, byte_tokenizer(), stop_at_eos=False, compiled=traced)
    scheduler = ContinuousScheduler(
        engine,
        lambda **static: AlisaCache(model, SWA, **static),
        admission,
        max_cache_len=CAPACITY,
    )
    widest = 0
    for request in requests(prompts(LENGTHS[:8]), SHORT[:8]):
        scheduler.submit(request)
    finished = []
    while not scheduler.idle:
        finished += scheduler.step()
        widest = max(widest, len(scheduler.rows))
        assert scheduler.stats.kv_bytes <= budget
    assert scheduler.stats.peak_kv_bytes <= budget
    assert widest == 4  # a fifth row would make a bucket of 8: eight static rows do not fit
    assert sorted(r.id for r in finished) == list(range(8))


def test_a_row_refused_for_its_static_space_says_so(tmp_path):
    """A KV budget one static row does not fit (though each prompt would, at its own length):
    compiled, every row is refused naming the static cache's length; eager, every row runs."""
    model, tokenizer = tiny_llama(), byte_tokenizer()
    spec = model_spec(model, model_shape(model))
    budget = running_memory(spec, SWA, [(CAPACITY // 2, 0)]).kv - 1  # 128: the bucket of 20
    source = tmp_path / "in.jsonl"
    source.write_text(
        "".join(json.dumps({"id": i, "prompt": "word " * 2}) + "\n" for i in range(2))
    )
    job = dict(input=source, config=SWA, max_new_tokens=8, kv_memory=budget, progress=False)
    eager = run_batch(model, tokenizer, BatchJob(output=tmp_path / "off.jsonl", **job))
    assert eager.completed == 2 and not eager.did_not_fit
    compiled = run_batch(
        model, tokenizer, BatchJob(output=tmp_path / "on.jsonl", compile="on", **job)
    )
    assert sorted(compiled.did_not_fit) == [0, 1] and compiled.completed == 0
    for row in compiled.errors.values():
        assert "a static cache of max_cache_len=128 tokens whatever its length" in row["error"]
