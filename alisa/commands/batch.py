"""``alisa batch``: a JSONL file of prompts through one device under a byte budget."""

from __future__ import annotations

import argparse
import sys

from alisa.cli import add_cache_options, add_model_options, cache_config_from_args

HELP = "generate for every prompt of a JSONL file under a memory budget (resumable)"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", help='JSONL rows {"id": ..., "prompt": ...} (+ options)')
    parser.add_argument("-o", "--output", required=True, help="JSONL results, appended")
    add_model_options(parser)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--kv-memory", help="byte budget of the KV cache alone, e.g. 256MiB")
    parser.add_argument("--max-batch", type=int, default=64, help="upper bound on the batch size")
    parser.add_argument("--no-progress", action="store_true")
    add_cache_options(parser)


def run(args: argparse.Namespace) -> int:
    from alisa.cli import load_for_cli
    from alisa.jobs import BatchJob, read_requests, run_batch
    from alisa.jobs.io import OutputLog

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
    read_requests(job.input)  # validate before loading the model
    OutputLog(job.output).close()  # fail early on an unwritable output
    model, tokenizer = load_for_cli(args.model, args.dtype)
    summary = run_batch(model, tokenizer, job)
    print(f"[alisa batch] {summary.describe()}", file=sys.stderr)
    return 0
