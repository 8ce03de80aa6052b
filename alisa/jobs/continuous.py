"""Batch jobs by continuous batching: one scheduler per sampling setting, rows join as others
finish (longest work first), each result handed back the step it completes (so a killed job
loses no finished row)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial

from alisa.jobs.io import OutputLog, Request
from alisa.jobs.stream import ByteBudget
from alisa.kv.cache import AlisaCache
from alisa.runtime.compiled import CompileChoice, compiled_decode
from alisa.runtime.continuous import ContinuousScheduler
from alisa.runtime.engine import Engine
from alisa.runtime.requests import SchedulerStats, StepRecord, StreamRequest, StreamResult
from alisa.runtime.sampling import SamplingOptions
from alisa.sizes import format_bytes
from scheduler import ModelSpec

SAMPLING_KEYS = ("do_sample", "temperature", "top_k", "top_p", "seed")


def continuous_results(
    model,
    tokenizer,
    job,
    requests: Sequence[Request],
    prompt_ids: dict,
    spec: ModelSpec,
    budgets: tuple[int | None, int | None],
    sampling: Callable[[dict], SamplingOptions],
    *,
    started_s: float,
    on_step: Callable[[StepRecord], None] | None = None,
    compiled: CompileChoice | None = None,
    max_cache_len: int | None = None,
) -> Iterator[tuple[Request, StreamResult, SchedulerStats]]:
    """(request, result, scheduler stats) of every request, in completion order.

    Parameters
    ----------
    job
        The :class:`~alisa.jobs.runner.BatchJob` (config, ``max_new_tokens``, ``max_batch``,
        ``reserve_tokens``, ``stop_at_eos``).
    prompt_ids
        Token ids of each request's prompt, by request id.
    budgets
        (device bytes, KV bytes), either None for no limit (the host regions' budget is the
        config's ``host_memory``, :class:`~alisa.jobs.stream.ByteBudget`).
    sampling
        A request's options -> its sampling (requests sharing one share a scheduler).
    started_s
        When the job started (``time.perf_counter()``): every row of the file arrived then,
        so TTFTs count the wait in the queue.
    on_step
        Told each scheduler iteration (timelines).
    compiled, max_cache_len
        Decode steps compiled (settled for the job's mode: :func:`~alisa.jobs.runner.
        job_compile`) over static caches of ``max_cache_len`` tokens per row, which every
        request's prompt and new tokens fit; None: eager over growing caches.
    """
    groups: dict[tuple, list[Request]] = {}
    for request in requests:
        key = tuple((k, request.options.get(k)) for k in SAMPLING_KEYS)
        groups.setdefault(key, []).append(request)
    admission = ByteBudget(
        spec=spec,
        config=job.config,
        device_bytes=budgets[0],
        kv_bytes=budgets[1],
        max_rows=job.max_batch,
        reserve_tokens=job.reserve_tokens,
    )
    decode = compiled_decode(model, compiled)  # one for every group: its graphs compile once
    for group in groups.values():
        engine = Engine(
            model,
            tokenizer,
            sampling(group[0].options),
            stop_at_eos=job.stop_at_eos,
            compiled=decode,
        )
        scheduler = ContinuousScheduler(
            engine,
            partial(AlisaCache, model, admission.cache_config),
            admission,
            prefill_tokens=job.prefill_tokens,
            on_step=on_step,
            packing=job.mixed_forwards,
            max_cache_len=None if decode is None else max_cache_len,
        )
        by_id = {request.id: request for request in group}
        requests_in = (
            StreamRequest(
                prompt_ids=prompt_ids[r.id],
                max_new_tokens=r.options.get("max_new_tokens", job.max_new_tokens),
                id=r.id,
                arrival_s=started_s,
            )
            for r in group
        )
        # Every row of the file is there from the start, so the order is ours: the longest
        # work first (most new tokens allowed, then the longest prompt; LPT, Graham 1969), so
        # that no long answer starts late and runs alone at the end, and rows of like length
        # share a batch (slots are rectangular). sorted() is stable: ties keep file order.
        stream = sorted(
            requests_in, key=lambda r: (r.max_new_tokens, len(r.prompt_ids)), reverse=True
        )
        for result in scheduler.run(stream, lookahead=job.max_batch):
            yield by_id[result.id], result, scheduler.stats


def recorded(
    rows: Iterator[tuple[Request, StreamResult, SchedulerStats]],
    log: OutputLog,
    summary,
    refused: Callable[[Request], dict],
    own: Mapping,
) -> Iterator[list]:
    """Append each result to ``log`` the moment it comes (a killed job keeps every finished
    row), with its own settings (``own``, by id: ``alisa.jobs.runner.own_settings``), and count
    it in ``summary`` (a :class:`~alisa.jobs.runner.JobSummary`).

    Yields what the static path yields per batch, for its progress loop: [request], or
    [error row] from ``refused`` for a request no budget admits even alone.
    """
    for request, result, stats in rows:
        # The groups' schedulers share one compiled step, whose compile time adds up.
        summary.compile_s = max(summary.compile_s, stats.compile_s or 0.0)
        summary.progress = {"rows": stats.running, "queued": stats.queued}
        if stats.preemptions:  # only where rows outgrew a reservation
            summary.progress["paused"] = stats.paused
        summary.progress["kv"] = format_bytes(stats.kv_bytes)
        summary.peak_kv_bytes = max(summary.peak_kv_bytes, stats.peak_kv_bytes)
        summary.max_rows = max(summary.max_rows, stats.peak_rows)
        if result.finish_reason == "did_not_fit":
            yield [refused(request)]
            continue
        log.append(
            {
                "id": request.id,
                "text": result.text,
                "tokens": len(result.token_ids),
                "finish_reason": result.finish_reason,
            },
            own=own[request.id],
        )
        summary.completed += 1
        summary.preemptions += result.paused
        summary.generated_tokens += len(result.token_ids)
        summary.ttfts_s.append(result.ttft_s)
        yield [request]
