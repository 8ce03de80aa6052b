"""``alisa generate``: one prompt (argument, file or stdin) -> completion and a stats line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from alisa.cli import CommandError, add_cache_options, add_model_options, cache_config_from_args

HELP = "generate a completion for one prompt"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", help="the prompt (else --prompt-file, else stdin)")
    parser.add_argument("--prompt-file", type=Path, help="read the prompt from this file")
    add_model_options(parser)
    parser.add_argument(
        "--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)"
    )
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    sampling = parser.add_argument_group("sampling (greedy unless --do-sample)")
    sampling.add_argument("--do-sample", action="store_true", help="sample instead of greedy")
    sampling.add_argument("--temperature", type=float)
    sampling.add_argument("--top-k", type=int)
    sampling.add_argument("--top-p", type=float)
    sampling.add_argument("--seed", type=int, help="seed for sampling")
    add_cache_options(parser)
    parallel = parser.add_argument_group("multi-process (launch with torchrun --nproc-per-node N)")
    parallel.add_argument("--parallel", default="none", help="none, kvr (KV-Runahead) or tsp")
    parallel.add_argument("--partition", default="even", help="even, search or table")
    parallel.add_argument("--partition-table", help="JSON table for --partition table")
    parallel.add_argument("--partition-key", help="entry of the table")
    parallel.add_argument("--parallel-decode", default="local", help="local or sharded")


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt from the argument, ``--prompt-file`` or stdin; never empty."""
    if args.prompt is not None and args.prompt_file is not None:
        raise CommandError("give the prompt either as an argument or with --prompt-file, not both")
    if args.prompt is not None:
        prompt = args.prompt
    elif args.prompt_file is not None:
        try:
            prompt = args.prompt_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise CommandError(
                f"cannot read --prompt-file {str(args.prompt_file)!r}: {error}"
            ) from None
    elif not sys.stdin.isatty():
        prompt = sys.stdin.read()
    else:
        raise CommandError("no prompt: pass it as an argument, with --prompt-file, or on stdin")
    if not prompt.strip():
        raise CommandError("the prompt is empty")
    return prompt


def run(args: argparse.Namespace) -> int:
    from alisa.cli import load_for_cli
    from alisa.generate import SamplingOptions, generate
    from alisa.memory import format_bytes

    if args.max_new_tokens < 0:
        raise CommandError(f"--max-new-tokens={args.max_new_tokens} must be >= 0")
    prompt = read_prompt(args)
    config = cache_config_from_args(args)
    sampling = SamplingOptions(
        do_sample=args.do_sample,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    model, tokenizer = load_for_cli(args.model, args.dtype)
    if args.chat:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    if args.parallel != "none":
        result = _parallel(args, model, tokenizer, prompt, config, sampling)
        if result is None:  # not the last rank: it printed nothing, the last rank reports
            return 0
    else:
        result = generate(
            model, tokenizer, prompt, config, max_new_tokens=args.max_new_tokens, sampling=sampling
        )
    print(result.texts[0])
    print(
        f"[alisa] prompt {result.prompt_tokens[0]} tok | generated {result.generated_tokens} tok | "
        f"ttft {result.ttft_s:.2f} s | decode {result.decode_tokens_per_s:.1f} tok/s | "
        f"kv held {format_bytes(result.kv_bytes)} (peak {format_bytes(result.peak_kv_bytes)}) | "
        f"peak memory {format_bytes(result.peak_memory_bytes)} | policy {config.policy} "
        f"r={config.caching_ratio:g}",
        file=sys.stderr,
    )
    return 0


def _parallel(args, model, tokenizer, prompt, config, sampling):
    """Run under torchrun: every rank joins; the last one returns the result."""
    import torch.distributed as dist

    from alisa.memory import PeakMemory
    from alisa.parallel import ParallelConfig, parallel_generate
    from alisa.parallel.dist import init_from_env

    parallel = ParallelConfig(
        mode=args.parallel,
        partition=args.partition,
        decode=args.parallel_decode,
        table_path=args.partition_table,
        table_key=args.partition_key,
    )
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
