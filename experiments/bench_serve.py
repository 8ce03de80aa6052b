"""``alisa serve`` under load: Poisson arrivals of XSum prompts against real servers on 127.0.0.1.

    python -m experiments.bench_serve
    python -m experiments.bench_serve --prompts 16 --clients 2 --max-tokens 32   # quick
    python -m experiments.bench_serve --model shape:llama-3.1-8b --dtype bfloat16   # a GPU

``--model shape:NAME`` (:mod:`experiments.shapes`) saves that random-weight model once to a
scratch folder, which both servers then load as a checkpoint.

The workload of :func:`experiments.bench_continuous.build_workload`, sent as streamed greedy
``/v1/completions`` requests of exactly ``--max-tokens`` tokens each, arriving as a seeded Poisson
process of ``--rate`` a second (``inf``: all at once), ``--clients`` in flight at most. Each system
is a server started on a free port, waited for (``GET /health``), warmed up with two short
requests, loaded, then stopped with SIGTERM. No request starts after ``--duration-s``.
``--sigterm-after-s S`` stops the server S seconds into the load instead (a drain under load):
the row's ``drain`` counts the requests completed, refused and lost, and the exit code.

Systems (``--systems``), all under the KV byte budget ``--kv-budget``:
    alisa-r0.2        ``alisa serve --policy swa --caching-ratio 0.2 --kv-memory B``
    alisa-r1          ``alisa serve --policy dense --kv-memory B`` (every token kept)
    alisa-host-r0.2   SWA r = 0.2 with ``--retention host`` (not in the default set)
    transformers      ``transformers serve --continuous-batching``, sdpa over its paged cache of
                      ``--cb-num-blocks`` = the budget in blocks of ``--page-size`` tokens

Measured at the client from the streamed chunks' arrival times: requests and output tokens a
second, TTFT and inter-token latency (as ``vllm bench serve``) at p50 and p99, errors by kind;
peak KV is the largest ``alisa_kv_bytes{tier="device"}`` scraped from ``/metrics``. Prints a table
and one JSON line; every row carries :func:`experiments.timing.environment` and the server's
kernels. Seconds this process was stopped from outside are left out
(:class:`experiments.timeline.PauseWatch`).
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from alisa.sizes import format_bytes, parse_budget
from experiments.bench_continuous import (
    block_bytes,
    build_workload,
    check_workload,
    choose,
    ratios,
    workload_parser,
)
from experiments.data import data_dir
from experiments.flags import figure
from experiments.shapes import is_shape, save_shape, shape_config
from experiments.timeline import PauseWatch
from experiments.timing import environment

HOST = "127.0.0.1"
REPO = Path(__file__).resolve().parents[1]
# alisa prints "on http://HOST:PORT/v1" once listening, uvicorn "Uvicorn running on http://...".
ADDRESS = re.compile(rf"http://{re.escape(HOST)}:(\d+)")
# transformers' continuous batching names the attention it switched to (to flash, where built).
SWITCHED = re.compile(r"Switching from (\S+) to (\S+?)\.")
# How the benchmark runs transformers' command line (the console script's module).
TRANSFORMERS_CLI = (sys.executable, "-m", "transformers.cli.transformers")
# `alisa serve` flags of each system; None: `transformers serve`.
SYSTEMS = {
    "alisa-r0.2": ("--policy", "swa", "--caching-ratio", "0.2"),
    "alisa-r1": ("--policy", "dense"),
    "alisa-host-r0.2": ("--policy", "swa", "--caching-ratio", "0.2", "--retention", "host"),
    "transformers": None,
}
RATIOS = {
    "tok_s_r0.2_vs_transformers": ("output_tokens_per_s", "alisa-r0.2", "transformers"),
    "tok_s_r0.2_vs_r1": ("output_tokens_per_s", "alisa-r0.2", "alisa-r1"),
    "tok_s_r1_vs_transformers": ("output_tokens_per_s", "alisa-r1", "transformers"),
    "ttft_p99_r0.2_vs_transformers": ("ttft_p99_s", "alisa-r0.2", "transformers"),
}
DEVICE_KV = ("alisa_kv_bytes", (("tier", "device"),))
SECONDS = ("duration_s", "request_timeout_s", "startup_timeout_s", "stop_timeout_s", "scrape_s")


def parse_args(argv=None) -> argparse.Namespace:
    parents = [workload_parser(prompts=64, systems="alisa-r0.2,alisa-r1,transformers")]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], parents=parents)
    add = parser.add_argument
    add("--max-tokens", type=int, default=64, help="tokens every answer has")
    add("--rate", type=float, default=2.0, help="arrivals a second, or inf")
    add("--clients", type=int, default=16, help="requests in flight at most")
    add("--duration-s", type=float, default=600.0, help="no request starts after it")
    add("--request-timeout-s", type=float, default=300.0)
    add("--startup-timeout-s", type=float, default=600.0)
    add("--stop-timeout-s", type=float, default=60.0)
    add("--scrape-s", type=float, default=0.25, help="/metrics scrape interval")
    add("--logs", default=None, help="folder to keep the servers' logs in (default: discarded)")
    add(
        "--sigterm-after-s",
        type=float,
        default=None,
        help="SIGTERM the server this long into the load (a drain under load): every request "
        "must complete or be refused (503, or closed unanswered as it exits), none lost",
    )
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """A ``ValueError`` naming the first flag out of range."""
    check_workload(args, "max_tokens", "clients")
    if not args.rate > 0:  # nan fails too
        raise ValueError(f"--rate={args.rate} must be > 0 requests a second (or inf)")
    for name in SECONDS:
        if not 0 < getattr(args, name) < math.inf:
            value = getattr(args, name)
            raise ValueError(f"--{name.replace('_', '-')}={value} must be a number of seconds > 0")
    if args.sigterm_after_s is not None and not 0 < args.sigterm_after_s < math.inf:
        raise ValueError(f"--sigterm-after-s={args.sigterm_after_s} must be seconds > 0")


def poisson_arrivals(count: int, rate: float, seed: int) -> list[float]:
    """Arrival seconds of ``count`` requests: the first at once, then seeded exponential gaps of
    mean ``1 / rate``; all at once for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * count
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=count - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


@dataclass(kw_only=True)
class Answer:
    """What the client saw of one streamed request (``time.perf_counter()`` times)."""

    sent_s: float
    chunk_s: list[float] = field(default_factory=list)  # chunks that brought text
    end_s: float = 0.0
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
        return len(self.chunk_s) if self.completion_tokens is None else self.completion_tokens

    def fail(self, kind: str, detail: str) -> None:
        self.error, self.detail = kind, " ".join(detail.split())[:300]


# The error kind's prefix of a connection that failed before the server sent a status line.
NO_ANSWER = "no answer"


def refused_kind(kind: str) -> bool:
    """Whether an error of ``kind`` means the server never took the request: a 503, or a
    connection refused or closed before a status line (as a server that exits closes them)."""
    return kind == "HTTP 503" or kind.startswith(f"{NO_ANSWER}: ")


def stream_completion(port: int, body: dict, *, timeout_s: float, deadline_s: float) -> Answer:
    """Send one streamed completion and read its server-sent events to the end.

    Never raises for what the server or the network does: a status other than 200, an error
    event, a stream that breaks or stops, or no byte for ``timeout_s`` set ``error``; reaching
    ``deadline_s`` (``time.perf_counter()``) first closes the connection and sets ``cut_off``.
    """
    answer = Answer(sent_s=time.perf_counter())
    until = min(deadline_s, answer.sent_s + timeout_s)
    connection = http.client.HTTPConnection(HOST, port, timeout=max(until - answer.sent_s, 0.01))
    response = None
    try:
        headers = {"Content-Type": "application/json"}
        connection.request("POST", "/v1/completions", json.dumps(body).encode(), headers)
        sock = connection.sock  # kept: the connection drops it where the response closes it
        response = connection.getresponse()
        if response.status != 200:
            answer.fail(f"HTTP {response.status}", error_text(response.read()))
        while answer.error is None:
            if (left := until - time.perf_counter()) <= 0:
                raise TimeoutError
            sock.settimeout(left)
            if not read_event(response.readline(), answer):
                break
    except TimeoutError:
        if until >= deadline_s:
            answer.cut_off = True
        else:
            answer.fail("timed out", f"no answer within --request-timeout-s {timeout_s:g}")
    except (OSError, http.client.HTTPException) as error:
        # Before a status line the server never took the request (refused, or a connection it
        # had not read yet closed as it exits); after one, a request it took was broken off.
        where = "connection" if response is not None else NO_ANSWER
        answer.fail(f"{where}: {type(error).__name__}", str(error))
    finally:
        connection.close()  # a request cut off is cancelled by the server when it sees this
        answer.end_s = time.perf_counter()
    return answer


def read_event(line: bytes, answer: Answer) -> bool:
    """Take one line of the stream (a ``data:`` event's text, finish reason, usage or error);
    False at its end (``[DONE]``, or the close: transformers sends no ``[DONE]``)."""
    text = line.decode("utf-8", errors="replace").strip()
    payload = text.removeprefix("data:").strip() if text.startswith("data:") else None
    if not line or payload == "[DONE]":
        if answer.finish_reason is None:
            answer.fail("stream ended early", "the stream ended before a finish_reason")
        return False
    if payload is None:
        return True
    try:
        event = json.loads(payload)
    except json.JSONDecodeError:
        event = None
    if not isinstance(event, dict):
        answer.fail("bad event", payload)
        return True
    if "error" in event:
        answer.fail("error event", error_text(payload))
        return True
    for choice in event.get("choices") or []:
        if choice.get("text"):
            answer.chunk_s.append(time.perf_counter())
        answer.finish_reason = choice.get("finish_reason") or answer.finish_reason
    if usage := event.get("usage"):
        answer.completion_tokens = usage.get("completion_tokens")
        answer.prompt_tokens = usage.get("prompt_tokens")
    return True


def error_text(body: bytes | str) -> str:
    """The message of an error body: OpenAI's ``error.message`` (with its code), FastAPI's
    ``detail``, else the body itself."""
    text = body.decode("utf-8", errors="replace") if isinstance(body, bytes) else body
    with suppress(json.JSONDecodeError):
        parsed = json.loads(text)
        error = parsed.get("error") if isinstance(parsed, dict) else None
        if isinstance(error, dict):
            code = f"[{error['code']}] " if error.get("code") else ""
            return f"{code}{error.get('message', '')}"
        if isinstance(parsed, dict) and "detail" in parsed:
            return str(parsed["detail"])
    return text


def run_load(port: int, bodies: list[dict], arrivals: list[float], args) -> list[Answer | None]:
    """Send ``bodies`` at ``arrivals`` (seconds from now), ``--clients`` in flight at most, until
    ``--duration-s``; None for a request that arrived after it (not sent)."""
    started = time.perf_counter()
    deadline = started + args.duration_s

    def send(index: int) -> Answer | None:
        due = started + arrivals[index]
        if max(due, time.perf_counter()) >= deadline:  # so is every later one
            return None
        time.sleep(max(0.0, due - time.perf_counter()))
        timeout_s = args.request_timeout_s
        return stream_completion(port, bodies[index], timeout_s=timeout_s, deadline_s=deadline)

    with ThreadPoolExecutor(min(args.clients, len(bodies)), "bench-client") as clients:
        return list(clients.map(send, range(len(bodies))))


def get(port: int, path: str) -> str:
    """The body of ``GET path``; an ``OSError`` unless it answers 200."""
    connection = http.client.HTTPConnection(HOST, port, timeout=5)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        if response.status != 200:
            raise OSError(f"GET {path} answered HTTP {response.status}")
        return response.read().decode("utf-8", errors="replace")
    finally:
        connection.close()


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """The samples of the server's Prometheus ``/metrics`` by (name, labels); {} without one."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        families = list(text_string_to_metric_families(get(port, "/metrics")))
    except (OSError, http.client.HTTPException, ValueError):
        return {}
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in families
        for sample in family.samples
    }


def watch_kv(port: int, interval_s: float, done: threading.Event) -> list[float]:
    """``alisa_kv_bytes{tier="device"}`` scraped every ``interval_s`` until ``done`` is set or
    a scrape has none (transformers has no ``/metrics``)."""
    seen: list[float] = []
    while (value := scrape(port).get(DEVICE_KV)) is not None:
        seen.append(value)
        if done.wait(interval_s):
            break
    return seen


class ServerError(RuntimeError):
    """A server that did not start, or stopped serving (the row says why)."""


@dataclass(kw_only=True)
class Server:
    """A server process this benchmark started, and where it listens."""

    process: subprocess.Popen
    log: Path
    port: int = 0
    exit: str = ""  # how it stopped: "0", "1", "SIGTERM" (died of it), "killed after ..."
    signalled_s: float | None = None  # when terminate() sent SIGTERM (time.perf_counter())

    def terminate(self) -> None:
        """SIGTERM now (a drain); stopping it later then waits instead of signalling again,
        which would stop it at once."""
        self.signalled_s = time.perf_counter()
        self.process.terminate()


@contextmanager
def serving(command: list[str], env: dict, log: Path, args) -> Iterator[Server]:
    """Start ``command`` (a server printing its address), wait until ``/health`` answers, and
    always stop it on the way out (:func:`stop`); ``Server.exit`` says how it ended."""
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
        wait_ready(server, args.startup_timeout_s)
        yield server
    finally:
        server.exit = stop(process, args.stop_timeout_s, signalled=server.signalled_s is not None)


def wait_ready(server: Server, timeout_s: float) -> None:
    """Until the server has printed its address and ``GET /health`` answers 200; a
    ``ServerError`` if it exits first or ``timeout_s`` runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not server.port and (found := ADDRESS.search(server.log.read_text(errors="replace"))):
            server.port = int(found.group(1))
        if server.port and healthy(server.port):
            return
        if (code := server.process.poll()) is not None:
            before = "" if server.port else " before listening"
            raise ServerError(f"the server exited with code {code}{before}: {tail(server.log, 3)}")
        time.sleep(0.1)
    what = "GET /health did not answer 200" if server.port else "the server printed no address"
    raise ServerError(f"{what} within --startup-timeout-s {timeout_s:g}")


def healthy(port: int) -> bool:
    """Whether ``GET /health`` answers 200."""
    try:
        get(port, "/health")
    except (OSError, http.client.HTTPException):
        return False
    return True


def stop(process: subprocess.Popen, timeout_s: float, *, signalled: bool = False) -> str:
    """SIGTERM (a drain; not again where it was ``signalled`` already), then SIGKILL of the
    whole process group; how it ended."""
    ended = None
    if process.poll() is None:
        if not signalled:
            process.terminate()
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            ended = f"killed after --stop-timeout-s {timeout_s:g}"
    with suppress(ProcessLookupError, PermissionError):  # and anything it left behind
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout_s)
    code = process.returncode
    return ended or (signal.Signals(-code).name if code < 0 else str(code))


def server_env(args: argparse.Namespace) -> dict:
    """Both servers: offline, this checkout importable, ``--threads`` torch threads."""
    return {
        **os.environ,
        "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": str(args.threads),
        "TOKENIZERS_PARALLELISM": "false",
    }


def server_command(name: str, args) -> tuple[list[str], dict]:
    """The command line of system ``name`` under the budget, on a free port (``alisa serve``, or
    ``transformers serve`` with the paged blocks the budget holds), and what the row records."""
    budget = parse_budget(args.kv_budget, field="--kv-budget")
    if SYSTEMS[name] is not None:
        command = [sys.executable, "-m", "alisa", "serve", "--model", args.model]
        command += ["--dtype", args.dtype, "--kv-memory", args.kv_budget, *SYSTEMS[name]]
        command += (
            f"--host {HOST} --port 0 --threads {args.threads} --max-batch {args.max_rows} "
            f"--max-queue {max(256, args.clients)} --max-new-tokens {args.max_tokens} "
            "--log-level warning"
        ).split()
        return command, {"kv_budget_bytes": budget}
    import torch

    path, config, dtype = served_model(args)
    one = block_bytes(config, dtype, args.page_size)
    if (blocks := budget // one) < 1:
        raise ValueError(
            f"--kv-budget {args.kv_budget} holds no transformers block of --page-size "
            f"{args.page_size} tokens ({format_bytes(one)})"
        )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    command = [*TRANSFORMERS_CLI, "serve", path, "--continuous-batching", "--device", device]
    # --cb-block-size: the CLI's name for the page size (deprecated there, still read).
    command += (
        f"--dtype {str(dtype).removeprefix('torch.')} --attn-implementation sdpa --cb-block-size "
        f"{args.page_size} --cb-num-blocks {blocks} --cb-max-batch-tokens "
        f"{args.max_batch_tokens} --host {HOST} --port 0 --log-level warning"
    ).split()
    return command, {
        "kv_budget_bytes": blocks * one,
        "num_blocks": blocks,
        "page_size": args.page_size,
    }


def served_model(args: argparse.Namespace):
    """(directory, config, dtype) of the model both servers load, as ``alisa serve`` resolves
    ``--model`` and ``--dtype``."""
    import torch
    from transformers import AutoConfig

    from alisa.model.loading import resolve_dtype, resolve_model_path

    path = resolve_model_path(args.model)
    config = AutoConfig.from_pretrained(path)
    dtype = resolve_dtype(args.dtype) or getattr(config, "dtype", None) or torch.float32
    return path, config, getattr(torch, dtype) if isinstance(dtype, str) else dtype


def request_body(name: str, prompt: str, max_tokens: int) -> dict:
    """A streamed greedy completion of exactly ``max_tokens`` tokens: alisa reads vLLM's
    ``ignore_eos``; transformers (which refuses unknown fields) gets a generation config whose
    EOS is -1."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    if SYSTEMS[name] is not None:
        return {**body, "ignore_eos": True, "stream_options": {"include_usage": True}}
    greedy = {"do_sample": False, "max_new_tokens": max_tokens, "eos_token_id": -1}
    return {**body, "generation_config": json.dumps(greedy)}


def run_system(name: str, texts: list[str], args, folder: Path, watch, machine: dict) -> dict:
    """One system's row (server started, warmed up, loaded, stopped), or its error row."""
    server_kind = "transformers" if SYSTEMS[name] is None else "alisa"
    row: dict = {"system": name, "server": server_kind, "machine": machine}
    log = folder / f"{name}.log"
    try:
        command, facts = server_command(name, args)
        row.update(
            facts, command=" ".join(command[1:] if command[0] == sys.executable else command)
        )
        with serving(command, server_env(args), log, args) as server:
            warm_up(server, name, texts, args)
            bodies = [request_body(name, text, args.max_tokens) for text in texts]
            arrivals = poisson_arrivals(len(bodies), args.rate, args.seed)
            done, signal_at = threading.Event(), args.sigterm_after_s
            if signal_at is not None:  # the drain under load
                timer = threading.Timer(signal_at, server.terminate)
                timer.start()
            with ThreadPoolExecutor(1, "bench-scrape") as scraper:
                seen = scraper.submit(watch_kv, server.port, args.scrape_s, done)
                try:
                    answers = run_load(server.port, bodies, arrivals, args)
                finally:
                    done.set()
                    if signal_at is not None:
                        timer.cancel()
            row.update(measures(answers, args, watch))
            if server.signalled_s is not None:
                row["drain"] = drain_measures(answers, signal_at, server.signalled_s)
            row.update(server_facts(server_kind, server, seen.result()))
        row["server_exit"] = server.exit
    except (ServerError, ValueError, OSError) as error:
        row.update(error=str(error), server_log=tail(log))
    return row


def warm_up(server: Server, name: str, texts: list[str], args) -> None:
    """Two short requests, one after the other (transformers allocates its paged cache at the
    first); a failure is a ``ServerError``."""
    for text in texts[:2]:
        deadline = time.perf_counter() + args.request_timeout_s
        body, timeout_s = request_body(name, text, 4), args.request_timeout_s
        answer = stream_completion(server.port, body, timeout_s=timeout_s, deadline_s=deadline)
        if not answer.ok:
            raise ServerError(f"the warm-up request failed: {answer.error}: {answer.detail}")


def tail(log: Path, lines: int = 5) -> str:
    if not log.is_file():
        return ""
    kept = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return " | ".join(kept[-lines:])


def server_facts(kind: str, server: Server, seen: list[float]) -> dict:
    """What the server says of itself: peak KV (of the ``seen`` samples and one scrape after the
    load), preemptions, cache settings and kernels."""
    if kind == "transformers":  # no /metrics; its paged cache is allocated whole
        switched = SWITCHED.search(server.log.read_text(errors="replace"))
        attention = switched.group(2) if switched else "sdpa"
        kernels = f"{attention} over a paged cache (transformers continuous batching)"
        return {
            "peak_kv_bytes": None,
            "preemptions": None,
            "steps": None,
            "step_mean_s": None,
            "kernels": kernels,
        }
    last = scrape(server.port)
    seen = [*seen, last[DEVICE_KV]] if DEVICE_KV in last else seen
    info = next((dict(labels) for name, labels in last if name == "alisa_cache_info"), {})
    preemptions = [value for (name, _), value in last.items() if name == "alisa_preemptions_total"]
    steps = last.get(("alisa_scheduler_step_seconds_count", ()))
    step_sum = last.get(("alisa_scheduler_step_seconds_sum", ()))
    return {
        # the engine's own time a step, beside the clients' inter-token latency
        "steps": None if steps is None else int(steps),
        "step_mean_s": step_sum / steps if steps else None,
        "peak_kv_bytes": int(max(seen)) if seen else None,
        "kv_scrapes": len(seen),  # the peak is the largest of these samples
        "preemptions": sum(preemptions) if preemptions else None,
        "server_cache": info,
        # the kernels the server resolved its setting to on this machine
        "kernels": info.get("kernels_run", "unknown (no alisa_cache_info scraped)"),
    }


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def measures(load: list[Answer | None], args: argparse.Namespace, watch) -> dict:
    """The row's client-side measures of one load (times without the stops ``watch`` saw)."""
    answers = [answer for answer in load if answer is not None]
    done = [answer for answer in answers if answer.ok]
    failed = [answer for answer in answers if answer.error is not None]
    ended = max((answer.end_s for answer in answers), default=0.0)
    first = min((answer.sent_s for answer in answers), default=ended)
    seconds = watch.active(first, ended)
    ttfts = [watch.active(a.sent_s, a.chunk_s[0]) for a in done if a.chunk_s]
    gaps = [
        watch.active(before, after)
        for answer in done
        for before, after in zip(answer.chunk_s, answer.chunk_s[1:], strict=False)
    ]
    output_tokens = sum(answer.tokens for answer in done)
    prompt_tokens = [answer.prompt_tokens for answer in done if answer.prompt_tokens is not None]
    examples = {}
    for answer in failed:
        examples.setdefault(answer.error, answer.detail)
    return {
        "requests": len(load),
        "sent": len(answers),
        "completed": len(done),
        "errors": len(failed),
        "error_kinds": dict(Counter(answer.error for answer in failed)),
        "error_examples": examples,
        "cut_off": sum(answer.cut_off for answer in answers),
        "not_sent": len(load) - len(answers),
        "short": sum(answer.tokens < args.max_tokens for answer in done),
        "seconds": seconds,
        "paused_s": watch.paused(first, ended),
        "requests_per_s": len(done) / seconds if seconds > 0 else None,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / seconds if seconds > 0 else None,
        "prompt_tokens": sum(prompt_tokens) if prompt_tokens else None,
        **{f"ttft_p{q}_s": percentile(ttfts, q) for q in (50, 99)},
        **{f"itl_p{q}_s": percentile(gaps, q) for q in (50, 99)},
    }


def drain_measures(load: list[Answer | None], after_s: float, signalled: float) -> dict:
    """A load SIGTERM cut into: requests completed, refused (:func:`refused_kind`) and lost
    (taken, then broken off or never answered: what a drain must never do)."""
    answers = [answer for answer in load if answer is not None]
    errors = Counter(answer.error for answer in answers if answer.error is not None)
    refused = sum(count for kind, count in errors.items() if refused_kind(kind))
    return {
        "sigterm_after_s": after_s,
        "completed": sum(answer.ok for answer in answers),
        "completed_after_signal": sum(a.ok and a.end_s > signalled for a in answers),
        "refused": refused,
        "lost": errors.total() - refused,
    }


def note(row: dict) -> str:
    """What the table says of a row beyond its numbers."""
    if "error" in row:
        return f"error: {row['error']}"
    notes = []
    if drain := row.get("drain"):
        notes.append(
            f"SIGTERM at {drain['sigterm_after_s']:g} s: {drain['completed_after_signal']} "
            f"finished after it, {drain['refused']} refused, {drain['lost']} lost"
        )
    if row["errors"]:
        kinds = ", ".join(f"{count} {kind}" for kind, count in row["error_kinds"].items())
        notes.append(f"errors: {kinds}")
    if row["cut_off"] or row["not_sent"]:
        notes.append(f"--duration-s ran out: {row['cut_off']} cut off, {row['not_sent']} not sent")
    if row.get("step_mean_s") is not None:
        notes.append(f"{row['steps']} engine steps, {row['step_mean_s'] * 1000:.0f} ms mean")
    if row["short"]:
        notes.append(f"{row['short']} answers short of --max-tokens")
    # alisa serve drains and exits 0; transformers serve (uvicorn) dies of the SIGTERM it caught.
    if row["server_exit"] not in ("0", "SIGTERM" if row["server"] == "transformers" else "0"):
        notes.append(f"server exit {row['server_exit']}")
    return "; ".join(notes)


def print_table(rows: list[dict], args: argparse.Namespace, model: str) -> None:
    paused = sum(row.get("paused_s", 0.0) for row in rows)
    rate = "all at once" if math.isinf(args.rate) else f"Poisson {args.rate:g}/s"
    print(
        f"{model} {args.dtype}, KV budget {args.kv_budget} for every system; {args.prompts} "
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
            print(f"| {row['system']} | - | - | - | - | - | - | - | {note(row)} |")
            continue
        peak = row["peak_kv_bytes"]
        kv = format_bytes(peak) if peak is not None else f"({format_bytes(row['kv_budget_bytes'])})"
        itl = [None if v is None else v * 1000 for v in (row["itl_p50_s"], row["itl_p99_s"])]
        print(
            f"| {row['system']} | {row['completed']} / {row['sent']} | "
            f"{figure(row['requests_per_s'], 2)} | {figure(row['output_tokens_per_s'])} | "
            f"{figure(row['ttft_p50_s'], 2)} / {figure(row['ttft_p99_s'], 2)} | "
            f"{figure(itl[0])} / {figure(itl[1])} | {row['errors']} | {kv} | {note(row)} |"
        )
    print(
        'peak KV: the most alisa_kv_bytes{tier="device"} scraped from /metrics; in brackets: '
        "transformers' paged cache, allocated whole (it has no /metrics)"
    )


def workload_texts(args: argparse.Namespace) -> list[str]:
    """The prompts of :func:`~experiments.bench_continuous.build_workload` (no weights loaded)."""
    from transformers import AutoTokenizer

    from alisa.model.loading import resolve_model_path

    root = data_dir(args.data_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model))
    except OSError as error:  # no tokenizer files there, or a hub id while offline
        said = " ".join(str(error).split())
        raise ValueError(f"--model {args.model}: its tokenizer cannot be read: {said}") from None
    return build_workload(tokenizer, root, args, [args.max_tokens]).texts


def main(argv=None) -> int:
    args = parse_args(argv)
    spec = args.model
    with tempfile.TemporaryDirectory(prefix="alisa-bench-serve-") as scratch:
        try:
            check_args(args)
            chosen = choose(args.systems, tuple(SYSTEMS))
            if is_shape(spec):  # both servers load a path: the shape's weights saved once
                shape_config(spec)  # an unknown name is refused before any weights are built
                args.model = str(save_shape(spec, Path(scratch, "model"), dtype=args.dtype))
            texts = workload_texts(args)
        except ValueError as error:
            print(f"bench_serve: error: {error}", file=sys.stderr)
            return 1
        rows = run_systems(chosen, texts, args, scratch)
    print_table(rows, args, spec)
    keys = ("prompts", "max_prompt_tokens", "max_tokens", "clients", "seed", "max_rows")
    keys += ("page_size", "max_batch_tokens", "threads", "duration_s", "request_timeout_s")
    report = {
        "benchmark": "serve",
        "model": spec,
        "dtype": args.dtype,
        "decoding": "greedy, EOS ignored",
        "kv_budget_bytes": parse_budget(args.kv_budget, field="--kv-budget"),
        "rate": None if math.isinf(args.rate) else args.rate,
        **{key: getattr(args, key) for key in keys},
        "systems": rows,
        "ratios": ratios(rows, RATIOS),
    }
    print(json.dumps(report))
    return 0


def run_systems(chosen: list[str], texts: list[str], args, scratch: str) -> list[dict]:
    """Each chosen system's row, one server after the other (logs in ``--logs`` or scratch)."""
    machine, rows = environment(args.threads), []
    with PauseWatch() as watch:
        folder = Path(args.logs or scratch)
        folder.mkdir(parents=True, exist_ok=True)
        for name in chosen:
            rows.append(run_system(name, texts, args, folder, watch, machine))
            rate = figure(rows[-1].get("output_tokens_per_s"))
            print(f"{name}: {rows[-1].get('error') or f'{rate} output tok/s'}", file=sys.stderr)
    return rows


if __name__ == "__main__":
    sys.exit(main())
