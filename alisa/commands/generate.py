"""``alisa generate``: one prompt (argument, file or stdin) -> completion and a stats line."""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from alisa.commands.options import (
    FLOOR_FLAGS,
    CommandError,
    add_cache_options,
    add_compile_option,
    add_model_options,
    add_sampling_options,
    add_threads_option,
    apply_threads,
    build_from_flags,
    cache_config_from_args,
    check_minimum,
    load_for_cli,
    sampling_from_args,
    with_flag,
)
from alisa.config import AlisaConfig
from alisa.parallel.config import DECODES, MODES, PARTITIONS
from alisa.settings import (
    IgnoredSettingWarning,
    coded_size_note,
    describe_settings,
    effective_values,
    evicts_nothing_note,
    full_precision_note,
    long_stride_note,
    no_evicting_layer_note,
    ring_tokens,
    unread_kernels_note,
)

HELP = "generate a completion for one prompt"
# ParallelConfig field -> the flag that sets it, so its errors name the flag.
PARALLEL_FLAGS = {
    "mode": "--parallel",
    "partition": "--partition",
    "decode": "--parallel-decode",
    "table_path": "--partition-table",
    "table_key": "--partition-key",
}

# The flags of the parallel group other than --parallel, with their defaults.
PARALLEL_DEFAULTS = {
    "partition": "even",
    "partition_table": None,
    "partition_key": None,
    "parallel_decode": "local",
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.usage = "%(prog)s [options] [prompt]   (common options first; -h lists them all)"
    parser.add_argument("prompt", nargs="?", help="the prompt (else --prompt-file, else stdin)")
    parser.add_argument("--prompt-file", type=Path, help="read the prompt from this file (UTF-8)")
    add_model_options(parser)
    add_threads_option(parser)
    parser.add_argument(
        "--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)"
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user turn in the model's chat template (for instruct models)",
    )
    parser.add_argument(
        "--truncate-prompt",
        action="store_true",
        help="keep the last tokens of a prompt longer than the model's context (else an error)",
    )
    add_sampling_options(parser)
    parser.add_argument(
        "--show-config",
        action="store_true",
        help="print every effective cache setting (what unset fields became, per layer) to "
        "stderr before generating",
    )
    add_compile_option(parser, "the decode steps")
    add_cache_options(parser)
    parallel = parser.add_argument_group("multi-process (launch with torchrun --nproc-per-node N)")
    parallel.add_argument(
        "--parallel", default="none", help=f"none, {', '.join(MODES)} (default: none)"
    )
    parallel.add_argument(
        "--partition",
        default=PARALLEL_DEFAULTS["partition"],
        help=f"{', '.join(PARTITIONS)} (default: even)",
    )
    parallel.add_argument("--partition-table", help="JSON table for --partition table")
    parallel.add_argument("--partition-key", help="entry of the table")
    parallel.add_argument(
        "--parallel-decode",
        default=PARALLEL_DEFAULTS["parallel_decode"],
        help=f"{', '.join(DECODES)} (default: local)",
    )


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt from the argument, ``--prompt-file`` or stdin (no argument, or ``-``); never
    empty, always UTF-8."""
    from alisa.jobs.io import STDIN

    if args.prompt is not None and args.prompt_file is not None:
        raise CommandError("give the prompt either as an argument or with --prompt-file, not both")
    if args.prompt == STDIN and sys.stdin.isatty():
        raise CommandError(
            f"the prompt {STDIN!r} reads stdin, which is a terminal: pipe the prompt in, or give "
            "it as an argument or with --prompt-file"
        )
    if args.prompt is not None and args.prompt != STDIN:  # "-": stdin, as alisa batch reads
        prompt, source = args.prompt, "the prompt argument"
    elif args.prompt_file is not None:
        source = f"--prompt-file {str(args.prompt_file)!r}"
        try:
            prompt = args.prompt_file.read_text(encoding="utf-8-sig")  # a BOM is not the prompt
        except (OSError, UnicodeDecodeError) as error:
            raise CommandError(f"cannot read {source}: {error}") from None
    elif not sys.stdin.isatty():
        source = "the prompt on stdin"
        try:
            prompt = sys.stdin.buffer.read().decode("utf-8-sig")  # as --prompt-file reads
        except UnicodeDecodeError as error:
            raise CommandError(f"{source} is not valid UTF-8: {error}") from None
    else:
        raise CommandError("no prompt: pass it as an argument, with --prompt-file, or on stdin")
    try:
        prompt.encode("utf-8")  # an argument with undecodable bytes holds lone surrogates
    except UnicodeEncodeError:
        raise CommandError(f"{source} is not valid UTF-8") from None
    if not prompt.strip():
        raise CommandError("the prompt is empty")
    return prompt


def parallel_config(args: argparse.Namespace):
    """The ``ParallelConfig`` of the flags (None for ``--parallel none``); errors name flags."""
    from alisa.parallel import ParallelConfig

    if args.parallel == "none":
        _refuse_parallel_flags(args)
        return None
    if args.parallel not in MODES:
        valid = ", ".join(("none", *MODES))
        raise CommandError(f"--parallel={args.parallel!r} is unknown; valid: {valid}")
    _check_partition_table(args)
    return build_from_flags(
        ParallelConfig,
        PARALLEL_FLAGS,
        mode=args.parallel,
        partition=args.partition,
        decode=args.parallel_decode,
        table_path=args.partition_table,
        table_key=args.partition_key,
    )


def _check_partition_table(args: argparse.Namespace) -> None:
    """``--partition table`` reads one entry of a table: say which of its two flags is missing
    (ParallelConfig's own error names its fields, not the flags)."""
    if args.partition != "table":
        return
    needed = {
        "--partition-table": (args.partition_table, "the JSON table of splits"),
        "--partition-key": (args.partition_key, "the entry of --partition-table to use"),
    }
    missing = [f"{flag} ({what})" for flag, (value, what) in needed.items() if not value]
    if missing:
        raise CommandError(f"--partition table needs {' and '.join(missing)}")


def _refuse_parallel_flags(args: argparse.Namespace) -> None:
    """Without ``--parallel`` the other multi-process flags would be ignored: an error."""
    for name, default in PARALLEL_DEFAULTS.items():
        value = getattr(args, name)
        if value != default:
            flag = "--" + name.replace("_", "-")
            raise CommandError(
                f"{flag}={value!r} has no effect without --parallel (one of {', '.join(MODES)})"
            )


def fit_prompt(model, tokenizer, prompt: str, args: argparse.Namespace) -> str:
    """The prompt, or with ``--truncate-prompt`` its last tokens that fit the context with the
    ``--max-new-tokens`` to generate; without it, a prompt that does not fit is an error."""
    from alisa.model.loading import check_prompt_length, context_length, keep_last_tokens

    tokens = len(tokenizer(prompt)["input_ids"])
    known = context_length(model, tokenizer)
    new_tokens = args.max_new_tokens
    if known is not None and new_tokens >= known[0]:
        raise CommandError(
            f"--max-new-tokens={new_tokens} leaves no room for a prompt in the model's context "
            f"of {known[0]} tokens ({known[1]})"
        )
    if not args.truncate_prompt or known is None or tokens + new_tokens <= known[0]:
        alone = known is not None and tokens > known[0]
        hint = "; --truncate-prompt keeps the last tokens that fit"
        check_prompt_length(
            model,
            tokenizer,
            tokens,
            hint=hint if alone else hint + ", or lower --max-new-tokens",
            new_tokens=new_tokens,
        )
        return prompt
    keep = known[0] - new_tokens  # room for the generated tokens too
    kept = keep_last_tokens(tokenizer, prompt, keep)
    if not kept.strip():  # said as what it is, not as an empty prompt the user never gave
        room = f"{keep} prompt token{'s' if keep != 1 else ''}"
        last = "last token, which is" if keep == 1 else f"last {keep} tokens, which are"
        raise CommandError(
            f"--max-new-tokens={new_tokens} leaves room for only {room} in the model's context "
            f"of {known[0]} tokens ({known[1]}), and --truncate-prompt kept the prompt's {last} "
            f"only whitespace ({kept!r}); lower --max-new-tokens"
        )
    print(f"[alisa] prompt truncated from {tokens} to its last {keep} tokens", file=sys.stderr)
    return kept


def run(args: argparse.Namespace) -> int:
    from alisa.model.adapter import model_shape
    from alisa.model.loading import chat_prompt
    from alisa.ops.backends import model_ops
    from alisa.runtime.compiled import choose_compile
    from alisa.runtime.generate import generate

    check_minimum("--max-new-tokens", args.max_new_tokens, 1)  # as alisa batch: generate some
    prompt = read_prompt(args)
    config = cache_config_from_args(args)
    parallel = parallel_config(args)
    sampling = sampling_from_args(args)
    apply_threads("generate", args.threads)
    model, tokenizer = load_for_cli(args.model, args.dtype)
    if args.chat:
        prompt = chat_prompt(tokenizer, prompt)
    prompt = fit_prompt(model, tokenizer, prompt, args)
    shape = model_shape(model)
    num_layers = shape.num_layers
    # Refused here, before the prefill, when this machine cannot run the kernels asked for.
    ops = model_ops(model, config.kernels)
    unread = unread_kernels_note(config, ops.device)  # the device decides: said with the flag
    if unread is not None:
        print(f"alisa generate: warning: --kernels: {unread}", file=sys.stderr)
    if parallel is not None and args.compile == "on":
        raise CommandError(
            "--compile=on: the multi-process modes (--parallel) run their decode steps eager"
        )
    if args.show_config:
        print(describe_settings(config, num_layers), file=sys.stderr)
        print(f"kernels resolved: {ops.describe()}", file=sys.stderr)
        # What the device makes of --compile; a mode without a static step settles eager, as
        # the [alisa] line says.
        compile_choice = choose_compile(args.compile, next(model.parameters()).device)
        print(f"compile: {compile_choice.describe()}", file=sys.stderr)
    if parallel is not None:
        result = _parallel(args, model, tokenizer, prompt, config, parallel, sampling)
        if result is None:  # not the last rank: it printed nothing, the last rank reports
            return 0
    else:
        with warnings.catch_warnings():  # said below in flags, from what the run held
            warnings.simplefilter("ignore", IgnoredSettingWarning)
            result = generate(
                model,
                tokenizer,
                prompt,
                config,
                max_new_tokens=args.max_new_tokens,
                sampling=sampling,
                compile=args.compile,
            )
    print(result.texts[0])
    held = result.prompt_tokens[0] + len(result.token_ids[0])
    element_bytes = model.dtype.itemsize
    for note in (
        evicts_nothing_note(config, num_layers, held),
        long_stride_note(config, held),
        full_precision_note(config, held),
        coded_size_note(config, shape.head_dim, element_bytes),
    ):
        if note is not None:
            print(f"alisa generate: warning: {with_flag(note, FLOOR_FLAGS)}", file=sys.stderr)
    unevicted = no_evicting_layer_note(config, shape.windows)
    if unevicted is not None:
        print(f"alisa generate: warning: {unevicted}", file=sys.stderr)
    notes = [note for note in (window_note(shape), spare_note(result, model, config)) if note]
    budget = budget_text(result, model, config)
    print(stats_line(result, config, num_layers, " | ".join(notes), budget), file=sys.stderr)
    return 0


def changed_settings(config: AlisaConfig, num_layers: int) -> dict[str, str]:
    """The effective settings of ``config`` that differ from those of ``AlisaConfig()``, as
    text (:func:`alisa.settings.effective_values`)."""
    default = effective_values(AlisaConfig(), num_layers)
    values = effective_values(config, num_layers).items()
    return {name: text for name, text in values if default.get(name) != text}


def window_note(shape) -> str:
    """What a hybrid model's sliding layers keep (empty for a model without them)."""
    windows = sorted({window for window in shape.windows if window is not None})
    if not windows:
        return ""
    sliding = sum(window is not None for window in shape.windows)
    full = shape.num_layers - sliding
    sizes = "/".join(str(window) for window in windows)
    return (
        f"{sliding} sliding layers keep their {sizes}-token window; r applies to the "
        f"{full} full-attention layer{'s' if full != 1 else ''}"
    )


def spare_note(result, model, config: AlisaConfig) -> str:
    """Why the KV held exceeds what a dense cache of the same tokens would hold, when it does
    (short prompts: a sparse cache that has evicted nothing yet still holds its preallocated
    room, and INT8 its full-precision ring too); empty otherwise."""
    from alisa.model.adapter import model_shape
    from alisa.planning.spec import model_spec
    from alisa.sizes import format_bytes

    tokens = sum(result.prompt_tokens) + result.generated_tokens
    spec = model_spec(model, model_shape(model))
    dense = spec.kv_bytes_per_token() * tokens
    if result.kv_bytes <= dense:
        return ""
    reasons = ["slots are allocated up front for the prompt and --max-new-tokens"]
    if config.kv_bits < 16:
        ring = ring_tokens(config, spec.context_tokens)
        reasons.append(f"INT{config.kv_bits} also keeps the last {ring} tokens in full precision")
    saves = not config.keeps_everything or config.kv_bits < 16
    return (
        f"kv held exceeds a dense cache of these {tokens} tokens ({format_bytes(dense)}): "
        + "; ".join(reasons)
        + (" (the saving shows on long prompts)" if saves else "")
    )


def budget_text(result, model, config: AlisaConfig) -> str:
    """What ``--gpu-memory`` limits, as this run used it: the weights, the KV held on the device
    and the step buffers the planner sets aside (empty without a budget). The process's peak
    is no measure of it: that counts everything the process holds (on a CPU, torch and Python
    themselves too)."""
    from alisa.model.adapter import model_shape
    from alisa.planning.spec import model_spec
    from alisa.sizes import format_bytes, parse_bytes
    from scheduler import activation_bytes

    if config.gpu_memory is None:
        return ""
    spec = model_spec(model, model_shape(model))
    buffers = activation_bytes(spec, len(result.prompt_tokens))
    return (
        f"--gpu-memory {format_bytes(parse_bytes(config.gpu_memory, field='gpu_memory'))} "
        f"holds weights {format_bytes(spec.total_weight_bytes)}, device KV "
        f"{format_bytes(result.kv_tier_bytes.get('device', 0))} and planned step buffers "
        f"{format_bytes(buffers)}"
    )


def stats_line(
    result, config: AlisaConfig, num_layers: int | None = None, note: str = "", budget: str = ""
) -> str:
    """The one ``[alisa]`` line on stderr: lengths, speed, KV, the process's peak memory, and
    (given the model's ``num_layers``) the effective settings that differ from the defaults;
    ``budget`` (:func:`budget_text`) follows the peak, ``note`` (e.g. :func:`window_note`) ends
    the line."""
    from alisa.sizes import format_bytes

    changed = changed_settings(config, num_layers) if num_layers else {}
    for name in ("policy", "caching_ratio", "layer_policy"):  # policy and r are shown anyway
        changed.pop(name, None)
    # Explanations in parentheses belong to --show-config; the line keeps the values.
    extra = " ".join(
        f"{name}={text.split(' (')[0].replace(' ', '')}" for name, text in changed.items()
    )
    return (
        f"[alisa] prompt {result.prompt_tokens[0]} tok | generated {result.generated_tokens} tok | "
        f"ttft {result.ttft_s:.2f} s | decode {result.decode_tokens_per_s:.1f} tok/s | "
        f"kv held {format_bytes(result.kv_bytes)} (peak {format_bytes(result.peak_kv_bytes)}; "
        f"{tiers_text(result.kv_tier_bytes)}) | "
        f"peak process memory {format_bytes(result.peak_memory_bytes)} | "
        + (f"{budget} | " if budget else "")
        + f"policy {config.policy} r={config.caching_ratio:g}"
        + (f" | settings {extra}" if extra else "")
        + (f" | kernels {result.kernels}" if result.kernels else "")
        + (f" | compile {compile_text(result)}" if result.compile is not None else "")
        + (f" | {note}" if note else "")
    )


def compile_text(result) -> str:
    """``on (first step 62.3 s)``, ``off (auto)``: the [alisa] line's short form of
    ``result.compile`` (``--show-config`` gives the reason)."""
    if result.compile_s is not None:
        return f"on (first step {result.compile_s:.1f} s)"
    return f"{'on' if result.compile.compiled else 'off'} ({result.compile.asked})"


def tiers_text(tiers: dict[str, int]) -> str:
    """``device 1.2 MiB, host 3.4 MiB`` (tiers that hold nothing left out, device always)."""
    from alisa.sizes import format_bytes

    shown = [(name, count) for name, count in tiers.items() if count or name == "device"]
    return ", ".join(f"{name} {format_bytes(count)}" for name, count in shown)


def _parallel(args, model, tokenizer, prompt, config, parallel, sampling):
    """Run under torchrun: every rank joins; the last one returns the result."""
    import torch.distributed as dist

    from alisa.memory import PeakMemory
    from alisa.parallel import parallel_generate
    from alisa.parallel.dist import init_from_env

    init_from_env()
    try:
        with PeakMemory(next(model.parameters()).device) as memory:
            result = parallel_generate(
                model,
                tokenizer,
                prompt,
                config,
                parallel,
                max_new_tokens=args.max_new_tokens,
                sampling=sampling,
            )
        if result is not None:
            result.peak_memory_bytes = memory.peak_bytes
        return result
    finally:
        dist.destroy_process_group()
