"""``alisa serve`` under load: Poisson arrivals of XSum prompts against real servers on 127.0.0.1.

    python -m experiments.bench_serve
    python -m experiments.bench_serve --prompts 16 --clients 2 --max-tokens 32   # quick

One workload for every system: the XSum articles the continuous-batching benchmark uses
(:func:`experiments.bench_continuous.build_workload`: the first ``--prompts`` whose chat prompt
fits ``--max-prompt-tokens``), sent as streamed ``/v1/completions`` requests, greedy, each asking
for exactly ``--max-tokens`` tokens whatever the model says (``ignore_eos``; transformers: a
generation config whose EOS is -1), so every system does the same work. Arrivals are a Poisson
process of ``--rate`` requests a second (seeded; ``inf``: all at once), and ``--clients`` requests
at most are in flight: a request that arrives while every client waits starts when one is free.

Each system is a server this benchmark starts on a free port of 127.0.0.1 (``--port 0``; the port
is read from what the server prints), waits for (``GET /health``), warms up with two short
requests, loads, then stops with SIGTERM (``alisa serve`` drains and exits 0; a server still up
``--stop-timeout-s`` later is killed). The run is bounded: no request starts after
``--duration-s``, requests still running then are cut off, and each request gives up after
``--request-timeout-s``.

Systems (``--systems``), all under the same KV byte budget ``--kv-budget``:
    alisa-r0.2        ``alisa serve --policy swa --caching-ratio 0.2 --kv-memory B``
    alisa-r1          ``alisa serve --policy dense --kv-memory B`` (every token kept)
    alisa-host-r0.2   SWA r = 0.2 with ``--retention host`` (not in the default set)
    transformers      ``transformers serve --continuous-batching``, sdpa over its paged cache
                      of ``--cb-num-blocks`` = the budget in blocks of ``--page-size`` tokens

Measured at the client, from the streamed chunks' arrival times: requests and output tokens a
second (over the time from the first request sent to the last answer's end), TTFT (request sent
to the first chunk with text) and inter-token latency (the gaps between a request's successive
chunks with text; a chunk that brings several tokens counts once, as ``vllm bench serve``
does) at p50 and p99, errors (HTTP errors, error events, broken or timed-out streams; by kind),
and answers shorter than ``--max-tokens``. Peak KV is the largest ``alisa_kv_bytes{tier="device"}``
scraped from ``/metrics`` during the run; transformers has no ``/metrics``, and its paged cache
is allocated whole. Prints a table and one JSON line; every row carries
:func:`alisa.record.machine_record` and the kernels the server runs where known. Seconds in
which this process was stopped from outside are left out of every time
(:class:`experiments.pauses.PauseWatch`).
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from alisa.sizes import format_bytes, parse_bytes
from experiments.data import data_dir

HOST = "127.0.0.1"
REPO = Path(__file__).resolve().parents[1]
# Both servers print their address once listening: alisa's "on http://HOST:PORT/v1", uvicorn's
# "Uvicorn running on http://HOST:PORT".
ADDRESS = re.compile(rf"http://{re.escape(HOST)}:(\d+)")
# transformers' continuous batching names the attention it switched to (to flash, where built).
SWITCHED = re.compile(r"Switching from (\S+) to (\S+?)\.")
WARM_UP_TOKENS = 4
POLL_S = 0.1
# How the benchmark runs transformers' command line (the console script's module).
TRANSFORMERS_CLI = (sys.executable, "-m", "transformers.cli.transformers")


@dataclass(frozen=True, kw_only=True)
class System:
    """One server to measure: ``alisa serve`` with ``flags``, or ``transformers serve``."""

    name: str
    server: str  # "alisa" or "transformers"
    flags: tuple[str, ...] = ()


SYSTEMS = {
    "alisa-r0.2": System(
        name="alisa-r0.2", server="alisa", flags=("--policy", "swa", "--caching-ratio", "0.2")
    ),
    "alisa-r1": System(name="alisa-r1", server="alisa", flags=("--policy", "dense")),
    "alisa-host-r0.2": System(
        name="alisa-host-r0.2",
        server="alisa",
        flags=("--policy", "swa", "--caching-ratio", "0.2", "--retention", "host"),
    ),
    "transformers": System(name="transformers", server="transformers"),
}
DEFAULT_SYSTEMS = "alisa-r0.2,alisa-r1,transformers"


def systems(names: list[str]) -> list[System]:
    """The systems named (see the module docstring), or a ``ValueError`` listing them."""
    if names == ["all"]:
        names = list(SYSTEMS)
    unknown = [name for name in names if name not in SYSTEMS]
    if unknown:
        raise ValueError(f"--systems {','.join(unknown)} unknown; valid: {', '.join(SYSTEMS)}")
    return [SYSTEMS[name] for name in names]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="as alisa serve --model")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--data-dir", default=None, help="holds xsum/h2o_xsum_0shot.jsonl")
    parser.add_argument("--prompts", type=int, default=64, help="requests sent at most")
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens every answer has")
    parser.add_argument("--rate", type=float, default=2.0, help="arrivals a second, or inf")
    parser.add_argument("--clients", type=int, default=16, help="requests in flight at most")
    parser.add_argument("--seed", type=int, default=0, help="of the arrival times")
    parser.add_argument("--kv-budget", default="160MiB", help="KV byte budget of every system")
    parser.add_argument("--max-rows", type=int, default=64, help="alisa serve --max-batch")
    parser.add_argument("--page-size", type=int, default=16, help="transformers' page (tokens)")
    parser.add_argument("--max-batch-tokens", type=int, default=1024, help="transformers' M")
    parser.add_argument("--systems", default=DEFAULT_SYSTEMS, help="comma-separated, or all")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each server")
    parser.add_argument("--duration-s", type=float, default=600.0, help="no request after it")
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    parser.add_argument("--startup-timeout-s", type=float, default=600.0)
    parser.add_argument("--stop-timeout-s", type=float, default=60.0)
    parser.add_argument("--scrape-s", type=float, default=0.25, help="/metrics scrape interval")
    parser.add_argument(
        "--logs", default=None, help="folder to keep the servers' logs in (default: discarded)"
    )
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """A ``ValueError`` naming the first flag out of range."""
    counts = ("prompts", "max_prompt_tokens", "max_tokens", "clients", "threads", "max_rows")
    for name in (*counts, "page_size", "max_batch_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if not args.rate > 0:  # nan fails too
        raise ValueError(f"--rate={args.rate} must be > 0 requests a second (or inf)")
    for name in ("duration_s", "request_timeout_s", "startup_timeout_s", "stop_timeout_s"):
        value = getattr(args, name)
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"--{name.replace('_', '-')}={value} must be a number of seconds > 0")
    if not (args.scrape_s > 0 and math.isfinite(args.scrape_s)):
        raise ValueError(f"--scrape-s={args.scrape_s} must be a number of seconds > 0")
    from alisa.model.loading import resolve_dtype

    try:
        resolve_dtype(args.dtype)
    except ValueError as error:
        raise ValueError(f"--dtype {args.dtype!r}: {error}") from None
    if parse_bytes(args.kv_budget, field="--kv-budget") < 1:
        raise ValueError(f"--kv-budget={args.kv_budget!r} must be at least one byte")


def poisson_arrivals(count: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each of ``count`` requests arrives: the first at once,
    then exponential gaps of mean ``1 / rate`` (seeded); all at once for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * count
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=count - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


# --------------------------------------------------------------------------- one request


@dataclass(kw_only=True)
class Answer:
    """What the client saw of one streamed request (``time.perf_counter()`` times)."""

    sent_s: float
    chunk_s: list[float] = field(default_factory=list)  # chunks that brought text
    end_s: float | None = None
    completion_tokens: int | None = None  # the usage chunk's, where one came
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None  # why it failed, short and stable (counted by kind)
    detail: str = ""  # the server's own words, for the record
    cut_off: bool = False  # still running when --duration-s ran out (not an error)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.cut_off

    @property
    def tokens(self) -> int:
        """Tokens of the answer: the server's count, else one a chunk."""
        return self.completion_tokens if self.completion_tokens is not None else len(self.chunk_s)


def stream_completion(port: int, body: dict, *, timeout_s: float, deadline_s: float) -> Answer:
    """Send one streamed completion and read its server-sent events to the end.

    Never raises for what the server or the network does: a status other than 200, an error
    event, a stream that breaks or stops, or no byte for ``timeout_s`` make ``error``; reaching
    ``deadline_s`` (``time.perf_counter()``) first closes the connection and sets ``cut_off``.
    """
    answer = Answer(sent_s=time.perf_counter())
    until = min(deadline_s, answer.sent_s + timeout_s)
    connection = http.client.HTTPConnection(HOST, port, timeout=max(until - answer.sent_s, 0.01))
    try:
        data = json.dumps(body).encode()
        connection.request(
            "POST", "/v1/completions", body=data, headers={"Content-Type": "application/json"}
        )
        # The socket the answer is read from (the connection drops it where the response
        # closes the connection at its end: HTTP/1.0, "Connection: close").
        sock = connection.sock
        response = connection.getresponse()
        if response.status != 200:
            _fail(answer, f"HTTP {response.status}", _error_text(response.read()))
            return answer
        _read_events(sock, response, answer, until)
    except TimeoutError:
        if until >= deadline_s:
            answer.cut_off = True
        else:
            _fail(answer, "timed out", f"no answer within --request-timeout-s {timeout_s:g}")
    except (OSError, http.client.HTTPException) as error:
        _fail(answer, f"connection: {type(error).__name__}", str(error))
    finally:
        connection.close()  # a request cut off is cancelled by the server when it sees this
        answer.end_s = time.perf_counter()
    return answer


def _read_events(sock: socket.socket, response, answer: Answer, until: float) -> None:
    """Read ``data:`` lines until ``[DONE]`` or the stream's end; raises ``TimeoutError`` at
    ``until``."""
    while True:
        left = until - time.perf_counter()
        if left <= 0:
            raise TimeoutError
        sock.settimeout(left)
        line = response.readline()
        if not line:  # transformers ends its streams without [DONE]
            if answer.finish_reason is None:
                _fail(answer, "stream ended early", "the stream closed before a finish_reason")
            return
        text = line.decode("utf-8", errors="replace").strip()
        if not text.startswith("data:"):
            continue
        payload = text[len("data:") :].strip()
        if payload == "[DONE]":
            if answer.finish_reason is None:
                _fail(answer, "stream ended early", "[DONE] before a finish_reason")
            return
        _take_event(answer, payload)
        if answer.error is not None:
            return


def _take_event(answer: Answer, payload: str) -> None:
    """One event's text, finish reason and usage, or its error."""
    now = time.perf_counter()
    try:
        event = json.loads(payload)
    except json.JSONDecodeError:
        _fail(answer, "bad event", payload[:200])
        return
    if "error" in event:
        _fail(answer, "error event", _error_text(payload.encode()))
        return
    for choice in event.get("choices") or []:
        if choice.get("text"):
            answer.chunk_s.append(now)
        if choice.get("finish_reason"):
            answer.finish_reason = choice["finish_reason"]
    usage = event.get("usage")
    if usage:
        answer.completion_tokens = usage.get("completion_tokens")
        answer.prompt_tokens = usage.get("prompt_tokens")


def _fail(answer: Answer, kind: str, detail: str) -> None:
    answer.error, answer.detail = kind, " ".join(detail.split())[:300]


def _error_text(body: bytes) -> str:
    """The message of an error body: OpenAI's ``error.message`` (with its code), FastAPI's
    ``detail``, else the body itself."""
    text = body.decode("utf-8", errors="replace")
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        return text
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if isinstance(error, dict):
        code = f"[{error['code']}] " if error.get("code") else ""
        return f"{code}{error.get('message', '')}"
    if isinstance(parsed, dict) and "detail" in parsed:
        return str(parsed["detail"])
    return str(error if error is not None else parsed)


# --------------------------------------------------------------------------- the load


@dataclass(kw_only=True)
class Load:
    """One pass of the workload through a server."""

    answers: list[Answer]  # the requests sent, in workload order
    not_sent: int  # arrived after --duration-s
    started_s: float
    ended_s: float


def run_load(
    port: int, bodies: list[dict], arrivals: list[float], args: argparse.Namespace
) -> Load:
    """Send ``bodies`` at ``arrivals`` (seconds from now), ``--clients`` in flight at most;
    returns by ``--duration-s`` plus at most a second of joining."""
    started = time.perf_counter()
    deadline = started + args.duration_s
    waiting: queue.Queue[int] = queue.Queue()
    for index in range(len(bodies)):
        waiting.put(index)
    answers: dict[int, Answer] = {}

    def client() -> None:
        while True:
            try:
                index = waiting.get_nowait()
            except queue.Empty:
                return
            due = started + arrivals[index]
            if max(due, time.perf_counter()) >= deadline:  # so is every later one
                return
            time.sleep(max(0.0, due - time.perf_counter()))
            answers[index] = stream_completion(
                port, bodies[index], timeout_s=args.request_timeout_s, deadline_s=deadline
            )

    threads = [
        threading.Thread(target=client, name=f"bench-client-{number}", daemon=True)
        for number in range(min(args.clients, len(bodies)))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:  # each request returns by the deadline (its reads time out there)
        thread.join(max(0.0, deadline + 1.0 - time.perf_counter()))
    sent = [answers[index] for index in sorted(answers)]
    ended = max((answer.end_s for answer in sent if answer.end_s), default=time.perf_counter())
    return Load(answers=sent, not_sent=len(bodies) - len(sent), started_s=started, ended_s=ended)


class PeakKV:
    """Scrapes ``/metrics`` every ``interval_s`` while used as a context manager: the largest
    ``alisa_kv_bytes{tier="device"}`` seen (None where the server has no such metric), and the
    last scrape's samples."""

    def __init__(self, port: int, interval_s: float) -> None:
        self.port, self.interval_s = port, interval_s
        self.peak: float | None = None
        self.scrapes = 0  # answered with the gauge
        self.last: dict[tuple[str, tuple], float] = {}
        self.info: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="bench-scrape", daemon=True)

    def __enter__(self) -> PeakKV:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)
        self.scrape()  # after the run: the counters' totals

    def _watch(self) -> None:
        while self.scrape() and not self._stop.wait(self.interval_s):
            pass

    def scrape(self) -> bool:
        """One scrape; False where the server has no Prometheus ``/metrics``."""
        from prometheus_client.parser import text_string_to_metric_families

        try:
            status, text = _get(self.port, "/metrics", timeout_s=10)
            if status != 200:
                return False
            families = list(text_string_to_metric_families(text))
        except (OSError, http.client.HTTPException, ValueError):
            return False
        samples = {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in families
            for sample in family.samples
        }
        device = samples.get(("alisa_kv_bytes", (("tier", "device"),)))
        if device is None:
            return False
        self.peak = device if self.peak is None else max(self.peak, device)
        self.scrapes += 1
        self.last = samples
        self.info = next(
            (dict(labels) for (name, labels) in samples if name == "alisa_cache_info"), {}
        )
        return True

    def total(self, name: str) -> float | None:
        """A counter's last value (labels summed), None if never scraped."""
        values = [value for (sample, _), value in self.last.items() if sample == name]
        return sum(values) if values else None


def _get(port: int, path: str, timeout_s: float) -> tuple[int, str]:
    connection = http.client.HTTPConnection(HOST, port, timeout=timeout_s)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read().decode("utf-8", errors="replace")
    finally:
        connection.close()


# --------------------------------------------------------------------------- the servers


class ServerError(RuntimeError):
    """A server that did not start, or stopped serving (the row says why)."""


@dataclass(kw_only=True)
class Server:
    """A server process this benchmark started, and where it listens."""

    process: subprocess.Popen
    log: Path
    port: int = 0
    exit: str = ""  # how it stopped: "0", "1", "SIGTERM" (died of it), "killed after ..."


@contextmanager
def serving(command: list[str], env: dict, log: Path, args: argparse.Namespace) -> Iterator[Server]:
    """Start ``command`` (a server printing its address), wait until ``/health`` answers, and
    always stop it on the way out: SIGTERM, then SIGKILL to its process group after
    ``--stop-timeout-s``. ``Server.exit`` says how it ended."""
    with log.open("w") as sink:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
            start_new_session=True,  # its own process group: killed whole if it hangs
        )
    server = Server(process=process, log=log)
    try:
        server.port = _wait_for_port(server, args.startup_timeout_s)
        _wait_healthy(server, args.startup_timeout_s)
        yield server
    finally:
        server.exit = _stop(process, args.stop_timeout_s)


def _wait_for_port(server: Server, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = ADDRESS.search(server.log.read_text(errors="replace"))
        if found:
            return int(found.group(1))
        code = server.process.poll()
        if code is not None:
            raise ServerError(
                f"the server exited with code {code} before listening: {_tail(server.log, 3)}"
            )
        time.sleep(POLL_S)
    raise ServerError(f"the server printed no address within --startup-timeout-s {timeout_s:g}")


def _wait_healthy(server: Server, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if _get(server.port, "/health", timeout_s=5)[0] == 200:
                return
        except (OSError, http.client.HTTPException):
            pass
        code = server.process.poll()
        if code is not None:
            raise ServerError(f"the server exited with code {code}: {_tail(server.log, 3)}")
        time.sleep(POLL_S)
    raise ServerError(f"GET /health did not answer 200 within --startup-timeout-s {timeout_s:g}")


def _stop(process: subprocess.Popen, timeout_s: float) -> str:
    """SIGTERM (a drain), then SIGKILL of the whole process group; how it ended."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(process.pid)
            process.wait(timeout_s)
            return f"killed after --stop-timeout-s {timeout_s:g}"
    _kill_group(process.pid)  # anything it started and left behind
    code = process.returncode
    if code < 0:  # died of a signal
        with suppress(ValueError):
            return signal.Signals(-code).name
    return str(code)


def _kill_group(group: int) -> None:
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(group, signal.SIGKILL)


def server_env(args: argparse.Namespace) -> dict:
    """Both servers: offline, this checkout importable, ``--threads`` torch threads."""
    return {
        **os.environ,
        "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": str(args.threads),
        "TOKENIZERS_PARALLELISM": "false",
    }


def alisa_command(system: System, args: argparse.Namespace) -> list[str]:
    """``alisa serve`` of ``system`` under the budget, on a free port."""
    return [
        sys.executable,
        "-m",
        "alisa",
        "serve",
        "--model",
        args.model,
        "--dtype",
        args.dtype,
        "--host",
        HOST,
        "--port",
        "0",
        "--threads",
        str(args.threads),
        "--kv-memory",
        args.kv_budget,
        "--max-batch",
        str(args.max_rows),
        "--max-queue",
        str(max(256, args.clients)),
        "--max-new-tokens",
        str(args.max_tokens),
        "--log-level",
        "warning",
        *system.flags,
    ]


def served_model(args: argparse.Namespace):
    """(directory, config, dtype) of the model both servers load: ``--model`` resolved as
    ``alisa serve`` resolves it (a built-in GGUF converted once), and ``--dtype`` (``auto``:
    the checkpoint's)."""
    import torch
    from transformers import AutoConfig

    from alisa.model.loading import resolve_dtype, resolve_model_path

    path = resolve_model_path(args.model)
    config = AutoConfig.from_pretrained(path)
    dtype = resolve_dtype(args.dtype)
    if dtype is None:
        dtype = getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return path, config, dtype


def transformers_blocks(config, dtype, args: argparse.Namespace) -> tuple[int, int]:
    """(blocks, bytes): the paged cache's ``num_blocks`` of ``--page-size`` tokens that the KV
    budget holds, as :func:`experiments.hf_continuous.block_bytes` sizes a block."""
    from experiments.hf_continuous import block_bytes

    one = block_bytes(SimpleNamespace(config=config, dtype=dtype), args.page_size)
    blocks = parse_bytes(args.kv_budget, field="--kv-budget") // one
    if blocks < 1:
        raise ValueError(
            f"--kv-budget {args.kv_budget} holds no transformers block of --page-size "
            f"{args.page_size} tokens ({format_bytes(one)})"
        )
    return blocks, blocks * one


def transformers_command(model_path: str, dtype, blocks: int, args) -> list[str]:
    """``transformers serve --continuous-batching`` of the model directory, its paged cache
    ``blocks`` blocks, sdpa attention, on a free port."""
    import torch

    return [
        *TRANSFORMERS_CLI,
        "serve",
        model_path,
        "--continuous-batching",
        "--device",
        "cuda" if torch.cuda.is_available() else "cpu",
        "--dtype",
        str(dtype).removeprefix("torch."),
        "--attn-implementation",
        "sdpa",
        "--cb-block-size",  # the CLI's name for the page size (deprecated there, still read)
        str(args.page_size),
        "--cb-num-blocks",
        str(blocks),
        "--cb-max-batch-tokens",
        str(args.max_batch_tokens),
        "--host",
        HOST,
        "--port",
        "0",
        "--log-level",
        "warning",
    ]


def request_body(system: System, prompt: str, max_tokens: int) -> dict:
    """A streamed greedy completion of exactly ``max_tokens`` tokens, as each server takes it:
    alisa reads vLLM's ``ignore_eos``; transformers refuses unknown fields, so its EOS is -1
    in the generation config it reads per request (its paged requests then never stop early)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    if system.server == "alisa":
        return {**body, "ignore_eos": True, "stream_options": {"include_usage": True}}
    greedy = {"do_sample": False, "max_new_tokens": max_tokens, "eos_token_id": -1}
    return {**body, "generation_config": json.dumps(greedy)}


# --------------------------------------------------------------------------- one system


def run_system(system: System, texts: list[str], args, folder: Path, watch, machine: dict) -> dict:
    """One system's row: its server started, warmed up, loaded and stopped; an error row
    naming why where it could not run."""
    row: dict = {"system": system.name, "server": system.server, "machine": machine}
    log = folder / f"{system.name}.log"
    try:
        path, config, dtype = served_model(args)
        if system.server == "alisa":
            command = alisa_command(system, args)
            row["kv_budget_bytes"] = parse_bytes(args.kv_budget, field="--kv-budget")
        else:
            blocks, kv_bytes = transformers_blocks(config, dtype, args)
            command = transformers_command(path, dtype, blocks, args)
            row.update(kv_budget_bytes=kv_bytes, num_blocks=blocks, page_size=args.page_size)
        row["command"] = " ".join(command[1:] if command[0] == sys.executable else command)
        with serving(command, server_env(args), log, args) as server:
            _warm_up(server, system, texts, args)
            bodies = [request_body(system, text, args.max_tokens) for text in texts]
            arrivals = poisson_arrivals(len(bodies), args.rate, args.seed)
            with PeakKV(server.port, args.scrape_s) as kv:
                load = run_load(server.port, bodies, arrivals, args)
            row.update(measures(load, args, watch))
            row.update(server_facts(system, server, kv, dtype))
        row["server_exit"] = server.exit
    except (ServerError, ValueError, OSError) as error:
        row["error"] = str(error)
        row["server_log"] = _tail(log)
    return row


def _warm_up(server: Server, system: System, texts: list[str], args) -> None:
    """Two short requests, one after the other (transformers allocates its paged cache at the
    first); a server that cannot answer them is an error row."""
    for text in texts[:2]:
        body = request_body(system, text, WARM_UP_TOKENS)
        answer = stream_completion(
            server.port,
            body,
            timeout_s=args.request_timeout_s,
            deadline_s=time.perf_counter() + args.request_timeout_s,
        )
        if not answer.ok:
            raise ServerError(f"the warm-up request failed: {answer.error}: {answer.detail}")


def _tail(log: Path, lines: int = 5) -> str:
    if not log.is_file():
        return ""
    kept = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return " | ".join(kept[-lines:])


def server_facts(system: System, server: Server, kv: PeakKV, dtype) -> dict:
    """What the server says of itself: peak KV, preemptions, cache settings and kernels."""
    if system.server == "transformers":
        switched = SWITCHED.search(server.log.read_text(errors="replace"))
        attention = switched.group(2) if switched else "sdpa"
        return {
            "peak_kv_bytes": None,  # no /metrics; the paged cache is allocated whole
            "preemptions": None,
            "kernels": f"{attention} over a paged cache (transformers continuous batching)",
        }
    return {
        "peak_kv_bytes": None if kv.peak is None else int(kv.peak),
        "kv_scrapes": kv.scrapes,  # the peak is the largest of these samples
        "preemptions": kv.total("alisa_preemptions_total"),
        "server_cache": kv.info,
        "kernels": alisa_kernels(kv.info, dtype),
    }


def alisa_kernels(info: dict[str, str], dtype) -> str:
    """The kernels an ``alisa serve`` cache with these settings runs on this machine, as
    :func:`alisa.ops.backends.choose_ops` picks them (the server names only its ``kernels``
    setting, not what it resolved to)."""
    import torch

    from alisa.ops.backends import choose_ops

    setting = info.get("kernels")
    if not setting:
        return "unknown (no alisa_cache_info scraped)"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        ops = choose_ops(device, dtype, setting)
    except ValueError as error:
        return f"kernels={setting} ({error})"
    return f"{ops.describe()} [kernels={setting}]"


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def measures(load: Load, args: argparse.Namespace, watch) -> dict:
    """The row's client-side measures of one load (times without the stops ``watch`` saw)."""
    answers = load.answers
    done = [answer for answer in answers if answer.ok]
    failed = [answer for answer in answers if answer.error is not None]
    first = min((answer.sent_s for answer in answers), default=load.started_s)
    seconds = watch.active(first, load.ended_s) if answers else 0.0
    ttfts = [watch.active(a.sent_s, a.chunk_s[0]) for a in done if a.chunk_s]
    gaps = [
        watch.active(before, after)
        for answer in done
        for before, after in zip(answer.chunk_s, answer.chunk_s[1:], strict=False)
    ]
    output_tokens = sum(answer.tokens for answer in done)
    kinds = Counter(answer.error for answer in failed)
    examples = {}
    for answer in failed:
        examples.setdefault(answer.error, answer.detail)
    prompt_tokens = [answer.prompt_tokens for answer in done if answer.prompt_tokens is not None]
    return {
        "requests": len(answers) + load.not_sent,
        "sent": len(answers),
        "completed": len(done),
        "errors": len(failed),
        "error_kinds": dict(kinds),
        "error_examples": examples,
        "cut_off": sum(answer.cut_off for answer in answers),
        "not_sent": load.not_sent,
        "short": sum(answer.tokens < args.max_tokens for answer in done),
        "seconds": seconds,
        "paused_s": watch.paused(first, load.ended_s) if answers else 0.0,
        "requests_per_s": len(done) / seconds if seconds > 0 else None,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / seconds if seconds > 0 else None,
        "prompt_tokens": sum(prompt_tokens) if prompt_tokens else None,
        "ttft_p50_s": _percentile(ttfts, 50),
        "ttft_p99_s": _percentile(ttfts, 99),
        "itl_p50_s": _percentile(gaps, 50),
        "itl_p99_s": _percentile(gaps, 99),
    }


# --------------------------------------------------------------------------- report


def _number(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def clean_exit(row: dict) -> bool:
    """Whether the server stopped as it should on SIGTERM: ``alisa serve`` drains and exits 0;
    ``transformers serve`` (plain uvicorn) shuts down, then dies of the signal it caught."""
    clean = {"alisa": ("0",), "transformers": ("0", "SIGTERM")}[row["server"]]
    return row.get("server_exit") in clean


def _note(row: dict) -> str:
    if "error" in row:
        return f"error: {row['error']}"
    notes = []
    if row["errors"]:
        kinds = ", ".join(f"{count} {kind}" for kind, count in row["error_kinds"].items())
        notes.append(f"errors: {kinds}")
    if row["cut_off"] or row["not_sent"]:
        notes.append(f"--duration-s ran out: {row['cut_off']} cut off, {row['not_sent']} not sent")
    if row["short"]:
        notes.append(f"{row['short']} answers short of --max-tokens")
    if not clean_exit(row):
        notes.append(f"server exit {row['server_exit']}")
    return "; ".join(notes)


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    paused = sum(row.get("paused_s", 0.0) for row in rows)
    rate = "all at once" if math.isinf(args.rate) else f"Poisson {args.rate:g}/s"
    print(
        f"{args.model} {args.dtype}, KV budget {args.kv_budget} for every system; {args.prompts} "
        f"XSum prompts <= {args.max_prompt_tokens} tokens, {rate}, <= {args.clients} in flight, "
        f"{args.max_tokens} tokens each (greedy, EOS ignored); {paused:.0f} s this process was "
        "stopped from outside, left out"
    )
    print(
        "| system | done / sent | req/s | output tok/s | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) "
        "| errors | peak KV | note |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        if "error" in row:
            print(f"| {row['system']} | - | - | - | - | - | - | - | {_note(row)} |")
            continue
        peak = row["peak_kv_bytes"]
        kv = format_bytes(peak) if peak is not None else f"({format_bytes(row['kv_budget_bytes'])})"
        itl = [None if v is None else v * 1000 for v in (row["itl_p50_s"], row["itl_p99_s"])]
        print(
            f"| {row['system']} | {row['completed']} / {row['sent']} | "
            f"{_number(row['requests_per_s'], 2)} | {_number(row['output_tokens_per_s'])} | "
            f"{_number(row['ttft_p50_s'], 2)} / {_number(row['ttft_p99_s'], 2)} | "
            f"{_number(itl[0])} / {_number(itl[1])} | {row['errors']} | {kv} | {_note(row)} |"
        )
    print(
        'peak KV: the most alisa_kv_bytes{tier="device"} scraped from /metrics; in brackets: '
        "transformers' paged cache, allocated whole (it has no /metrics)"
    )


def ratios(rows: list[dict]) -> dict:
    """The issue's targets, where both sides ran."""
    by = {row["system"]: row for row in rows if "error" not in row}

    def ratio(key: str, top: str, bottom: str) -> float | None:
        if top not in by or bottom not in by or not by[top][key] or not by[bottom][key]:
            return None
        return by[top][key] / by[bottom][key]

    return {
        "tok_s_r0.2_vs_transformers": ratio("output_tokens_per_s", "alisa-r0.2", "transformers"),
        "tok_s_r0.2_vs_r1": ratio("output_tokens_per_s", "alisa-r0.2", "alisa-r1"),
        "tok_s_r1_vs_transformers": ratio("output_tokens_per_s", "alisa-r1", "transformers"),
        "ttft_p99_r0.2_vs_transformers": ratio("ttft_p99_s", "alisa-r0.2", "transformers"),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        check_args(args)
        chosen = systems(args.systems.split(","))
        root = data_dir(args.data_dir)
        texts = workload_texts(root, args)
    except ValueError as error:
        print(f"bench_serve: error: {error}", file=sys.stderr)
        return 1
    from alisa.record import machine_record
    from experiments.pauses import PauseWatch

    machine = machine_record()
    rows = []
    with tempfile.TemporaryDirectory(prefix="alisa-bench-serve-") as scratch, PauseWatch() as watch:
        folder = Path(args.logs) if args.logs else Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        for system in chosen:
            row = run_system(system, texts, args, folder, watch, machine)
            rate = row.get("output_tokens_per_s")
            said = row["error"] if "error" in row else f"{_number(rate)} output tok/s"
            print(f"{system.name}: {said}", file=sys.stderr)
            rows.append(row)
    print_table(rows, args)
    report = {
        "benchmark": "serve",
        "model": args.model,
        "dtype": args.dtype,
        "decoding": "greedy, EOS ignored",
        "kv_budget_bytes": parse_bytes(args.kv_budget, field="--kv-budget"),
        "prompts": args.prompts,
        "max_prompt_tokens": args.max_prompt_tokens,
        "max_tokens": args.max_tokens,
        "rate": None if math.isinf(args.rate) else args.rate,
        "clients": args.clients,
        "seed": args.seed,
        "max_rows": args.max_rows,
        "page_size": args.page_size,
        "max_batch_tokens": args.max_batch_tokens,
        "threads": args.threads,
        "duration_s": args.duration_s,
        "request_timeout_s": args.request_timeout_s,
        "systems": rows,
        "ratios": ratios(rows),
    }
    print(json.dumps(report))
    return 0


def workload_texts(root: Path, args: argparse.Namespace) -> list[str]:
    """The prompts (chat template applied) of :func:`experiments.bench_continuous.build_workload`,
    read with the served model's tokenizer (no weights loaded)."""
    from transformers import AutoTokenizer

    from alisa.model.loading import resolve_model_path
    from experiments.bench_continuous import build_workload

    path = resolve_model_path(args.model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except OSError as error:  # no tokenizer files there, or a hub id while offline
        said = " ".join(str(error).split())
        raise ValueError(f"--model {args.model}: its tokenizer cannot be read: {said}") from None
    chosen = argparse.Namespace(
        prompts=args.prompts,
        max_prompt_tokens=args.max_prompt_tokens,
        new_tokens=str(args.max_tokens),
        seed=args.seed,
    )
    return build_workload(tokenizer, root, chosen).texts


if __name__ == "__main__":
    sys.exit(main())
