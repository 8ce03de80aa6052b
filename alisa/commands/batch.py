"""``alisa batch``: a JSONL file of prompts through one device under a byte budget."""

from __future__ import annotations

import argparse
import math
import sys
from contextlib import ExitStack

from alisa.commands.options import (
    EXIT_ROWS_FAILED,
    CommandError,
    Typed,
    add_cache_options,
    add_compile_option,
    add_model_options,
    add_sampling_options,
    add_scheduler_options,
    add_threads_option,
    apply_threads,
    build_from_flags,
    cache_config_from_args,
    check_minimum,
    load_for_cli,
    model_notes_said,
    run_notes_said,
    sampling_from_args,
)

HELP = "generate for every prompt of a JSONL file under a memory budget (resumable)"

# BatchJob fields -> the flag that sets each (None: the field's own, e.g. --prefill-tokens).
JOB_FLAGS = {
    "input": "INPUT",
    "output": "-o/--output",
    **dict.fromkeys(
        ("max_new_tokens", "max_batch", "reserve_tokens", "prefill_tokens", "gpu_memory")
    ),
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.usage = "%(prog)s INPUT -o OUTPUT [options]   (common options first)"
    parser.add_argument(
        "input",
        help='JSONL rows {"id": ..., "prompt": ...} (+ options); "-": read them from stdin',
    )
    parser.add_argument(
        "-o", "--output", required=True, help="JSONL results, appended (a re-run resumes)"
    )
    add_model_options(parser)
    add_threads_option(parser)
    parser.add_argument(
        "--max-new-tokens",
        action=Typed,  # typed, a flag every row overrides is warned
        type=int,
        default=64,
        help="tokens per prompt unless a row says",
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="send every prompt as a user turn in the model's chat template (instruct models; "
        'a row\'s "chat": true/false overrides it)',
    )
    add_sampling_options(
        parser,
        "sampling of the rows that do not set their own (greedy unless --do-sample; with "
        "--seed every row draws from its own generator: its tokens do not depend on its batch)",
    )
    add_scheduler_options(parser)
    parser.add_argument(
        "--static",
        action="store_true",
        help="static batches (sorted by length, each run until its last row finishes) instead "
        "of continuous batching (rows join as others finish, longest work first)",
    )
    parser.add_argument(
        "--separate-prefills",
        action="store_true",
        help="continuous batching: prefill each newcomer in a forward of its own instead of "
        "inside the running rows' next decode step (for comparison; the tokens are the same)",
    )
    add_compile_option(
        parser,
        "the decode steps",
        " (continuous batching: one compiled step per bucket of rows, 1, 2, 4, ..., rows "
        "joining and leaving static caches sized to a length bucket; --static: one per "
        "batch size and length bucket)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--rank-timeout",
        type=float,
        help="under torchrun: seconds a rank waits for a silent peer before failing (a killed "
        "rank fails the others at once; default: 1800)",
    )
    add_cache_options(parser)


def run(args: argparse.Namespace) -> int:
    from alisa.jobs import BatchJob
    from alisa.jobs.distributed import launched
    from alisa.jobs.io import defaulted, input_name, read_requests
    from alisa.jobs.lock import output_lock
    from alisa.jobs.runner import open_output, run_opened_job
    from alisa.sizes import parse_budget

    check_minimum("--max-new-tokens", args.max_new_tokens, 1)
    check_minimum("--max-batch", args.max_batch, 1)
    check_minimum("--prefill-tokens", args.prefill_tokens, 1)
    if args.reserve_tokens is not None:
        check_minimum("--reserve-tokens", args.reserve_tokens, 0)
        if args.static:
            raise CommandError(
                f"--reserve-tokens {args.reserve_tokens} applies to continuous batching; "
                "--static batches reserve every row's max_new_tokens"
            )
    if args.separate_prefills and args.static:
        raise CommandError(
            "--separate-prefills applies to continuous batching; --static batches prefill "
            "every batch apart"
        )
    if args.rank_timeout is not None and not 0 < args.rank_timeout < math.inf:
        raise CommandError(f"--rank-timeout={args.rank_timeout} must be a finite number > 0")
    if args.kv_memory is not None:
        parse_budget(args.kv_memory, field="--kv-memory")
    # The job's budget sizes whole batches; the cache itself is not tiered per batch.
    config = cache_config_from_args(args, sizes_batches=True)
    if config.host_memory is not None and config.retention != "host":
        # Batches are sized to fit the device; their caches are never tiered to the host.
        raise CommandError(
            f"--host-memory {config.host_memory} has no effect in alisa batch without "
            "--retention host (batches are sized to --gpu-memory and --kv-memory)"
        )
    job = build_from_flags(
        BatchJob,
        JOB_FLAGS,
        input=args.input,
        output=args.output,
        config=config,
        gpu_memory=args.gpu_memory,
        kv_memory=args.kv_memory,
        max_new_tokens=args.max_new_tokens,
        max_batch=args.max_batch,
        progress=not args.no_progress,
        chat=args.chat,
        static=args.static,
        reserve_tokens=args.reserve_tokens,
        prefill_tokens=args.prefill_tokens,
        mixed_forwards=not args.separate_prefills,
        sampling=sampling_from_args(args),
        compile=args.compile,
    )
    apply_threads("batch", args.threads)
    if launched():
        return _run_ranks(args, job)
    if args.rank_timeout is not None:
        print("alisa batch: warning: --rank-timeout ignored: not under torchrun", file=sys.stderr)
    # Read once, as it comes (a pipe cannot be read twice), before the output is taken: an
    # input that never ends (a FIFO no one writes) holds no output locked.
    requests = read_requests(job.input)
    if not requests:
        print(
            f"alisa batch: warning: {input_name(job.input)} holds no rows: nothing to run",
            file=sys.stderr,
        )
    elif "max_new_tokens" in args.typed_fields and not defaulted(requests):
        print(
            f"alisa batch: warning: --max-new-tokens {args.max_new_tokens} has no effect: every "
            f"row of {input_name(job.input)} sets its own max_new_tokens",
            file=sys.stderr,
        )
    if requests and args.reserve_tokens is not None:
        _check_reserve(args.reserve_tokens, args.max_new_tokens, requests, job.input)
    # One writer per output: held from the file checks to the failures file.
    with output_lock(job.output) as held:
        log = open_output(job, requests)  # every file check before loading the model
        try:
            model, tokenizer = load_for_cli(args.model, args.dtype)
            pending = [r for r in requests if r.id not in log.done]
            _check_new_tokens(args.max_new_tokens, model, tokenizer, defaulted(pending))
            with model_notes_said("batch", model, job.config), run_notes_said("batch"):
                summary = run_opened_job(model, tokenizer, job, requests, log)
        finally:
            log.close()
        held.keep()  # the run finished: its output stays, even with no row in it
        return _report(summary, job)


def _check_reserve(reserve: int, new_tokens: int, requests: list, source: str) -> None:
    """Warn of a ``--reserve-tokens`` that changes nothing: at or above every row's
    ``max_new_tokens`` (its own, else ``new_tokens``), each row is admitted with room for its
    whole answer, as without the flag, and never paused."""
    from alisa.jobs.io import input_name

    most = max(request.options.get("max_new_tokens", new_tokens) for request in requests)
    if reserve >= most:
        print(
            f"alisa batch: warning: --reserve-tokens {reserve} has no effect: no row of "
            f"{input_name(source)} generates more than {most} tokens (max_new_tokens), so "
            "every row is admitted with room for its whole answer anyway; give fewer for rows "
            "to start sooner and pause when they outgrow it",
            file=sys.stderr,
        )


def _check_new_tokens(new_tokens: int, model, tokenizer, using: list) -> None:
    """Refuse a ``--max-new-tokens`` that leaves no room for any prompt in the context when
    rows take it (``using``: the pending rows without a ``max_new_tokens`` of their own). A row
    that does not fit with its own, or merely with this one, fails alone."""
    from alisa.model.loading import context_length

    known = context_length(model, tokenizer)
    if using and known is not None and new_tokens >= known[0]:
        raise CommandError(
            f"--max-new-tokens={new_tokens} leaves no room for a prompt in the model's context "
            f"of {known[0]} tokens ({known[1]}); {len(using)} row(s) set no max_new_tokens of "
            f"their own and take it (first: line {using[0].line}, id {using[0].id!r})"
        )


def _run_ranks(args: argparse.Namespace, job) -> int:
    """The same job over torchrun's ranks; rank 0 reports for all."""
    from alisa.jobs.distributed import WAIT_TIMEOUT_S, RankError, from_rank0, process_group
    from alisa.jobs.lock import output_lock
    from alisa.jobs.ranked import plan_ranks, run_ranked

    _check_rank_input(job.input)
    try:
        with ExitStack() as held, process_group(args.rank_timeout or WAIT_TIMEOUT_S) as ranks:
            locks = []  # rank 0's

            def take_lock() -> None:
                locks.append(held.enter_context(output_lock(job.output)))

            # Rank 0 holds the output's lock for the whole run; refused, every rank stops.
            from_rank0(ranks, take_lock)
            plan = plan_ranks(job, ranks)
            model, tokenizer = load_for_cli(args.model, args.dtype)
            _check_new_tokens(args.max_new_tokens, model, tokenizer, plan.defaulted)
            with run_notes_said("batch"):  # every rank says what holds for its own rows
                summary = run_ranked(model, tokenizer, job, plan, ranks)
            for lock in locks:
                lock.keep()  # the run finished: its output stays, even with no row in it
            if ranks.rank != 0:
                return EXIT_ROWS_FAILED if summary.failed else 0
            return _report(summary, job)
    except RankError as error:
        raise CommandError(str(error)) from None


def _check_rank_input(path: str) -> None:
    """Under torchrun every rank reads the input: refuse one that can be read only once."""
    from pathlib import Path

    from alisa.jobs.io import STDIN

    if path == STDIN or (Path(path).exists() and not Path(path).is_file()):
        raise CommandError(
            f"the input {path!r} is not a regular file: under torchrun every rank reads it, "
            "and a pipe or standard input can be read only once; save the rows to a file"
        )


SHOWN_FAILURES = 10  # failed rows named on stderr; all of them go to the failures file


def _report(summary, job) -> int:
    """Print the summary and the failed rows (input file:line and id); write the failures file;
    the exit code."""
    from alisa.jobs.io import input_name, write_failures

    print(f"[alisa batch] {summary.describe()}", file=sys.stderr)
    failures = write_failures(job.output, list(summary.errors.values()))
    if not summary.failed:
        return 0
    for row in list(summary.errors.values())[:SHOWN_FAILURES]:
        print(
            f"alisa batch: {input_name(job.input)}:{row.get('line', '?')}: id {row['id']!r} "
            f"{row['finish_reason']}: {row['error']}",
            file=sys.stderr,
        )
    # Only a row that did not fit the budget can succeed with a larger one.
    remedies = []
    if summary.did_not_fit:
        remedies.append(
            f"{len(summary.did_not_fit)} did not fit the budget: re-run with a larger one to "
            "retry them"
        )
    if summary.too_long:
        remedies.append(
            f"{len(summary.too_long)} longer than the model's context, which no budget changes: "
            "shorten them or lower their max_new_tokens"
        )
    print(
        f"alisa batch: {len(summary.failed)} row(s) failed (listed in {failures}); they are not "
        f"in {job.output}: {'; '.join(remedies)}",
        file=sys.stderr,
    )
    return EXIT_ROWS_FAILED
