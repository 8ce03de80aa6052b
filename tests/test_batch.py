"""`alisa batch`: budgets, resumption, kill -9 safety, bad input."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import byte_tokenizer, tiny_llama
from transformers import DynamicCache

from alisa import AlisaConfig, BatchJob, run_batch
from alisa.cli import main
from alisa.jobs import batch_memory
from alisa.jobs.sizing import running_memory
from alisa.model.adapter import model_shape
from alisa.planning.spec import model_spec

TESTS = Path(__file__).parent


def write_prompts(path: Path, count: int = 12, long_every: int = 0, words: int = 3) -> list:
    rows = []
    for index in range(count):
        words_here = 60 if long_every and index % long_every == 0 else words + index % 5
        rows.append({"id": f"p{index}", "prompt": " ".join(["word"] * words_here) + f" {index}"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def read_rows(path: Path) -> list:
    # Rows end at "\n" only: a completion may hold U+0085 or U+2028, which splitlines() splits.
    return [json.loads(line) for line in path.read_text().split("\n") if line]


def test_every_prompt_gets_one_row_and_reruns_skip_finished(tmp_path):
    model, tokenizer = tiny_llama(), byte_tokenizer()
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_prompts(source)
    job = BatchJob(input=str(source), output=str(target), max_new_tokens=6, progress=False)
    summary = run_batch(model, tokenizer, job)
    rows = read_rows(target)
    assert sorted(r["id"] for r in rows) == sorted(f"p{i}" for i in range(12))
    assert all(r["finish_reason"] in ("stop", "length") and r["tokens"] >= 1 for r in rows)
    assert summary.completed == 12 and summary.generated_tokens == sum(r["tokens"] for r in rows)
    again = run_batch(model, tokenizer, job)
    assert again.completed == 0 and again.already_done == 12
    assert len(read_rows(target)) == 12


@pytest.mark.parametrize("static", [True, False], ids=["static", "continuous"])
def test_batches_shrink_to_fit_the_budget_and_oversized_prompts_are_reported(tmp_path, static):
    model, tokenizer = tiny_llama(), byte_tokenizer()
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = write_prompts(source, count=10, long_every=5)
    spec = model_spec(model, model_shape(model))
    small = batch_memory(spec, AlisaConfig(), 3, 30, 6).total
    # Continuous rows start longest first, so rows of like length run together: at most as
    # many as fit when all are the shortest prompt (fewer than the 8 that fit alone).
    shortest = min(len(tokenizer(r["prompt"]).input_ids) for r in rows)
    most = max(
        count
        for count in range(1, 9)
        if running_memory(spec, AlisaConfig(), [(shortest, 6)] * count).total <= small
    )
    assert most < 8, most
    job = BatchJob(
        input=str(source),
        output=str(target),
        gpu_memory=small,
        max_new_tokens=6,
        progress=False,
        static=static,
    )
    summary = run_batch(model, tokenizer, job)
    ids = [r["id"] for r in read_rows(target)]
    assert max(summary.batches) <= 3 if static else 1 <= summary.max_rows <= most
    assert summary.did_not_fit == ["p0", "p5"]  # 60-word prompts cannot fit even alone
    # Failed rows stay out of the output (a re-run retries them): every other id exactly once.
    assert sorted(ids) == sorted(f"p{i}" for i in range(10) if i % 5)
    error = summary.errors["p0"]
    assert error["finish_reason"] == "did_not_fit" and "bytes" in error["error"]
    assert set(summary.errors) == {"p0", "p5"}


def test_sparse_int8_batches_are_larger_under_the_same_budget(tmp_path):
    model, tokenizer = tiny_llama(), byte_tokenizer()
    source = tmp_path / "in.jsonl"
    write_prompts(source, count=16, words=60)  # about 300 tokens each
    spec = model_spec(model, model_shape(model))
    budget = batch_memory(spec, None, 4, 330, 8).kv  # the KV of 4 dense sequences
    dense = run_batch(
        model,
        tokenizer,
        BatchJob(
            input=str(source),
            output=str(tmp_path / "d.jsonl"),
            kv_memory=budget,
            max_new_tokens=8,
            progress=False,
        ),
        cache_factory=DynamicCache,
    )
    sparse = run_batch(
        model,
        tokenizer,
        BatchJob(
            input=str(source),
            output=str(tmp_path / "s.jsonl"),
            kv_memory=budget,
            max_new_tokens=8,
            config=AlisaConfig(policy="swa", caching_ratio=0.2, kv_bits=8),
            progress=False,
        ),
    )
    # The dense baseline runs static batches; alisa's rows run continuously, more at once.
    assert sparse.max_rows > max(dense.batches)
    assert max(dense.batches) <= 4
    # Measured KV stays inside the shared KV budget for both caches.
    assert dense.peak_kv_bytes <= budget and sparse.peak_kv_bytes <= budget


def test_dense_alisa_matches_dynamic_cache_outputs(tmp_path):
    model, tokenizer = tiny_llama(), byte_tokenizer()
    model.generation_config.eos_token_id = None
    source = tmp_path / "in.jsonl"
    write_prompts(source, count=6)
    ours = tmp_path / "a.jsonl"
    theirs = tmp_path / "b.jsonl"
    run_batch(
        model,
        tokenizer,
        BatchJob(input=str(source), output=str(ours), max_new_tokens=8, progress=False),
    )
    run_batch(
        model,
        tokenizer,
        BatchJob(input=str(source), output=str(theirs), max_new_tokens=8, progress=False),
        cache_factory=DynamicCache,
    )
    assert {r["id"]: r["text"] for r in read_rows(ours)} == {
        r["id"]: r["text"] for r in read_rows(theirs)
    }


def test_separate_prefills_give_the_tokens_of_mixed_forwards(tmp_path):
    """``alisa batch`` prefills newcomers inside the running rows' decode step by default;
    ``--separate-prefills`` (``mixed_forwards=False``) gives every row the same text."""
    model, tokenizer = tiny_llama(), byte_tokenizer()
    model.generation_config.eos_token_id = None
    source = tmp_path / "in.jsonl"
    write_prompts(source, count=8)
    texts = {}
    for mixed in (True, False):
        target = tmp_path / f"{mixed}.jsonl"
        job = BatchJob(
            input=str(source),
            output=str(target),
            max_new_tokens=6,
            max_batch=3,
            progress=False,
            mixed_forwards=mixed,
        )
        run_batch(model, tokenizer, job)
        texts[mixed] = {r["id"]: r["text"] for r in read_rows(target)}
    assert texts[True] == texts[False] and len(texts[True]) == 8
    with pytest.raises(ValueError, match="mixed_forwards=False applies to continuous"):
        BatchJob(input=str(source), output="o.jsonl", static=True, mixed_forwards=False)
    code = main(
        ["batch", str(source), "-o", str(tmp_path / "o.jsonl"), "--static", "--separate-prefills"]
    )
    assert code != 0


# A job whose every forward pass is slowed (static batches and continuous batching alike):
# the kill lands mid-job.
WORKER = """
import sys, time
sys.path.insert(0, {tests!r})
from conftest import tiny_llama, byte_tokenizer
from alisa import BatchJob, run_batch
from alisa.runtime.engine import Engine
real = Engine.step
def slow(*args, **kwargs):
    time.sleep(0.04)
    return real(*args, **kwargs)
Engine.step = slow
run_batch(tiny_llama(), byte_tokenizer(), BatchJob(input={source!r}, output={target!r},
          max_new_tokens=4, max_batch=1, progress=False, static={static}))
"""


@pytest.mark.parametrize("static", [True, False], ids=["static", "continuous"])
def test_kill_9_loses_and_duplicates_nothing(tmp_path, static):
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_prompts(source, count=30)
    script = WORKER.format(tests=str(TESTS), source=str(source), target=str(target), static=static)
    process = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.time() + 120
    while time.time() < deadline and (
        not target.exists() or len(target.read_text().splitlines()) < 5
    ):
        time.sleep(0.05)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    partial = read_rows(target)
    assert 5 <= len(partial) < 30
    model, tokenizer = tiny_llama(), byte_tokenizer()
    run_batch(
        model,
        tokenizer,
        BatchJob(
            input=str(source), output=str(target), max_new_tokens=4, progress=False, static=static
        ),
    )
    rows = read_rows(target)
    ids = [r["id"] for r in rows]
    assert sorted(ids) == sorted(f"p{i}" for i in range(30))
    assert rows[: len(partial)] == partial  # what was written before the kill is untouched


def test_a_torn_last_line_is_repaired_and_redone(tmp_path):
    model, tokenizer = tiny_llama(), byte_tokenizer()
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_prompts(source, count=4)
    target.write_text(
        json.dumps({"id": "p0", "text": "x", "tokens": 1, "finish_reason": "stop"})
        + '\n{"id": "p1", "te'
    )
    run_batch(
        model,
        tokenizer,
        BatchJob(input=str(source), output=str(target), max_new_tokens=3, progress=False),
    )
    rows = read_rows(target)
    assert [r["id"] for r in rows][0] == "p0" and rows[0]["text"] == "x"
    assert sorted(r["id"] for r in rows) == ["p0", "p1", "p2", "p3"]


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ('{"id": 1, "prompt": "a"}\n{not json}\n', "in.jsonl:2: malformed JSON"),
        ('{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}\n', "in.jsonl:2: duplicate id 1"),
        ('{"id": 1}\n', "in.jsonl:1: missing or empty 'prompt'"),
        # The fourteenth bad-input tour's S1: an empty id ran and was written back unsaid.
        ('{"id": "", "prompt": "a"}\n', "in.jsonl:1: 'id' is empty"),
        ('{"id": " ", "prompt": "a"}\n', "in.jsonl:1: 'id' is blank"),
        ('{"id": 1, "prompt": "a", "temprature": 1}\n', "unknown option 'temprature'"),
        ('{"id": 1, "prompt": "a", "max_new_tokens": "many"}\n', "max_new_tokens='many'"),
        ("[1, 2]\n", "expected a JSON object"),
    ],
)
def test_bad_rows_name_file_and_line(tmp_path, content, needle):
    source = tmp_path / "in.jsonl"
    source.write_text(content)
    job = BatchJob(input=str(source), output=str(tmp_path / "out.jsonl"), progress=False)
    with pytest.raises(ValueError, match=needle.replace("[", r"\[")):
        run_batch(tiny_llama(), byte_tokenizer(), job)


def test_unwritable_output_and_tiny_budget_are_errors_that_keep_existing_rows(tmp_path):
    source = tmp_path / "in.jsonl"
    write_prompts(source, count=2)
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    with pytest.raises(ValueError, match="cannot write output"):
        run_batch(
            tiny_llama(),
            byte_tokenizer(),
            BatchJob(input=str(source), output=str(blocked / "out.jsonl")),
        )
    target = tmp_path / "out.jsonl"
    target.write_text('{"id": "p0", "text": "kept", "tokens": 1, "finish_reason": "stop"}\n')
    with pytest.raises(ValueError, match="smaller than the weights"):
        run_batch(
            tiny_llama(),
            byte_tokenizer(),
            BatchJob(input=str(source), output=str(target), gpu_memory=1000),
        )
    assert read_rows(target) == [{"id": "p0", "text": "kept", "tokens": 1, "finish_reason": "stop"}]


def test_cli_reports_bad_input_in_one_line(tmp_path, capsys):
    source = tmp_path / "in.jsonl"
    source.write_text('{"id": 1, "prompt": ""}\n')
    code = main(["batch", str(source), "-o", str(tmp_path / "out.jsonl")])
    err = capsys.readouterr().err
    assert code != 0 and "in.jsonl:1" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_chat_wraps_prompts_in_the_template_and_a_row_can_opt_out(tmp_path):
    from alisa import generate

    model, tokenizer = tiny_llama(), byte_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}[user]{{ m['content'] }}{% endfor %}[bot]"
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [{"id": "a", "prompt": "hello"}, {"id": "b", "prompt": "hello", "chat": False}]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = BatchJob(input=source, output=target, max_new_tokens=5, progress=False, chat=True)
    run_batch(model, tokenizer, job)
    texts = {r["id"]: r["text"] for r in read_rows(target)}
    for key, prompt in (("a", "[user]hello[bot]"), ("b", "hello")):
        alone = generate(model, tokenizer, prompt, AlisaConfig(), max_new_tokens=5)
        assert texts[key] == alone.texts[0]


def test_chat_needs_a_template_and_a_boolean(tmp_path):
    model, tokenizer = tiny_llama(), byte_tokenizer()
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text('{"id": "a", "prompt": "hi", "chat": true}\n')
    job = BatchJob(input=source, output=target, max_new_tokens=2, progress=False)
    with pytest.raises(ValueError, match="no chat template"):
        run_batch(model, tokenizer, job)
    source.write_text('{"id": "a", "prompt": "hi", "chat": "yes"}\n')
    with pytest.raises(ValueError, match=r"in.jsonl:1: 'chat' must be true or false"):
        run_batch(model, tokenizer, job)


@pytest.mark.parametrize("static", [True, False], ids=["static", "continuous"])
def test_every_step_is_reported_and_each_ttft_counts_the_wait(tmp_path, static):
    model, tokenizer = tiny_llama(), byte_tokenizer()
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_prompts(source, count=9)
    records = []
    job = BatchJob(
        input=str(source),
        output=str(target),
        max_new_tokens=5,
        max_batch=2,
        stop_at_eos=False,
        progress=False,
        static=static,
    )
    summary = run_batch(model, tokenizer, job, on_step=records.append)
    assert sum(r.tokens for r in records) == summary.generated_tokens == 45
    assert max(r.rows for r in records) == 2
    assert [r.time_s for r in records] == sorted(r.time_s for r in records)
    assert len(summary.ttfts_s) == summary.completed == 9
    # From the job's start: rows run in later batches (or admitted later) waited longer.
    first_rows = sorted(summary.ttfts_s)[:2]
    assert max(summary.ttfts_s) > max(first_rows)


def test_continuous_jobs_start_the_longest_work_first(tmp_path):
    """Every row of the file is there from the start: the most new tokens allowed first, then
    the longest prompt, ties in file order (so no long answer starts last and runs alone).
    One row at a time, rows finish in the order they were admitted."""
    model, tokenizer = tiny_llama(), byte_tokenizer()
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [
        {"id": "short-2", "prompt": "a b", "max_new_tokens": 2},
        {"id": "short-6", "prompt": "a b", "max_new_tokens": 6},
        {"id": "long-6", "prompt": "a b c d e f g h", "max_new_tokens": 6},
        {"id": "long-2", "prompt": "a b c d e f g h", "max_new_tokens": 2},
        {"id": "default", "prompt": "a b"},
        {"id": "short-6-later", "prompt": "a b", "max_new_tokens": 6},
    ]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = BatchJob(
        input=str(source),
        output=str(target),
        max_new_tokens=4,
        max_batch=1,
        stop_at_eos=False,
        progress=False,
    )
    run_batch(model, tokenizer, job)
    order = [r["id"] for r in read_rows(target)]
    assert order == ["long-6", "short-6", "short-6-later", "default", "long-2", "short-2"]


def test_a_small_reserve_runs_more_rows_with_the_same_texts(tmp_path):
    model, tokenizer = tiny_llama(), byte_tokenizer()
    source = tmp_path / "in.jsonl"
    write_prompts(source, count=10, words=8)
    spec = model_spec(model, model_shape(model))
    budget = batch_memory(spec, AlisaConfig(), 2, 60, 40).kv
    texts, summaries = [], []
    for name, reserve in (("full", None), ("small", 1)):
        target = tmp_path / f"{name}.jsonl"
        job = BatchJob(
            input=str(source),
            output=str(target),
            kv_memory=budget,
            max_new_tokens=40,
            stop_at_eos=False,
            progress=False,
            reserve_tokens=reserve,
        )
        summaries.append(run_batch(model, tokenizer, job))
        texts.append({r["id"]: r["text"] for r in read_rows(target)})
    assert texts[0] == texts[1] and len(texts[0]) == 10
    assert summaries[1].max_rows > summaries[0].max_rows
    assert summaries[0].preemptions == 0 < summaries[1].preemptions
    assert "pauses" in summaries[1].describe()


def test_reserve_tokens_is_for_continuous_batching(tmp_path, capsys):
    source = tmp_path / "in.jsonl"
    write_prompts(source, count=2)
    with pytest.raises(ValueError, match="reserve_tokens=4 applies to continuous"):
        BatchJob(input=str(source), output=str(tmp_path / "o.jsonl"), reserve_tokens=4, static=True)
    for flags, needle in (
        (["--reserve-tokens", "-1"], "--reserve-tokens=-1 must be >= 0"),
        (["--reserve-tokens", "3", "--static"], "--static batches reserve"),
    ):
        code = main(["batch", str(source), "-o", str(tmp_path / "out.jsonl"), *flags])
        err = capsys.readouterr().err
        assert code == 1 and needle in err and "Traceback" not in err
