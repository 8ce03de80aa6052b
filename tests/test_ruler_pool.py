"""RULER runs of different seeds pooled into one report (experiments/tasks/ruler/pool.py)."""

from __future__ import annotations

import json

import pytest

from experiments.report import main as report_main
from experiments.tasks.ruler.pool import pool_runs
from tests.test_ruler import HOST, _row

ENV = {"torch": "t", "transformers": "x", "cpu": "c", "cpu_count": 2, "threads": 2}


def _config(seed, dtype="float32", **ruler):
    return {"name": "r", "options": {"ruler": {"seed": seed, **ruler}}, "runtime": {"dtype": dtype}}


def _run(tmp_path, name, config, rows):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "env.json").write_text(json.dumps({**ENV, "gpu": None, "git_commit": name}))
    return folder


def _first():
    depths = [0.0, 1.0]
    return [
        _row("niah_single", 4096, "hf-dynamic", [1, 1, 1, 1, 1]),
        _row("niah_single", 4096, HOST, [1, 1, 1, 1, 0]),  # 0.80 of dense: below 0.90
        _row("niah_grid", 2048, "hf-dynamic", [1, 0], depths),
        _row("niah_grid", 2048, HOST, [1, 0], depths),
    ]


def _second():
    depths = [0.0, 1.0]
    rows = [
        _row("niah_single", 4096, "hf-dynamic", [1, 1, 1, 1, 1]),
        _row("niah_single", 4096, HOST, [1, 1, 1, 1, 1]),
        # The same indices as the first run's: the seed tells the samples apart. Dense finds the
        # needle at depth 1.0 here and host retention misses it.
        _row("niah_grid", 2048, "hf-dynamic", [0, 1], depths),
        _row("niah_grid", 2048, HOST, [0, 0], depths),
    ]
    rows[1]["metrics"].update(kv_device_bytes=3000.0, decode_s=3.0, decode_tokens_per_s=30.0)
    rows[1]["metrics"].update(median_step_ms=120.0, peak_kv_bytes=5000.0)
    return rows


def test_pooled_scores_are_the_mean_over_every_sample_of_every_run():
    rows = pool_runs([("a", _config(0), _first()), ("b", _config(1), _second())])
    host = next(
        r for r in rows if r["point"]["family"] == "niah_single" and r["point"]["system"] == HOST
    )
    metrics = host["metrics"]
    assert metrics["score"] == pytest.approx(0.9) and metrics["samples"] == 10
    assert [r["seed"] for r in metrics["per_sample"]] == [0] * 5 + [1] * 5
    assert metrics["kv_device_bytes"] == pytest.approx(2000.0)  # 5 samples at 1000, 5 at 3000
    assert metrics["decode_tokens_per_s"] == pytest.approx((10 * 1 + 30 * 3) / 4)
    assert metrics["decode_s"] == 4.0 and metrics["peak_kv_bytes"] == 5000.0
    assert metrics["median_step_ms"] == pytest.approx(110.0) and host["seconds"] == 20.0
    assert len(rows) == 4  # one row per point


def test_a_pooled_report_judges_the_share_over_both_runs_and_not_the_time(tmp_path, capsys):
    first = _run(tmp_path, "first", _config(0), _first())
    second = _run(tmp_path, "second", _config(1), _second())
    out = tmp_path / "pooled"
    assert report_main([str(first), str(second), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(printed[-1])
    targets = summary["targets"]
    # 9 of dense's 10: a share of 0.90, where the first run alone had 0.80.
    assert targets["host_r0.1_share_ge_0.9"] == {"met": True, "tasks": 1, "below": []}
    # Grid: dense finds seed 0's depth 0.0 and seed 1's depth 1.0; host retention the first.
    grid = targets["grid_host_r0.1_finds_what_dense_finds"]
    assert grid == {"met": False, "cells": 2, "missed": [{"length": 2048, "depth": 1.0}]}
    assert targets["run_under_2h"] == {"met": None, "seconds": 80.0, "pooled_runs": 2}
    text = "\n".join(printed)
    assert "pooled from 2 runs" in text and "(options.ruler.seed=1)" in text
    assert "Samples per point: 2048 niah_grid: 4; 4096 niah_single: 10" in text
    assert "| 4096 | niah_single | 1.00 | 0.90 (0.90) |" in text
    for name in ("report.md", "summary.json", "ruler_niah_grid.png"):
        assert (out / name).is_file()
    assert not (first / "report.md").exists()  # the runs' own folders are left as they were


def test_a_point_only_one_run_measured_keeps_its_samples(tmp_path, capsys):
    extra = [_row("niah_multikey", 4096, "hf-dynamic", [1, 0, 1])]
    first = _run(tmp_path, "first", _config(0), _first() + extra)
    second = _run(tmp_path, "second", _config(1), _second())
    assert report_main([str(first), str(second), "--out", str(tmp_path / "p")]) == 0
    assert "4096 niah_multikey: 3;" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("configs", "needle"),
    [
        ((_config(0), _config(0)), "both ran options.ruler.seed=0: the same prompts"),
        ((_config(0), _config(1, dtype="bfloat16")), "runtime.dtype='bfloat16'"),
        ((_config(0), _config(1, haystack="mine.txt")), "options.ruler.haystack='mine.txt'"),
        ((_config(0), _config(1, new_tokens=8)), "options.ruler.new_tokens=8"),
    ],
)
def test_runs_asking_other_prompts_are_refused_naming_the_field(tmp_path, capsys, configs, needle):
    first = _run(tmp_path, "first", configs[0], _first())
    second = _run(tmp_path, "second", configs[1], _second())
    assert report_main([str(first), str(second), "--out", str(tmp_path / "p")]) == 1
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert not (tmp_path / "p" / "report.md").exists()


def test_out_goes_with_several_runs_only(tmp_path, capsys):
    first = _run(tmp_path, "first", _config(0), _first())
    second = _run(tmp_path, "second", _config(1), _second())
    assert report_main([str(first), str(second)]) == 1
    assert "2 runs given: --out names the pooled report's folder" in capsys.readouterr().err
    assert report_main([str(first), "--out", str(tmp_path / "p")]) == 1
    assert "is for several runs pooled; one was given" in capsys.readouterr().err
