"""Issue 67, third tour (helper A1): thread counts, plan's dtype, the cache directory, the
partition table's flags and JSONL inputs that are not one row per line.

``--threads`` (or ``OMP_NUM_THREADS``) past what the kernel lets a process start is refused
before torch starts a thread; ``alisa plan --dtype auto`` plans the model's own dtype as the
commands that load it do; an ``ALISA_CACHE_DIR`` that is a file is named before a conversion;
``--partition table`` names the flag it lacks; rows separated by ``\\r`` alone and an input
that never ends a line are refused saying so.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import test_bad_input
from test_bad_input import ERR, OK, Case, check_case, run_cli
from test_profile_fit import profile

import alisa.jsonl
import alisa.threads
from alisa.jobs import read_requests
from alisa.model.loading import cache_root
from alisa.planning.hardware import cpu_model
from alisa.threads import choose_threads, max_threads

models = test_bad_input.models  # the tiny models saved, as a user's would be

# A model path that does not exist: a case refused with it was refused before loading.
NO_MODEL = "--model {tmp}/no-such-model"
BATCH = "batch {tmp}/in.jsonl -o {tmp}/o.jsonl --no-progress " + NO_MODEL
TWO_ROWS_CR = b'{"id": "a", "prompt": "Hi"}\r{"id": "b", "prompt": "Yo"}\r'
TWO_ROWS_CRLF = b'{"id": "a", "prompt": "Hi"}\r\n{"id": "b", "prompt": "Yo"}\r\n'

CASES = {
    # 12: the table is given; what is missing is its entry, named by its flag
    "partition-table-without-key": Case(
        "generate hi --parallel kvr --partition table --partition-table {tmp}/t.json " + NO_MODEL,
        ERR,
        ("--partition table needs --partition-key (the entry of --partition-table to use)",),
        unsaid=("table_key", "table_path", "--partition-table (", "no-such-model"),
    ),
    "partition-table-without-either": Case(
        "generate hi --parallel kvr --partition table " + NO_MODEL,
        ERR,
        (
            "--partition table needs --partition-table (the JSON table of splits) and "
            "--partition-key (the entry of --partition-table to use)",
        ),
        unsaid=("table_key", "table_path"),
    ),
    # 13: old Mac line ends: the whole file reads as one line holding every row
    "rows-separated-by-cr-only": Case(
        BATCH,
        ERR,
        (
            "in.jsonl:1: rows are separated by '\\r' only (old Mac line ends); JSONL needs one row "
            "per line ending in '\\n'",
        ),
        {"in.jsonl": TWO_ROWS_CR},
        absent=("o.jsonl",),
        unsaid=("Extra data", "no-such-model"),
    ),
    "malformed-row-still-said-so": Case(
        BATCH,
        ERR,
        ("in.jsonl:1: malformed JSON (Extra data)",),
        {"in.jsonl": b'{"id": "a", "prompt": "Hi"} {"id": "b"}\r\n'},
        absent=("o.jsonl",),
        unsaid=("'\\r' only",),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_tour3_a1(name, tmp_path, models, capsys, monkeypatch):
    check_case(CASES[name], tmp_path, models, capsys, monkeypatch)


# 1: the kernel's limits, as a machine whose vm.max_map_count is the usual 65530 has them
@pytest.fixture
def usual_limits(tmp_path, monkeypatch):
    maps = tmp_path / "max_map_count"
    maps.write_text("65530\n")
    monkeypatch.setattr(alisa.threads, "MAX_MAP_COUNT", maps)
    monkeypatch.setattr(alisa.threads, "THREADS_MAX", tmp_path / "none")
    monkeypatch.setattr(alisa.threads, "CGROUP_PIDS_MAX", tmp_path / "none")
    # 65530 mappings, two a thread, two threads a torch thread, half kept for the rest
    return 65530 // 2 // 2 // 2


THREAD_CASES = {
    "threads-past-the-limit": (
        Case(
            "generate hi --threads 100000 " + NO_MODEL,
            ERR,
            (
                "threads=100000 is more than this machine can start; give at most 8191",
                "vm.max_map_count=65530",
                "2 usable CPU(s)",
            ),
            unsaid=("no-such-model", "Traceback"),
        ),
        None,
    ),
    "omp-num-threads-past-the-limit": (
        Case(
            "profile --model none --output {tmp}/p.json",
            ERR,
            ("OMP_NUM_THREADS=100000 is more than this machine can start; give at most 8191",),
            absent=("p.json",),
        ),
        "100000",
    ),
}


@pytest.mark.parametrize("name", list(THREAD_CASES))
def test_thread_counts_past_the_limit(name, usual_limits, tmp_path, models, capsys, monkeypatch):
    case, omp = THREAD_CASES[name]
    monkeypatch.setattr(alisa.threads, "usable_cpus", lambda: 2)
    if omp is not None:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    check_case(case, tmp_path, models, capsys, monkeypatch)


def test_the_thread_limit_is_the_smallest_kernel_limit(usual_limits, tmp_path, monkeypatch):
    assert max_threads()[0] == usual_limits == 8191
    assert choose_threads(usual_limits, environ={}).threads == usual_limits
    with pytest.raises(ValueError, match="threads=8192 is more than this machine can start"):
        choose_threads(usual_limits + 1, environ={})
    pids = tmp_path / "pids.max"
    pids.write_text("400\n")  # a container's cgroup allows fewer
    monkeypatch.setattr(alisa.threads, "CGROUP_PIDS_MAX", pids)
    assert max_threads() == (100, "the cgroup's pids.max=400 allows 400 threads")
    pids.write_text("max\n")  # no pids limit: the mappings decide again
    assert max_threads()[0] == usual_limits


def test_no_known_limit_bounds_nothing(tmp_path, monkeypatch):
    for name in ("MAX_MAP_COUNT", "THREADS_MAX", "CGROUP_PIDS_MAX"):
        monkeypatch.setattr(alisa.threads, name, tmp_path / "none")
    assert max_threads() is None
    assert choose_threads(100000, environ={}).threads == 100000  # chosen, not started


# 6: plan's --dtype auto is the model's own dtype (float32 for the tiny models)
def _plan(argv: list[str], capsys, monkeypatch) -> tuple[dict, str]:
    code, out, err = run_cli(["plan", *argv, "--json"], capsys, monkeypatch, None)
    assert code == OK, err
    return json.loads(out), err


def _profile(path: Path, dtype: str) -> str:
    """A profile of this CPU calibrated in ``dtype``: only the dtype can differ from the plan."""
    profile(cpu_model=cpu_model(), dtype=dtype).save(path)
    return str(path)


def test_plan_dtype_auto_is_the_model_dtype(tmp_path, models, capsys, monkeypatch):
    flags = ["--model", models["model"], "--gpu-memory", "2MB", "--prompt-len", "32"]
    flags += ["--gen-len", "8", "--profile", _profile(tmp_path / "bf16.json", "bfloat16")]
    auto, warned = _plan([*flags, "--dtype", "auto"], capsys, monkeypatch)
    float32, _ = _plan([*flags, "--dtype", "float32"], capsys, monkeypatch)
    bfloat16, _ = _plan([*flags, "--dtype", "bfloat16"], capsys, monkeypatch)
    assert auto["peak_device_bytes"] == float32["peak_device_bytes"]
    assert auto["peak_device_bytes"] > bfloat16["peak_device_bytes"]
    assert "profile was calibrated in bfloat16, the plan uses float32" in warned
    flags[-1] = _profile(tmp_path / "fp32.json", "float32")
    assert "calibrated" not in _plan([*flags, "--dtype", "auto"], capsys, monkeypatch)[1]


def test_plan_dtype_auto_of_a_preset_is_float16(capsys, monkeypatch):
    flags = ["--model", "opt-13b", "--hardware", "a100-40gb"]
    auto, _ = _plan([*flags, "--dtype", "auto"], capsys, monkeypatch)
    assert auto == _plan([*flags, "--dtype", "float16"], capsys, monkeypatch)[0]


def test_plan_dtype_auto_needs_a_config_dtype(tmp_path, models, capsys, monkeypatch):
    config = json.loads((Path(models["model"]) / "config.json").read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    case = Case(
        "plan --model {tmp} --dtype auto",
        ERR,
        ("--dtype auto: the config of", "names no dtype", "give --dtype float32, bfloat16"),
    )
    check_case(case, tmp_path, models, capsys, monkeypatch)


# 11: a cache directory that is a file is named before any conversion
CACHE_CASES = {
    "cache-dir-is-a-file": ("cache", "ALISA_CACHE_DIR='{tmp}/cache' is a file, not a directory"),
    "cache-dir-under-a-file": (
        "cache/sub",
        "ALISA_CACHE_DIR='{tmp}/cache/sub': '{tmp}/cache' in its path is a file",
    ),
}


@pytest.mark.parametrize("name", list(CACHE_CASES))
def test_cache_dir_that_is_a_file(name, tmp_path, models, capsys, monkeypatch):
    folder, message = CACHE_CASES[name]
    monkeypatch.setenv("ALISA_CACHE_DIR", f"{tmp_path}/{folder}")
    case = Case(
        "generate hi --model {tmp}/m.gguf",
        ERR,
        (message.format(tmp=tmp_path), "point ALISA_CACHE_DIR at a directory"),
        {"cache": b"a user's file", "m.gguf": b"GGUF not really"},
        unsaid=("converting", "Errno"),
    )
    check_case(case, tmp_path, models, capsys, monkeypatch)


def test_cache_root_names_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("ALISA_CACHE_DIR", str(tmp_path / "new" / "cache"))
    assert cache_root() == tmp_path / "new" / "cache"  # missing folders are made when used
    (tmp_path / "xdg").write_text("")
    monkeypatch.delenv("ALISA_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with pytest.raises(ValueError, match="XDG_CACHE_HOME=.* is a file, not a directory"):
        cache_root()


# 13: CRLF rows are still read; 21: the bound on a line, at its edge
def test_crlf_rows_are_read(tmp_path):
    (tmp_path / "in.jsonl").write_bytes(TWO_ROWS_CRLF)
    assert [r.prompt for r in read_requests(tmp_path / "in.jsonl")] == ["Hi", "Yo"]


# A row bound a test can reach: 64 MiB in a file (or /dev/zero, as the tour ran it, which a
# regression would read forever) is what users meet.
BOUND = 1024
ZEROS = b"\0" * (BOUND + 1)  # NUL is valid UTF-8: past the bound, only JSON would refuse it

BOUND_CASES = {
    "file-without-newlines": Case(
        "batch {tmp}/zeros.bin -o {tmp}/o.jsonl --no-progress --max-new-tokens 2 " + NO_MODEL,
        ERR,
        ("zeros.bin:1: a line longer than 1.0 KiB without a newline; is this a JSONL file?",),
        {"zeros.bin": ZEROS},
        absent=("o.jsonl",),
        unsaid=("no-such-model", "malformed"),
    ),
    "stdin-second-line-too-long": Case(
        "batch - -o {tmp}/o.jsonl --no-progress " + NO_MODEL,
        ERR,
        ("stdin:2: a line longer than 1.0 KiB without a newline",),
        stdin=b'{"id": "a", "prompt": "Hi"}\n' + ZEROS,
        absent=("o.jsonl",),
    ),
}


@pytest.mark.parametrize("name", list(BOUND_CASES))
def test_a_line_past_the_bound(name, tmp_path, models, capsys, monkeypatch):
    monkeypatch.setattr(alisa.jsonl, "MAX_LINE_BYTES", BOUND)
    check_case(BOUND_CASES[name], tmp_path, models, capsys, monkeypatch)


def test_a_line_at_the_bound_is_read(tmp_path, monkeypatch):
    row = b'{"id": "a", "prompt": "Hi"}'
    monkeypatch.setattr(alisa.jsonl, "MAX_LINE_BYTES", len(row))
    (tmp_path / "in.jsonl").write_bytes(row + b"\n" + row.replace(b'"a"', b'"b"'))
    assert [r.id for r in read_requests(tmp_path / "in.jsonl")] == ["a", "b"]
