"""``alisa batch`` under torchrun: each rank runs the ids it owns, rank 0 merges one output.

Every rank writes ``OUT.parts/rank-K.jsonl`` (one ``write`` + ``fsync`` per row); at the end
rank 0 appends the parts to ``OUT`` with the rules of the single-process output (never cutting
foreign data, skipping ids already there) and deletes them. A run that was killed leaves its
parts; the next run, with any number of ranks, merges them before anything else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from alisa.jobs.distributed import (
    RankProgress,
    Ranks,
    finish_parts,
    from_rank0,
    gather,
    new_parts,
    on_every_rank,
)
from alisa.jobs.io import OutputLog, Request, defaulted, read_requests
from alisa.jobs.parts import merge_parts, part_path, share
from alisa.jobs.runner import (
    RESULT_KEYS,
    BatchJob,
    JobSummary,
    job_settings,
    model_settings,
    open_job,
    run_requests,
)


@dataclass(frozen=True, kw_only=True)
class RankPlan:
    """What one rank runs, and the job-wide counts rank 0 reports."""

    pending: list[Request]  # this rank's ids not done yet
    token: str  # this run's name (see new_parts)
    prompts: int
    already_done: int
    defaulted: list[Request]  # the job's pending rows that take its max_new_tokens


def plan_ranks(job: BatchJob, ranks: Ranks) -> RankPlan:
    """Every file check of :func:`open_job` (rank 0), leftover parts merged, ids shared out.

    Raises
    ------
    ValueError
        On every rank: a bad input row, a bad output, a parts folder some rank cannot see.
    """

    def done_ids() -> list:
        _, log = open_job(job)  # validates the files and merges a killed run's parts
        log.close()
        return list(log.done)

    done = set(from_rank0(ranks, done_ids))
    token = new_parts(ranks, Path(job.output))
    requests = on_every_rank(ranks, lambda: read_requests(job.input))
    pending = [r for r in requests if r.id not in done]
    # Prompt length as the cost: equal row counts and similar prefill work on every rank.
    mine = share(pending, ranks.world, ranks.rank, key=lambda r: r.id, cost=lambda r: len(r.prompt))
    return RankPlan(
        pending=mine,
        token=token,
        prompts=len(requests),
        already_done=len(requests) - len(pending),
        defaulted=defaulted(pending),
    )


def run_ranked(
    model,
    tokenizer,
    job: BatchJob,
    plan: RankPlan,
    ranks: Ranks,
    cache_factory: Callable | None = None,
) -> JobSummary:
    """Run this rank's share of ``plan``, wait for every rank, merge; the job-wide summary.

    Raises
    ------
    RankError
        Another rank stopped; what was written stays in the parts for the next run.
    """
    output = Path(job.output)
    total = plan.prompts - plan.already_done
    bar = RankProgress(ranks, plan.token, total, job.progress, "alisa batch")
    made_with = {**job_settings(job), **model_settings(model)}
    log = OutputLog(part_path(output, ranks.rank), keys=RESULT_KEYS, settings=made_with)
    try:
        summary = run_requests(
            model, tokenizer, job, plan.pending, log, bar, cache_factory, ranks.local_world
        )
    finally:
        log.close()
    finish_parts(ranks, bar, lambda: _merge(output))
    combined = combine(gather(ranks, summary))
    combined.prompts, combined.already_done = plan.prompts, plan.already_done
    return combined


def _merge(output: Path) -> int:
    log = OutputLog(output, keys=RESULT_KEYS)
    try:
        return merge_parts(log)
    finally:
        log.close()


def combine(summaries: list[JobSummary]) -> JobSummary:
    """One summary of the ranks' summaries (times and peaks: the largest of any rank)."""
    total = JobSummary()
    for part in summaries:
        total.completed += part.completed
        total.did_not_fit += part.did_not_fit
        total.too_long += part.too_long
        total.batches += part.batches
        total.generated_tokens += part.generated_tokens
        total.ttfts_s += part.ttfts_s
        total.errors.update(part.errors)
        total.seconds = max(total.seconds, part.seconds)
        total.peak_kv_bytes = max(total.peak_kv_bytes, part.peak_kv_bytes)
        total.peak_memory_bytes = max(total.peak_memory_bytes, part.peak_memory_bytes)
    first = summaries[0]
    total.budget_bytes, total.budget_name = first.budget_bytes, first.budget_name
    total.kv_budget_bytes, total.kv_budget_name = first.kv_budget_bytes, first.kv_budget_name
    total.host_budget_bytes = first.host_budget_bytes
    total.host_budget_name = first.host_budget_name
    total.peak_memory_counts = first.peak_memory_counts
    return total
