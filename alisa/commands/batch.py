"""``alisa batch``: a JSONL file of prompts through one device under a byte budget."""

from __future__ import annotations

import argparse
import sys

from alisa.commands.options import (
    EXIT_ROWS_FAILED,
    add_cache_options,
    add_model_options,
    cache_config_from_args,
    check_minimum,
    load_for_cli,
)

HELP = "generate for every prompt of a JSONL file under a memory budget (resumable)"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", help='JSONL rows {"id": ..., "prompt": ...} (+ options)')
    parser.add_argument(
        "-o", "--output", required=True, help="JSONL results, appended (a re-run resumes)"
    )
    add_model_options(parser)
    parser.add_argument(
        "--max-new-tokens", type=int, default=64, help="tokens per prompt unless a row says"
    )
    parser.add_argument("--kv-memory", help="byte budget of the KV cache alone, e.g. 256MiB")
    parser.add_argument("--max-batch", type=int, default=64, help="upper bound on the batch size")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_cache_options(parser)


def run(args: argparse.Namespace) -> int:
    from alisa.jobs import BatchJob, run_batch
    from alisa.jobs.runner import open_job
    from alisa.memory import parse_bytes

    check_minimum("--max-new-tokens", args.max_new_tokens, 1)
    check_minimum("--max-batch", args.max_batch, 1)
    if args.kv_memory is not None:
        parse_bytes(args.kv_memory, field="--kv-memory")
    config = cache_config_from_args(args)
    # The job's budget sizes whole batches; the cache itself is not tiered per batch.
    budget, config = config.gpu_memory, config.with_overrides(gpu_memory=None)
    job = BatchJob(
        input=args.input,
        output=args.output,
        config=config,
        gpu_memory=budget,
        kv_memory=args.kv_memory,
        max_new_tokens=args.max_new_tokens,
        max_batch=args.max_batch,
        progress=not args.no_progress,
    )
    _, log = open_job(job)  # every file check before loading the model
    log.close()
    model, tokenizer = load_for_cli(args.model, args.dtype)
    summary = run_batch(model, tokenizer, job)
    print(f"[alisa batch] {summary.describe()}", file=sys.stderr)
    if summary.failed:
        print(
            f"alisa batch: {len(summary.failed)} row(s) failed (see their 'error' in "
            f"{args.output}); they are not done: re-run with a larger budget to retry them",
            file=sys.stderr,
        )
        return EXIT_ROWS_FAILED
    return 0
