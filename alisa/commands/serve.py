"""``alisa serve``: an OpenAI-compatible HTTP server of one model under a KV byte budget."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from alisa.commands.options import (
    CommandError,
    add_cache_options,
    add_compile_option,
    add_model_options,
    add_scheduler_options,
    add_threads_option,
    apply_threads,
    build_from_flags,
    cache_config_from_args,
    check_minimum,
    load_for_cli,
    model_notes_said,
    run_notes_said,
)

HELP = "serve a model over HTTP with the OpenAI API (completions, chat, streaming, metrics)"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
# ServeSettings field -> the flag that sets it, so its errors name the flag.
SETTINGS_FLAGS = {
    "model_name": "--served-model-name",
    "max_rows": "--max-batch",
    "max_queue": "--max-queue",
    "max_tokens": "--max-new-tokens",
    "reserve_tokens": "--reserve-tokens",
    "prefill_tokens": "--prefill-tokens",
    "kv_bytes": "--kv-memory",
    "device_bytes": "--gpu-memory",
    "max_cache_len": "--max-cache-len",
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.usage = "%(prog)s [options]   (common options first; -h lists them all)"
    add_model_options(parser)
    add_threads_option(parser)
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0 listens on "
        "every interface, without authentication)",
    )
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    parser.add_argument(
        "--served-model-name",
        help="the name clients give as model (default: the --model value)",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=64,
        help="tokens a request generates when its max_tokens is not given (clipped to the "
        "model's context; default 64)",
    )
    add_scheduler_options(parser)
    add_compile_option(
        parser,
        "the decode steps",
        " (one compiled step per bucket of rows, 1, 2, 4, ..., compiled once for the "
        "server's life, rows in static caches of --max-cache-len tokens)",
    )
    parser.add_argument(
        "--max-cache-len",
        type=int,
        help="compiled steps: tokens per row (prompt and new tokens) of their static caches, "
        "rounded up to a length bucket; a longer request is answered 400 (default: the "
        "model's context)",
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=256,
        help="requests waiting to start at most; one more is answered 503 at once (default 256)",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=LOG_LEVELS,
        help="server log level (info logs each request; default: info)",
    )
    add_cache_options(parser)


def run(args: argparse.Namespace) -> int:
    from alisa.serve import AlisaServer, ServeSettings, bind
    from alisa.serve.server import base_url
    from alisa.sizes import parse_budget

    if not args.host.strip():  # an unset $HOST in a script: never "every interface" by accident
        raise CommandError(
            f"--host {args.host!r} is empty; give an address (127.0.0.1: this machine; "
            "0.0.0.0: every interface)"
        )
    check_minimum("--max-new-tokens", args.max_new_tokens, 1)
    check_minimum("--max-batch", args.max_batch, 1)
    check_minimum("--max-queue", args.max_queue, 1)
    check_minimum("--prefill-tokens", args.prefill_tokens, 1)
    check_minimum("--reserve-tokens", args.reserve_tokens, 0)
    check_minimum("--max-cache-len", args.max_cache_len, 1)
    if not 0 <= args.port <= 65535:
        raise CommandError(f"--port={args.port} must be in 0..65535")
    kv_bytes = None if args.kv_memory is None else parse_budget(args.kv_memory, field="--kv-memory")
    config = cache_config_from_args(args, sizes_batches=True)  # --gpu-memory sizes the batch
    if config.host_memory is not None and config.retention != "host":
        raise CommandError(
            f"--host-memory {config.host_memory} has no effect in alisa serve without "
            "--retention host (batches are sized to --gpu-memory and --kv-memory)"
        )
    device = args.gpu_memory
    device_bytes = None if device is None else parse_budget(device, field="--gpu-memory")
    settings = build_from_flags(
        ServeSettings,
        SETTINGS_FLAGS,
        # Only a flag left out falls back: an empty name is refused, not silently replaced.
        model_name=args.model if args.served_model_name is None else args.served_model_name,
        config=config,
        kv_bytes=kv_bytes,
        device_bytes=device_bytes,
        max_rows=args.max_batch,
        max_queue=args.max_queue,
        max_tokens=args.max_new_tokens,
        reserve_tokens=args.reserve_tokens,
        prefill_tokens=args.prefill_tokens,
        compile=args.compile,
        max_cache_len=args.max_cache_len,
    )
    apply_threads("serve", args.threads)
    try:  # before the model loads: a port in use fails at once
        sock = bind(args.host, args.port)
    except OSError as error:
        raise CommandError(
            f"--host {args.host} --port {args.port}: cannot listen there: {error.strerror or error}"
        ) from None
    with sock:
        model, tokenizer = load_for_cli(args.model, args.dtype)
        with model_notes_said("serve", model, settings.config):
            _check_fits(model, tokenizer, settings)
            with run_notes_said("serve", {"max_cache_len": None}):  # the engine's notes
                server = AlisaServer(model, tokenizer, settings, log_level=args.log_level)
            # From the line below on, SIGTERM drains (uvicorn takes the signal over once it
            # serves): one sent as soon as the address is printed does not kill the server.
            if threading.current_thread() is threading.main_thread():  # where signals land
                signal.signal(signal.SIGTERM, lambda signum, frame: server.drain())
            host, port = sock.getsockname()[:2]
            print(
                f"alisa serve: {settings.model_name} on {base_url(host, port)} "
                f"(policy {settings.config.policy} r={settings.config.caching_ratio:g}, "
                f"compile {server.engine.compile.describe()}); "
                "SIGTERM or Ctrl-C drains and stops",
                file=sys.stderr,
            )
            server.run(sock)
    if server.stopped_by is not None:  # its requests were dropped: not a clean stop
        name = signal.Signals(server.stopped_by).name
        print(f"alisa serve: stopped at once by a second {name}", file=sys.stderr)
        return 128 + server.stopped_by  # as a shell reports a process the signal ended
    print("alisa serve: drained, stopped", file=sys.stderr)
    return 0


def _check_fits(model, tokenizer, settings) -> None:
    """Refuse settings no request could run under: a default length past the context, a cache
    config the model cannot take, or a budget that holds no one-token prompt."""
    from alisa.kv.cache import AlisaCache
    from alisa.model.loading import context_length

    known = context_length(model, tokenizer)
    if known is not None and settings.max_tokens >= known[0]:
        raise CommandError(
            f"--max-new-tokens={settings.max_tokens} leaves no room for a prompt in the "
            f"model's context of {known[0]} tokens ({known[1]})"
        )
    AlisaCache(model, settings.config)  # a ValueError names the field (dense_layers, ...)
    _check_budgets(model, settings)


def _check_budgets(model, settings) -> None:
    """Refuse a budget too small for the smallest request (one prompt token, one new token),
    saying what that request needs: the operator must raise the flag, no request can help."""
    from alisa.jobs.sizing import running_memory
    from alisa.model.adapter import model_shape
    from alisa.planning.spec import model_spec
    from alisa.sizes import format_bytes

    spec = model_spec(model, model_shape(model))
    memory = running_memory(spec, settings.config, [], [(1, 1)])  # as admission sizes a row
    problems = []
    device = settings.device_bytes
    if device is not None and memory.total > device:
        weights = (
            f"the model's weights alone are {format_bytes(memory.weights)}"
            if memory.weights >= device
            else f"the model's weights are {format_bytes(memory.weights)}"
        )
        problems.append(
            f"--gpu-memory {format_bytes(device)} cannot hold even a one-token request: "
            f"{weights}, with one token's KV and activations {format_bytes(memory.total)}; "
            f"raise --gpu-memory (to at least {format_bytes(memory.total)} for that one token)"
        )
    kv = settings.kv_bytes
    if kv is not None and memory.kv > kv:
        problems.append(
            f"--kv-memory {format_bytes(kv)} cannot hold even a one-token request: its KV "
            f"needs {format_bytes(memory.kv)}; raise --kv-memory (to at least "
            f"{format_bytes(memory.kv)} for that one token)"
        )
    host = settings.config.host_memory
    if host is not None and memory.host > settings.config.host_memory_bytes:
        problems.append(
            f"--host-memory {host} cannot hold even a one-token request: its host region "
            f"(retention='host') needs {format_bytes(memory.host)}; raise --host-memory (to at "
            f"least {format_bytes(memory.host)} for that one token)"
        )
    if problems:
        raise CommandError("; ".join(problems))
