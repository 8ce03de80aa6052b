"""experiments.bench_serve: real servers under load (table + one JSON line), errors counted by
kind, a run bounded by --duration-s, servers always stopped, and bad flags refused."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import re
import socket
import sys
import threading
from pathlib import Path

import pytest
from conftest import tiny_llama
from serve_support import model_dir

from experiments import bench_serve
from experiments.bench_continuous import block_bytes
from experiments.bench_serve import (
    Answer,
    ServerError,
    drain_measures,
    measures,
    parse_args,
    poisson_arrivals,
    run_load,
    server_env,
    serving,
    stream_completion,
)
from experiments.timeline import PauseWatch
from experiments.timing import environment

PROSE = Path(__file__).parent / "fixtures" / "prose.txt"


def xsum_fixture(root: Path, count: int = 8) -> Path:
    """A data directory whose ``xsum/h2o_xsum_0shot.jsonl`` holds ``count`` articles of the
    prose fixture in H2O's 0-shot layout (not XSum: the benchmark only reads the fields)."""
    sentences = [s.strip() for s in PROSE.read_text(encoding="utf-8").split(". ") if s.strip()]
    folder = root / "data" / "xsum"
    folder.mkdir(parents=True)
    rows = [
        {"article": f"###\nArticle: {sentence}.\n\nSummarize the article.\n", "summary_gt": "-"}
        for sentence in sentences[:count]
    ]
    (folder / "h2o_xsum_0shot.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root / "data"


def json_line(out: str) -> dict:
    """The one JSON line a run prints, last."""
    lines = out.strip().splitlines()
    assert sum(line.startswith("{") for line in lines) == 1
    assert lines[-1].startswith("{")
    return json.loads(lines[-1])


def table_row(out: str, system: str) -> list[str]:
    """The cells of ``system``'s table row."""
    rows = [line for line in out.splitlines() if line.startswith(f"| {system} |")]
    assert len(rows) == 1, out
    return [cell.strip() for cell in rows[0].strip("|").split("|")]


def test_alisa_and_transformers_serve_the_same_workload(tmp_path, capsys):
    """Both real servers on the tiny model: every answer complete with exactly --max-tokens
    tokens, the same prompt tokens, alisa's peak KV scraped within the budget, transformers'
    paged cache sized to it, both servers stopped by SIGTERM."""
    folder, data = model_dir(tmp_path), xsum_fixture(tmp_path)
    argv = ["--model", str(folder), "--data-dir", str(data), "--prompts", "6", "--clients"]
    argv += ["2", "--max-tokens", "16", "--rate", "inf", "--threads", "1", "--kv-budget"]
    argv += ["1MiB", "--systems", "alisa-r0.2,transformers", "--scrape-s", "0.01"]
    assert bench_serve.main(argv) == 0
    out = capsys.readouterr().out
    report = json_line(out)
    alisa, paged = report["systems"]
    assert [alisa["system"], paged["system"]] == ["alisa-r0.2", "transformers"]
    for row in (alisa, paged):
        assert "error" not in row, row
        assert (row["sent"], row["completed"], row["errors"], row["short"]) == (6, 6, 0, 0)
        assert row["output_tokens"] == 6 * 16 and row["not_sent"] == row["cut_off"] == 0
        assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"]
        assert 0 < row["itl_p50_s"] <= row["itl_p99_s"]
        assert row["requests_per_s"] > 0 and row["output_tokens_per_s"] > 0
        assert row["machine"].keys() == environment(1).keys()
        assert table_row(out, row["system"])[1] == "6 / 6"
    assert alisa["prompt_tokens"] == paged["prompt_tokens"] > 0
    # Scraped while rows ran (a gauge sampled every 10 ms, rows running 16 steps).
    assert alisa["kv_scrapes"] > 1
    assert 0 < alisa["peak_kv_bytes"] <= alisa["kv_budget_bytes"] == 1024 * 1024
    assert alisa["server_cache"]["policy"] == "swa"
    assert alisa["server_cache"]["caching_ratio"] == "0.2"
    assert alisa["server_exit"] == "0" and paged["server_exit"] in ("0", "SIGTERM")
    assert "--cb-num-blocks" in paged["command"] and paged["peak_kv_bytes"] is None
    # the engine's own step time, from /metrics (transformers has none)
    assert alisa["steps"] >= 16 and alisa["step_mean_s"] > 0 and paged["step_mean_s"] is None
    assert "engine steps" in table_row(out, "alisa-r0.2")[-1]
    block = paged["kv_budget_bytes"] // paged["num_blocks"]
    model = tiny_llama()  # the model served, in float32
    assert block == block_bytes(model.config, model.dtype, page_size=16)
    assert paged["kv_budget_bytes"] <= 1024 * 1024 < paged["kv_budget_bytes"] + block
    # the server's "auto" resolved on this machine (a CPU: numba's kernels), named by /metrics
    assert alisa["server_cache"]["kernels"] == "auto" and "paged" in paged["kernels"]
    assert alisa["kernels"] == alisa["server_cache"]["kernels_run"]
    assert alisa["kernels"].startswith("cpu (numba): ")
    assert report["ratios"]["tok_s_r0.2_vs_transformers"] == pytest.approx(
        alisa["output_tokens_per_s"] / paged["output_tokens_per_s"]
    )


def test_a_sigterm_under_load_drains_and_loses_nothing(tmp_path, capsys):
    """``--sigterm-after-s``: the real server is told to stop while requests arrive; every
    request completes or is refused (503 while draining, closed unanswered as it exits), none
    is broken off, and the server exits 0."""
    folder, data = model_dir(tmp_path), xsum_fixture(tmp_path)
    argv = ["--model", str(folder), "--data-dir", str(data), "--prompts", "8", "--clients"]
    argv += ["2", "--max-tokens", "48", "--rate", "3", "--threads", "1", "--kv-budget", "1MiB"]
    argv += ["--systems", "alisa-r0.2", "--sigterm-after-s", "0.5"]
    assert bench_serve.main(argv) == 0
    out = capsys.readouterr().out
    (row,) = json_line(out)["systems"]
    drain = row["drain"]
    seen = (drain, row["server_exit"], row["error_kinds"], row["error_examples"])
    assert drain["lost"] == 0 and row["server_exit"] == "0", seen
    assert drain["completed"] + drain["refused"] == row["sent"] == 8
    assert drain["completed"] >= 1 and drain["refused"] >= 1  # the signal fell mid-load
    assert "SIGTERM at 0.5 s" in table_row(out, "alisa-r0.2")[-1]


# --------------------------------------------------------------------------- a fake server


class FakeOpenAI(http.server.BaseHTTPRequestHandler):
    """Streams an answer whose behaviour the prompt names: ``ok`` (3 tokens, ``[DONE]``),
    ``short`` (2 tokens, EOS), ``refuse`` (400, OpenAI's error body), ``detail`` (422,
    FastAPI's), ``event`` (an error event mid-stream), ``break`` (closes without a finish
    reason), ``hangup`` (closes without a status line), ``slow`` (a token every 50 ms until the
    client leaves)."""

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["prompt"]
        if prompt == "hangup":  # as a server that exits closes a connection it has not answered
            self.close_connection = True
            return
        if prompt in ("refuse", "detail"):
            error = (
                {"error": {"message": "the prompt is too long", "code": "exceeds_budget"}}
                if prompt == "refuse"
                else {"detail": "Unexpected fields in the request: {'ignore_eos'}"}
            )
            self._reply(400 if prompt == "refuse" else 422, json.dumps(error))
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chunk = {"choices": [{"index": 0, "text": "a", "finish_reason": None}]}
        if prompt == "slow":
            with contextlib.suppress(OSError):  # until the client hangs up
                while True:
                    self._event(chunk)
                    threading.Event().wait(0.05)
            return
        tokens = {"ok": 3, "short": 2}.get(prompt, 1)
        for _ in range(tokens):
            self._event(chunk)
        if prompt == "event":
            self._event({"error": {"message": "the engine failed", "code": "internal_error"}})
        elif prompt == "ok" or prompt == "short":
            reason = "length" if prompt == "ok" else "stop"
            self._event({"choices": [{"index": 0, "text": "", "finish_reason": reason}]})
            usage = {"prompt_tokens": 2, "completion_tokens": tokens}
            self._event({"choices": [], "usage": usage})
            self.wfile.write(b"data: [DONE]\n\n")

    def _event(self, payload: dict) -> None:
        self.wfile.write(f"data: {json.dumps(payload)}\n\n".encode())
        self.wfile.flush()

    def _reply(self, status: int, text: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(text)))
        self.end_headers()
        self.wfile.write(text.encode())


@pytest.fixture
def fake_port():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def load(port: int, prompts: list[str], *flags: str):
    """(row measures, answers) of ``prompts`` sent to the server on ``port``."""
    args = parse_args(["--max-tokens", "3", "--rate", "inf", *flags])
    bodies = [{"prompt": prompt, "stream": True} for prompt in prompts]
    with PauseWatch() as watch:
        result = run_load(port, bodies, poisson_arrivals(len(bodies), args.rate, 0), args)
        return measures(result, args, watch), [answer for answer in result if answer]


def test_errors_are_counted_by_kind_and_short_answers_apart(fake_port):
    prompts = ["ok", "refuse", "ok", "event", "break", "short", "detail", "hangup"]
    row, answers = load(fake_port, prompts, "--clients", "3")
    assert (row["sent"], row["completed"], row["errors"], row["short"]) == (8, 3, 5, 1)
    assert row["error_kinds"] == {
        "HTTP 400": 1,
        "error event": 1,
        "stream ended early": 1,
        "HTTP 422": 1,
        "no answer: RemoteDisconnected": 1,
    }
    assert row["error_examples"]["HTTP 400"] == "[exceeds_budget] the prompt is too long"
    assert row["error_examples"]["HTTP 422"].startswith("Unexpected fields")
    assert row["error_examples"]["error event"] == "[internal_error] the engine failed"
    assert row["output_tokens"] == 3 + 3 + 2  # the usage's counts, of the answers completed
    assert [answer.ok for answer in answers] == [
        True,
        False,
        True,
        False,
        False,
        True,
        False,
        False,
    ]
    assert row["cut_off"] == row["not_sent"] == 0


def test_a_drain_counts_what_the_server_never_took_as_refused(fake_port):
    """A 503 and a connection closed or refused before a status line were never taken; a
    stream broken off after its 200 was: lost."""
    row, answers = load(fake_port, ["ok", "refuse", "hangup", "break"], "--clients", "1")
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, not listening: the connection is refused
    nobody = stream_completion(closed.getsockname()[1], {}, timeout_s=5, deadline_s=1e12)
    closed.close()
    assert nobody.error == "no answer: ConnectionRefusedError"
    busy = Answer(sent_s=0.0, error="HTTP 503")
    drain = drain_measures([*answers, nobody, busy, None], after_s=0.5, signalled=-1.0)
    assert (drain["completed"], drain["refused"], drain["lost"]) == (1, 3, 2)
    assert drain["completed_after_signal"] == 1


def test_a_request_past_its_timeout_is_an_error(fake_port):
    row, _ = load(fake_port, ["slow", "ok"], "--clients", "1", "--request-timeout-s", "0.5")
    assert (row["completed"], row["errors"], row["cut_off"]) == (1, 1, 0)
    assert row["error_kinds"] == {"timed out": 1}


def test_the_run_stops_at_its_duration(fake_port):
    """Streams that never end: the run returns, the two running cut off (not errors), the
    rest never sent."""
    done = {}

    def run() -> None:
        done["row"], _ = load(fake_port, ["slow"] * 6, "--clients", "2", "--duration-s", "1")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)  # it returns at all: a generous guard, not a measurement
    assert not thread.is_alive()
    row = done["row"]
    assert (row["sent"], row["cut_off"], row["not_sent"], row["errors"]) == (2, 2, 4, 0)
    assert row["completed"] == 0 and row["requests_per_s"] == 0


def test_poisson_arrivals_are_seeded_and_ordered():
    first, again = poisson_arrivals(50, 4.0, seed=3), poisson_arrivals(50, 4.0, seed=3)
    assert first == again and first[0] == 0.0 and len(first) == 50
    assert all(a < b for a, b in zip(first, first[1:], strict=False))
    assert poisson_arrivals(50, 4.0, seed=4) != first
    assert poisson_arrivals(3, float("inf"), seed=0) == [0.0, 0.0, 0.0]


# --------------------------------------------------------------------------- server processes

# A stand-in server: prints its address, answers GET /health; "stubborn" ignores SIGTERM.
STAND_IN = """
import http.server, signal, sys
if sys.argv[1] == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", 0), Health)
print(f"listening on http://127.0.0.1:{server.server_port}", flush=True)
server.serve_forever()
"""


@pytest.mark.parametrize(("mode", "ended"), [("polite", "SIGTERM"), ("stubborn", "killed")])
def test_servers_are_stopped_and_a_stubborn_one_killed(mode, ended, tmp_path):
    args = parse_args(["--stop-timeout-s", "1", "--startup-timeout-s", "60"])
    command = [sys.executable, "-c", STAND_IN, mode]
    with serving(command, server_env(args), tmp_path / "log", args) as server:
        assert server.port > 0 and server.process.poll() is None
    assert server.process.poll() is not None
    assert server.exit.startswith(ended)


def test_a_server_that_never_listens_is_stopped(tmp_path):
    args = parse_args(["--startup-timeout-s", "0.5", "--stop-timeout-s", "1"])
    command = [sys.executable, "-c", "import time; time.sleep(120)"]
    never = r"printed no address within --startup-timeout-s 0.5"
    with (
        pytest.raises(ServerError, match=never),
        serving(command, server_env(args), tmp_path / "log", args),
    ):
        pytest.fail("a server that never listens was yielded")
    leftover = [line for line in _children() if "time.sleep(120)" in line]
    assert leftover == []


def _children() -> list[str]:
    """Command lines of this process's children."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            if parent == os.getpid():
                found.append((entry / "cmdline").read_text().replace("\0", " "))
        except (OSError, ValueError, IndexError):
            continue
    return found


def test_a_system_that_cannot_start_is_an_error_row(tmp_path, capsys, monkeypatch):
    """transformers' command failing before it listens: the row names why, the run goes on."""
    failing = (sys.executable, "-c", "import sys; sys.exit('no serving here')")
    monkeypatch.setattr(bench_serve, "TRANSFORMERS_CLI", failing)
    folder, data = model_dir(tmp_path), xsum_fixture(tmp_path)
    argv = ["--model", str(folder), "--data-dir", str(data), "--prompts", "2"]
    assert bench_serve.main([*argv, "--systems", "transformers"]) == 0
    out = capsys.readouterr().out
    (row,) = json_line(out)["systems"]
    why = "the server exited with code 1 before listening: no serving here"
    assert row["error"] == why and row["machine"].keys() == environment(1).keys()
    assert table_row(out, "transformers")[-1] == f"error: {why}"


BAD_FLAGS = {
    "prompts-zero": (["--prompts", "0"], "--prompts=0 must be >= 1"),
    "clients-zero": (["--clients", "0"], "--clients=0 must be >= 1"),
    "rate-zero": (["--rate", "0"], "--rate=0.0 must be > 0"),
    "rate-nan": (["--rate", "nan"], "--rate=nan must be > 0"),
    "duration-negative": (["--duration-s", "-1"], "--duration-s=-1.0 must be a number"),
    "sigterm-zero": (["--sigterm-after-s", "0"], "--sigterm-after-s=0.0 must be seconds > 0"),
    "kv-budget-text": (["--kv-budget", "lots"], "--kv-budget='lots' is not a byte size"),
    "dtype-unknown": (["--dtype", "float8"], "--dtype 'float8'"),
    "system-unknown": (["--systems", "alisa-r1,vllm"], "--systems vllm unknown; valid: alisa-r0.2"),
    "data-missing": (["--data-dir", "{tmp}/none"], "data directory"),
    "model-not-a-model": (["--model", "{tmp}"], "holds no model (no config.json)"),
    "model-offline-hub-id": (["--model", "no/such-model"], "--model no/such-model: its tokenizer"),
    "model-unknown-shape": (["--model", "shape:nope"], "model='shape:nope' is not a known shape"),
    "too-few-prompts": (["--prompts", "99"], "--prompts 99: only 8 XSum prompts fit"),
}


@pytest.mark.parametrize("name", list(BAD_FLAGS))
def test_bad_flags_are_refused_naming_them(name, tmp_path, capsys):
    flags, needle = BAD_FLAGS[name]
    folder, data = model_dir(tmp_path), xsum_fixture(tmp_path)
    argv = ["--model", str(folder), "--data-dir", str(data)]
    capsys.readouterr()  # the model's saving, not the run
    code = bench_serve.main([*argv, *(flag.replace("{tmp}", str(tmp_path)) for flag in flags)])
    captured = capsys.readouterr()
    assert code == 1 and captured.out == ""
    assert captured.err.startswith("bench_serve: error: ") and needle in captured.err
    assert "Traceback" not in captured.err
    assert re.search(r"error: .+", captured.err)
