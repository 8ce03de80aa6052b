"""probes.bench_packing: a forward's cost by tokens, and what a mixed forward would save."""

import json

import pytest
import torch
from conftest import byte_tokenizer, tiny_llama

import experiments.shapes
from probes.bench_packing import forward_costs, main, parse_args, print_table


def test_forward_costs_time_the_four_forwards_they_name():
    model = tiny_llama()
    seen = []  # (input shape, cached tokens before the forward) of every forward

    def record(module, args, kwargs):
        cache = kwargs.get("past_key_values")
        cached = cache.get_seq_length() if cache is not None else None
        seen.append((tuple(kwargs["input_ids"].shape), cached))

    model.register_forward_pre_hook(record, with_kwargs=True)
    with torch.inference_mode():
        point = forward_costs(model, prompt_tokens=40, rows=3, context=25, repeats=2)
    # One warm-up and two repeats each: prefill, packed, tokens, then the decode step.
    assert seen == (
        [((1, 40), None)] * 3 + [((1, 43), None)] * 3 + [((1, 3), None)] * 3 + [((3, 1), 25)] * 3
    )
    assert all(point[name] > 0 for name in ("prefill_ms", "packed_ms", "tokens_ms", "step_ms"))
    saved = point["tokens_ms"] - (point["packed_ms"] - point["prefill_ms"])
    assert point["saved_ms"] == pytest.approx(saved)
    assert point["saved_share_of_step"] == pytest.approx(saved / point["step_ms"])


def test_main_prints_a_row_per_point_and_restores_threads(monkeypatch, capsys):
    monkeypatch.setattr(
        experiments.shapes,
        "load_benchmark_model",
        lambda spec, dtype: (tiny_llama(), byte_tokenizer()),
    )
    threads = torch.get_num_threads()
    argv = ["--prompt-tokens", "30,50", "--rows", "2", "--context", "10", "--repeats", "1"]
    assert main([*argv, "--threads", "1"]) == 0
    assert torch.get_num_threads() == threads
    out = capsys.readouterr().out.strip().splitlines()
    report = json.loads(out[-1])
    assert report["benchmark"] == "packing" and report["context"] == 10
    assert [(row["prompt_tokens"], row["rows"]) for row in report["rows"]] == [(30, 2), (50, 2)]
    assert out[0].startswith("| T | B |")


def test_table_row_and_arguments(capsys):
    print_table(
        [
            dict(
                prompt_tokens=256,
                rows=32,
                prefill_ms=675.0,
                packed_ms=769.0,
                tokens_ms=161.0,
                step_ms=345.0,
                saved_ms=67.0,
                saved_share_of_step=0.194,
            )
        ]
    )
    assert "| 256 | 32 | 675 | 769 | 161 | 345 | 67 | 0.19 |" in capsys.readouterr().out
    assert parse_args(["--rows", "8,16"]).rows == [8, 16]
    for bad in (["--rows", "0"], ["--context", "0"], ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
