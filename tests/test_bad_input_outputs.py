"""Issue 67, second round: outputs and inputs a new user's tour got wrong, one row or test each.

One writer per output file under any of its names, a user's files never removed, an input read
once (pipes, FIFOs, stdin), an output that names a directory, nothing left behind by a run that
failed before writing, experiment folders locked, a dense point's budget refused, the batch
sampling flags, and a memory line that says what each number counts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import test_bad_input
import test_experiments
from test_bad_input import ERR, OK, ONE, ROW, Case, check_case, run_cli
from test_experiments import only_run, rows, write_config

from alisa.jobs.lock import locked, output_lock
from experiments.run import main as run_main
from experiments.runconfig import load_config

# The fixtures of the tables this one extends: the tiny models saved, the experiment workspace.
models = test_bad_input.models
workspace = test_experiments.workspace

TWO = ONE + b'{"id": "b", "prompt": "Yo"}\n'
BATCH = "batch {tmp}/in.jsonl -o {tmp}/o.jsonl --max-new-tokens 2 --no-progress"
SMOKE = "experiment --config {repo}/experiments/configs/smoke.toml"

CASES = {
    # alisa never removes a file it did not create: OUT.lock is nothing of alisa's
    "user-file-named-like-a-lock-kept": Case(
        BATCH, OK, (), {"in.jsonl": ONE, "o.jsonl.lock": b"my notes\n"}, changes=("o.jsonl",)
    ),
    # the output names a directory
    "output-trailing-slash": Case(
        "batch {tmp}/in.jsonl -o {tmp}/out/ --no-progress",
        ERR,
        ("cannot write output", "out/'", "names a directory", "out/out.jsonl"),
        {"in.jsonl": ONE},
        absent=("out",),
    ),
    "output-dot": Case(
        "batch {tmp}/in.jsonl -o {tmp}/sub/. --no-progress",
        ERR,
        ("cannot write output", "sub/.'", "names a directory"),
        {"in.jsonl": ONE},
        absent=("sub",),
    ),
    "output-existing-directory": Case(
        "batch {tmp}/in.jsonl -o {tmp}/d --no-progress",
        ERR,
        ("cannot write output", "it is a directory", "give a file path"),
        {"in.jsonl": ONE, "d/keep.txt": b"x"},
    ),
    # the input read once, from standard input
    "input-from-stdin": Case(
        "batch - -o {tmp}/o.jsonl --max-new-tokens 2 --no-progress",
        OK,
        ("2 prompts done", '"id": "a"', '"id": "b"'),
        stdin=TWO,
    ),
    "input-from-stdin-bad-row": Case(
        "batch - -o {tmp}/o.jsonl --model {tmp}/no-model",
        ERR,
        ("stdin:2", "malformed JSON"),
        stdin=ONE + b"{oops\n",
        absent=("o.jsonl",),
    ),
    # a run that fails before writing leaves no output behind
    "model-weights-truncated": Case(
        "batch {tmp}/in.jsonl -o {tmp}/o.jsonl --model {truncated} --no-progress",
        ERR,
        ("model.safetensors",),
        {"in.jsonl": ONE},
        absent=("o.jsonl",),
    ),
    # a folder that does not exist is not made: a typo would start a new tree
    "output-folder-missing": Case(
        "batch {tmp}/in.jsonl -o {tmp}/typo/o.jsonl --model {truncated} --no-progress",
        ERR,
        ("its folder", "typo", "does not exist"),
        {"in.jsonl": ONE},
        absent=("typo",),
    ),
    "model-fails-keeps-existing-empty-output": Case(
        "batch {tmp}/in.jsonl -o {tmp}/o.jsonl --model {tmp}/no-model --no-progress",
        ERR,
        ("no-model",),
        {"in.jsonl": ONE, "o.jsonl": b""},  # the user's empty file: not alisa's to remove
    ),
    # the README's sampling flags, defaults for the rows that set none
    "sampling-flags": Case(
        BATCH + " --do-sample --seed 3 --temperature 0.7 --top-k 5 --top-p 0.9",
        OK,
        ("1 prompts done",),
        {"in.jsonl": ONE},
    ),
    "sampling-temperature-zero": Case(
        BATCH + " --do-sample --temperature 0",
        ERR,
        ("--temperature", "temperature=0"),
        {"in.jsonl": ONE},
        absent=("o.jsonl",),
    ),
    "sampling-seed-out-of-range": Case(
        BATCH + " --do-sample --seed -1", ERR, ("--seed", "seed=-1"), {"in.jsonl": ONE}
    ),
    "sampling-flag-without-do-sample": Case(
        BATCH + " --seed 3",
        OK,
        ("alisa batch: warning: --seed ignored without --do-sample (greedy decoding)",),
        {"in.jsonl": ONE},
    ),
    # each number of the memory line says what it counts
    "memory-line-names-what-it-counts": Case(
        BATCH + " --gpu-memory 100MiB --kv-memory 1MiB",
        OK,
        (
            "peak memory",
            "the whole process's resident memory",
            "batches sized to fit 100.0 MiB of weights + KV + activations (--gpu-memory 100MiB)",
            "1.0 MiB of KV (--kv-memory 1MiB)",
        ),
        {"in.jsonl": ONE},
        unsaid=("(budget",),
    ),
    # a budget that no policy of the sweep takes
    "experiment-dense-only-with-ratio": Case(
        SMOKE + " --set sweep.policy=dense --set runtime.results_dir='{tmp}/results'",
        ERR,
        ("sweep.caching_ratio=[0.5]", "'dense'", "keeps every token", "evicting policy"),
        absent=("results",),
    ),
    "experiment-dense-only-with-budget-tokens": Case(
        SMOKE + " --set sweep.policy=dense --set sweep.caching_ratio=1.0 "
        "--set sweep.budget_tokens=100 --set runtime.results_dir='{tmp}/results'",
        ERR,
        ("sweep.budget_tokens=[100]", "keeps every token"),
        absent=("results",),
    ),
    "experiment-dense-only-at-ratio-one": Case(  # nothing dropped: runs (no data: data error)
        SMOKE + " --set sweep.policy=dense --set sweep.caching_ratio=1.0 "
        "--data-dir {tmp}/no-data --set runtime.results_dir='{tmp}/results'",
        ERR,
        ("no-data",),
        # r = 1 is taken silently (smoke.toml's min_budget_tokens, which no dense point reads,
        # is warned of: sweep.min_budget_tokens has no effect in any point)
        unsaid=("sweep.caching_ratio",),
    ),
}


@pytest.fixture(scope="module")
def more_models(models, tmp_path_factory) -> dict:
    """``models`` plus ``truncated``: the tiny model with half its ``model.safetensors``."""
    folder = tmp_path_factory.mktemp("truncated")
    for item in Path(models["model"]).iterdir():
        data = item.read_bytes()
        (folder / item.name).write_bytes(
            data[: len(data) // 2] if item.name == "model.safetensors" else data
        )
    return {**models, "truncated": str(folder)}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_outputs(name, tmp_path, more_models, capsys, monkeypatch):
    check_case(CASES[name], tmp_path, more_models, capsys, monkeypatch)


def _batch(source: Path, target: Path | str, models: dict, *flags: str) -> list[str]:
    argv = ["batch", str(source), "-o", str(target), "--model", models["model"], "--no-progress"]
    return argv + ["--max-new-tokens", "2", *flags]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# 1. One output, two writers, through another name


@pytest.mark.parametrize("link", ["symlink", "hardlink", "dangling-symlink", "dotdot"])
def test_a_second_writer_through_another_name_is_refused(
    link, tmp_path, models, capsys, monkeypatch
):
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(ONE)
    other = tmp_path / "other"
    if link != "dangling-symlink":
        target.write_bytes(ROW)
    if link == "hardlink":
        os.link(target, other)
    elif link == "dotdot":
        (tmp_path / "sub").mkdir()
        other = tmp_path / "sub" / ".." / "out.jsonl"
    else:
        other.symlink_to(target)
    with output_lock(target):  # the first run writes out.jsonl
        code, _, err = run_cli(_batch(source, other, models), capsys, monkeypatch, None)
        assert code == ERR, err
        assert "another alisa run" in err and str(other) in err and "Traceback" not in err
    if link == "dangling-symlink":
        assert not target.exists()  # the first run's empty file, gone with it
    else:
        assert target.read_bytes() == ROW
    code, _, err = run_cli(_batch(source, other, models), capsys, monkeypatch, None)
    assert code == OK, err  # released: the next run works, through the other name too


def test_the_lock_is_the_files_own_whatever_it_is_called(tmp_path):
    target, link = tmp_path / "out.jsonl", tmp_path / "link"
    target.write_bytes(ROW)
    os.link(target, link)
    with (
        output_lock(link),
        pytest.raises(ValueError, match="another alisa run"),
        output_lock(target),
    ):
        pass
    with output_lock(target):  # released
        pass
    assert target.read_bytes() == ROW and link.read_bytes() == ROW
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "out.jsonl"]  # no lock file


def test_a_killed_writer_leaves_no_stuck_lock(tmp_path, models, capsys, monkeypatch):
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(ONE)
    # A process that locks the output and is killed holding it: the kernel releases the lock.
    holder = "import fcntl, os, signal, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
    holder += "fcntl.flock(fd, fcntl.LOCK_EX); os.kill(os.getpid(), signal.SIGKILL)"
    subprocess.run([sys.executable, "-c", holder, str(target)], check=False)
    code, _, err = run_cli(_batch(source, target, models), capsys, monkeypatch, None)
    assert code == OK, err
    assert [row["id"] for row in _lines(target)] == ["a"]


def test_a_refused_or_failed_lock_holder_removes_only_the_empty_file_it_created(tmp_path):
    target = tmp_path / "out.jsonl"
    with output_lock(target) as held:
        assert held.created and target.exists()
    assert not target.exists()  # created empty, not kept: gone
    with output_lock(target) as held:
        held.keep()
    assert target.read_bytes() == b""  # a finished run's output stays, even empty
    with output_lock(target) as held:
        assert not held.created
    assert target.exists()  # not created by this lock: never removed


# 4. The input from a pipe, read once


def test_a_fifo_input_is_read_once_and_its_rows_run(tmp_path, models, capsys, monkeypatch):
    fifo, target = tmp_path / "in.fifo", tmp_path / "out.jsonl"
    os.mkfifo(fifo)

    def write() -> None:
        with fifo.open("wb") as handle:  # blocks until the command opens the FIFO to read
            handle.write(TWO)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    code, _, err = run_cli(_batch(fifo, target, models), capsys, monkeypatch, None)
    writer.join(timeout=60)
    assert code == OK, err
    assert "2 prompts done" in err
    assert [row["id"] for row in _lines(target)] == ["a", "b"]


def test_dev_stdin_from_a_pipe_runs_its_rows(tmp_path, models):
    target = tmp_path / "out.jsonl"
    argv = _batch(Path("/dev/stdin"), target, models)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "alisa.cli", *argv], input=TWO, capture_output=True, env=env
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert b"2 prompts done" in done.stderr
    assert [row["id"] for row in _lines(target)] == ["a", "b"]


def test_stdin_input_is_refused_under_torchrun(tmp_path, capsys, monkeypatch):
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    argv = ["batch", "-", "-o", str(tmp_path / "o.jsonl"), "--no-progress"]
    code, _, err = run_cli(argv, capsys, monkeypatch, ONE)
    assert code == ERR and "every rank reads it" in err and "Traceback" not in err
    assert not (tmp_path / "o.jsonl").exists()


# 8. alisa batch --do-sample --seed S


def _sampled(tmp_path: Path, name: str, data: bytes, models, capsys, monkeypatch, *flags):
    source, target = tmp_path / f"{name}.in.jsonl", tmp_path / f"{name}.jsonl"
    source.write_bytes(data)
    argv = _batch(source, target, models, "--do-sample", *flags)
    argv[argv.index("--max-new-tokens") + 1] = "16"
    code, _, err = run_cli(argv, capsys, monkeypatch, None)
    assert code == OK, err
    return {row["id"]: row["text"] for row in _lines(target)}


def test_batch_sampling_flags_seed_every_row(tmp_path, models, capsys, monkeypatch):
    def sampled(name: str, data: bytes, *flags: str) -> dict:
        return _sampled(tmp_path, name, data, models, capsys, monkeypatch, *flags)

    three = ONE + b'{"id": "b", "prompt": "Yo there"}\n{"id": "c", "prompt": "A longer one"}\n'
    first = sampled("first", three, "--seed", "3")
    assert sampled("again", three, "--seed", "3") == first  # reproducible
    assert sampled("alone", ONE, "--seed", "3")["a"] == first["a"]  # whatever shares its batch
    assert sampled("other", three, "--seed", "4") != first  # the seed is used
    own = b'{"id": "a", "prompt": "Hi", "seed": 3}\n'  # a row's own seed overrides the flag
    assert sampled("own", own, "--seed", "4")["a"] == first["a"]


# 2. Two experiment runs of one config


def test_a_second_experiment_run_of_one_config_is_refused(workspace, capsys):
    root, model_dir, data = workspace
    config = write_config(root, model_dir, data, name="two-runs")
    argv = ["--config", str(config), "--set", "sweep.task=copa", "--set", "sweep.policy=swa"]
    argv += ["--no-progress"]
    assert run_main(argv) == 0
    folder = only_run(root, "two-runs")
    first = rows(folder)
    with locked(folder, "held by the test"):  # the first run, still writing
        assert run_main(argv) == 1
    err = capsys.readouterr().err
    assert "another experiment run is writing" in err and str(folder) in err
    assert rows(only_run(root, "two-runs")) == first  # nothing added, no second folder
    assert run_main(argv) == 0  # released: the next run resumes (nothing left to do)
    assert rows(only_run(root, "two-runs")) == first


# 7. A dense point's budget


def test_a_dense_point_crossed_with_ratios_runs_once_and_says_so(workspace, capsys):
    root, model_dir, data = workspace
    config = write_config(root, model_dir, data, name="dense-note")
    overrides = ["sweep.task=copa", "sweep.policy=dense,swa", "sweep.caching_ratio=0.5"]
    points = load_config(config, overrides).points()
    assert [(p["policy"], p["caching_ratio"]) for p in points] == [("dense", 1.0), ("swa", 0.5)]
    argv = ["--config", str(config), "--no-progress"]
    assert run_main(argv + [item for o in overrides for item in ("--set", o)]) == 0
    err = capsys.readouterr().err
    assert "sweep.caching_ratio [0.5] applies to the evicting policies" in err
    assert "runs once, recorded at caching_ratio=1.0" in err
    recorded = rows(only_run(root, "dense-note"))
    points = [(r["point"]["policy"], r["point"]["caching_ratio"]) for r in recorded]
    assert points == [("dense", 1.0), ("swa", 0.5)]


def test_a_dense_point_of_a_host_sweep_runs_with_dropping(workspace):
    """``retention="host"`` keeps on the host what a policy leaves out, and dense leaves out
    nothing (AlisaConfig refuses the pair): a sweep crossing them runs dense once, recorded with
    ``retention="drop"``, and the evicting policy with host retention."""
    root, model_dir, data = workspace
    config = write_config(root, model_dir, data, name="dense-host")
    overrides = ["sweep.task=copa", "sweep.policy=dense,swa", "sweep.retention=host"]
    overrides.append("sweep.caching_ratio=0.5")
    points = load_config(config, overrides).points()
    assert [(p["policy"], p["retention"]) for p in points] == [("dense", "drop"), ("swa", "host")]
