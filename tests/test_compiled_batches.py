"""Compiled decode steps beyond one call (issue 65): capacity buckets that let calls and static
batches of nearby lengths replay one graph, and ``alisa batch --static --compile``."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import byte_tokenizer, tiny_llama
from torch._dynamo.utils import counters
from transformers import LlamaForCausalLM

from alisa import AlisaConfig, generate
from alisa.jobs import BatchJob
from alisa.jobs.runner import job_compile, run_batch
from alisa.kv.attention import attached
from alisa.runtime.compiled import CompileChoice, compiled_capacity
from alisa.runtime.engine import DecodeState, Engine
from alisa.runtime.generate import new_cache

SWA = AlisaConfig(policy="swa", caching_ratio=0.5, min_budget_tokens=0)  # decayed sums: no ring
# A mode without a static step: host retention over an INT4 host region.
HOST = AlisaConfig(policy="swa", caching_ratio=0.5, retention="host", host_bits=4)
CUDA_AUTO = CompileChoice(asked="auto", compiled=True, reason="auto: CUDA")


def test_capacity_buckets_round_up_by_at_most_half_within_the_context():
    assert [compiled_capacity(t, None) for t in (1, 128, 129, 193, 300, 385, 769, 1025)] == [
        128,
        128,
        192,
        256,
        384,
        512,
        1024,
        1536,
    ]
    for tokens in range(1, 5000, 37):
        capacity = compiled_capacity(tokens, None)
        assert tokens <= capacity <= max(128, 1.5 * tokens)
    assert compiled_capacity(1000, 1024) == 1024 and compiled_capacity(1500, 2048) == 1536
    assert compiled_capacity(2000, 2048) == 2048  # 3,072 would pass the context
    assert compiled_capacity(40, 64) == 64  # a context below the smallest bucket


def test_generate_calls_of_nearby_lengths_replay_one_graph():
    """Two ``compile="on"`` calls whose prompts differ in length but share a capacity bucket
    compile once: the second replays the first's graph (a decayed SWA's empty snapshot ring,
    cut from a wider prefill's slot space, once made its strides a guard that recompiled)."""
    model, tokenizer = tiny_llama(), byte_tokenizer()
    run = dict(max_new_tokens=6, stop_at_eos=False)
    long_prompts, short_prompts = ["word " * 22, "word " * 14], ["word " * 9, "word " * 5]
    eager = [generate(model, tokenizer, p, SWA, **run) for p in (long_prompts, short_prompts)]
    torch._dynamo.reset()
    counters.clear()
    compiled = [
        generate(model, tokenizer, p, SWA, compile="on", **run)
        for p in (long_prompts, short_prompts)
    ]
    assert [r.token_ids for r in compiled] == [r.token_ids for r in eager]
    assert counters["stats"]["unique_graphs"] == 1


def _prompts(tmp_path, words=(3, 9, 14, 22, 5)):
    path = tmp_path / "in.jsonl"
    path.write_text(
        "".join(json.dumps({"id": i, "prompt": "word " * n}) + "\n" for i, n in enumerate(words))
    )
    return path


def _texts(path) -> dict:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {row["id"]: row["text"] for row in rows if "text" in row}


def test_compiled_static_batches_give_the_eager_rows_with_one_graph_per_batch_size(tmp_path):
    """Batches of 2, 2 and 1 rows, every one in the 128-token bucket: the compiled job writes
    the eager job's rows and compiles two graphs (one per batch size), not one per batch."""
    model, tokenizer = tiny_llama(), byte_tokenizer()
    source = _prompts(tmp_path)
    job = dict(input=source, config=SWA, static=True, max_batch=2, max_new_tokens=10)
    eager = run_batch(
        model,
        tokenizer,
        BatchJob(
            output=tmp_path / "off.jsonl", compile="off", **job, progress=False, stop_at_eos=False
        ),
    )
    torch._dynamo.reset()
    counters.clear()
    compiled = run_batch(
        model,
        tokenizer,
        BatchJob(
            output=tmp_path / "on.jsonl", compile="on", **job, progress=False, stop_at_eos=False
        ),
    )
    assert _texts(tmp_path / "on.jsonl") == _texts(tmp_path / "off.jsonl")
    assert len(_texts(tmp_path / "on.jsonl")) == 5
    assert counters["stats"]["unique_graphs"] == 2
    assert compiled.batches == eager.batches == [2, 2, 1]
    assert compiled.compile == CompileChoice(asked="on", compiled=True, reason="asked")
    assert compiled.compile_s > 0 and "decode steps compiled (first steps" in compiled.describe()
    assert eager.compile.describe() == "off (asked)" and "compiled" not in eager.describe()


def test_auto_runs_eager_on_a_cpu_and_settles_what_cannot_compile(tmp_path):
    """``"auto"`` on this CPU runs eager without a word; where it would compile (CUDA), the job
    compiles continuous batching too (tests/test_compiled_continuous.py) and settles a mode
    without a static step eager, naming why."""
    model, tokenizer = tiny_llama(), byte_tokenizer()
    summary = run_batch(
        model,
        tokenizer,
        BatchJob(input=_prompts(tmp_path, (3,)), output=tmp_path / "o.jsonl", progress=False),
    )
    assert summary.compile.describe().startswith("off (auto: a CPU")
    assert "decode steps" not in summary.describe()
    source, out = tmp_path / "in.jsonl", tmp_path / "x.jsonl"
    assert job_compile(CUDA_AUTO, model, BatchJob(input=source, output=out), None) == CUDA_AUTO
    host = BatchJob(input=source, output=out, static=True, config=HOST)
    settled = job_compile(CUDA_AUTO, model, host, None)
    assert (
        settled.describe()
        == "off (auto: retention='host' with host_bits=4 has no static (compiled) decode step "
        "yet (host_bits=8 and 16 have))"
    )
    static = BatchJob(input=source, output=out, static=True, config=SWA)
    assert job_compile(CUDA_AUTO, model, static, None) == CUDA_AUTO


def test_compile_on_is_refused_for_modes_without_a_static_step(tmp_path):
    """``compile="on"`` needs a mode with a static step (refused before any row is written)."""
    source = _prompts(tmp_path, (3, 4))
    with pytest.raises(ValueError, match="compile='maybe' must be one of 'auto', 'on', 'off'"):
        BatchJob(input=source, output=tmp_path / "o.jsonl", compile="maybe")
    out = tmp_path / "host.jsonl"
    job = BatchJob(
        input=source,
        output=out,
        static=True,
        compile="on",
        config=HOST,
        progress=False,
    )
    with pytest.raises(ValueError, match="retention='host' with host_bits=4 has no static"):
        run_batch(tiny_llama(), byte_tokenizer(), job)
    assert not out.exists()  # refused before any row: the run leaves no output behind


def test_steps_past_the_recompile_limit_run_eager_with_one_warning():
    """A shape past torch.compile's recompile limit (fullgraph=True makes it an error) runs
    that decode step eager, with the eager tokens and one RuntimeWarning, not a traceback."""
    model, tokenizer = tiny_llama(), byte_tokenizer()
    run = dict(max_new_tokens=5, stop_at_eos=False)
    shapes = (["word " * 3], ["word " * 3, "x"])  # batch sizes 1 and 2: two graphs
    eager = [generate(model, tokenizer, p, SWA, **run) for p in shapes]
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1):
        first = generate(model, tokenizer, shapes[0], SWA, compile="on", **run)
        with pytest.warns(RuntimeWarning, match="recompile limit .1 shapes of the decode step"):
            second = generate(model, tokenizer, shapes[1], SWA, compile="on", **run)
    assert [first.token_ids, second.token_ids] == [r.token_ids for r in eager]


class _Untraceable(LlamaForCausalLM):
    """A Llama whose forward breaks the graph, as a model the compiler cannot trace whole."""

    def forward(self, *args, **kwargs):
        torch._dynamo.graph_break()
        return super().forward(*args, **kwargs)


def test_a_model_the_compiler_cannot_trace_runs_eager_under_auto_and_is_refused_under_on():
    """``"auto"`` asked for speed, not for compiling: an untraceable step runs eager with one
    RuntimeWarning and the result says why; ``"on"`` is refused naming the model."""
    model, tokenizer = _Untraceable(tiny_llama().config).eval(), byte_tokenizer()
    model.load_state_dict(tiny_llama().state_dict())
    run = dict(max_new_tokens=4, stop_at_eos=False)
    eager = generate(model, tokenizer, ["hello"], SWA, **run)
    with pytest.warns(RuntimeWarning, match="compile='auto': torch.compile cannot trace _Untr"):
        settled = new_cache(model, SWA, 4, 10, CUDA_AUTO)[0]
        auto = Engine(model, tokenizer, compile=CUDA_AUTO, stop_at_eos=False)
        batch = tokenizer(["hello"], return_tensors="pt")
        state = DecodeState.start(batch["input_ids"], batch["attention_mask"])
        with attached(model):
            result = auto.run(state, settled, 4)
    assert result.token_ids == eager.token_ids
    assert auto.compiled.choice.describe() == (
        "off (auto: torch.compile cannot trace _Untraceable's decode step in one graph)"
    )
    with pytest.raises(ValueError, match="compile='on': torch.compile cannot trace _Untraceable"):
        generate(model, tokenizer, ["hello"], SWA, compile="on", **run)
