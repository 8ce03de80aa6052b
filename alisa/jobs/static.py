"""Static batches (``alisa batch --static``, and foreign caches such as ``DynamicCache``):
prompts sorted by length, each batch as large as the budget allows for its longest prompt and
its whole ``max_new_tokens``, run until its last row finishes (finished rows are pruned, none
join). Kept for comparison with continuous batching (:mod:`alisa.jobs.continuous`), and the
batching whose decode steps can run compiled (``--compile``): a batch keeps its rows, and its
cache is static, sized to a capacity bucket
(:func:`~alisa.runtime.compiled.compiled_capacity`) so that batches of nearby lengths replay
one compiled graph (:mod:`alisa.runtime.compiled`, issue 65).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping

from transformers import Cache

from alisa.jobs.io import OutputLog, Request
from alisa.jobs.sizing import BatchMemory, batch_memory, largest_batch
from alisa.runtime.compiled import CompileChoice
from alisa.runtime.generate import SamplingOptions, generate
from alisa.runtime.requests import StepRecord
from scheduler import ModelSpec


def planned_batches(
    requests: list[Request],
    lengths: dict,
    job,
    spec: ModelSpec,
    sizing,
    limits: tuple[int | None, int | None, int | None],
    refused: Callable[[Request, BatchMemory], dict],
    held: Callable[[int], int] = lambda tokens: tokens,
) -> Iterator[tuple[list, int]]:
    """(batch, new_tokens) in run order: longest prompts first within each option group.

    ``sizing`` is the cache's config (None: HF's dense cache), ``limits`` the (device, KV,
    host region) byte budgets. A prompt that cannot fit even alone comes out as a one-element
    batch holding its error row, from ``refused(request, its predicted memory)``. ``held``
    maps the tokens a batch's longest row needs to the tokens its cache holds per row (a
    compiled batch's :func:`~alisa.runtime.compiled.compiled_capacity`), which the batch is
    sized for.
    """
    device, kv, host = limits
    for group in _groups(requests, job):
        new_tokens = group[0].options.get("max_new_tokens", job.max_new_tokens)
        queue = sorted(group, key=lambda r: lengths[r.id], reverse=True)
        while queue:
            longest = held(lengths[queue[0].id] + new_tokens) - new_tokens
            size = largest_batch(spec, sizing, device, longest, new_tokens, job.max_batch, kv, host)
            if size == 0:
                need = batch_memory(spec, sizing, 1, longest, new_tokens)
                yield [refused(queue.pop(0), need)], new_tokens
                continue
            batch, queue = queue[:size], queue[size:]
            yield batch, new_tokens


def run_static(
    model,
    tokenizer,
    job,
    batches: Iterator[tuple[list, int]],
    log: OutputLog,
    summary,
    *,
    sampling: Callable[[dict], SamplingOptions],
    factory: Callable | None,
    started_s: float,
    own: Mapping,
    on_step: Callable[[StepRecord], None] | None = None,
    compiled: CompileChoice,
) -> Iterator[list]:
    """Run each of ``batches`` through :func:`~alisa.runtime.generate.generate` (a fresh cache
    from ``factory``, else the job's), append its rows to ``log``, count them in ``summary`` (a
    :class:`~alisa.jobs.runner.JobSummary`); yield each batch (error rows pass through).

    ``compiled``: the job's decode steps, compiled or eager (settled for its mode; under
    ``"auto"`` a model the compiler cannot trace settles eager at the first batch). Compiled,
    a batch keeps its finished rows (a compiled step keeps its batch) and ``generate`` builds
    the job's cache static, at its capacity bucket (:func:`~alisa.runtime.generate.new_cache`);
    eager, finished rows are pruned and the cache grows.
    """
    for batch, new_tokens in batches:
        if not new_tokens or (len(batch) == 1 and isinstance(batch[0], dict)):
            yield batch
            continue
        start = time.perf_counter()
        config, cache = job.config, None
        if factory is not None:  # a factory's cache keeps KV by its own rules
            config, cache = None, _made_cache(factory)
        result = generate(
            model,
            tokenizer,
            [r.prompt for r in batch],
            config,
            max_new_tokens=new_tokens,
            sampling=sampling(batch[0].options),
            past_key_values=cache,
            prune_finished=not compiled.compiled,
            stop_at_eos=job.stop_at_eos,
            compile=compiled.asked if compiled.compiled else "off",
        )
        if result.compile_s is not None:
            summary.compile_s += result.compile_s
        if compiled.compiled and not result.compile.compiled:  # "auto": the step not traced
            compiled = summary.compile = result.compile  # the next batches run eager at once
        _record(log, summary, batch, result, waited_s=start - started_s, own=own)
        for record in batch_steps(result, start) if on_step else ():
            on_step(record)
        yield batch


def _made_cache(factory: Callable) -> Cache:
    """``factory()``, refused unless it is a transformers ``Cache``: ``generate`` takes None for
    "build the job's own cache", so a factory that forgot its ``return`` would run unnoticed."""
    cache = factory()
    if not isinstance(cache, Cache):
        raise ValueError(
            f"cache_factory returned {cache!r}, not a transformers Cache (a missing return?): "
            "it must build a new empty cache for each batch, e.g. lambda: DynamicCache()"
        )
    return cache


def batch_steps(result, started_s: float) -> list[StepRecord]:
    """A static batch's decode steps as records: the rows still generating at each (finished
    rows are pruned), timed from the batch's start by its TTFT and step times."""
    lengths = [len(ids) for ids in result.token_ids]
    records, clock = [], started_s + result.ttft_s
    for step, seconds in enumerate([0.0, *result.step_times_s]):
        clock += seconds
        rows = sum(length > step for length in lengths)
        records.append(StepRecord(time_s=clock, rows=rows, tokens=rows))
    return records


def _record(
    log: OutputLog, summary, batch: list[Request], result, waited_s: float, own: Mapping
) -> None:
    """Append a batch's rows, each with its own settings (``own``, by id); each one's TTFT is
    its wait for the batch plus the batch's prefill (``waited_s``: from the job's start to the
    batch's)."""
    rows = zip(batch, result.texts, result.token_ids, result.finish_reasons, strict=True)
    for request, text, ids, reason in rows:
        log.append(
            {"id": request.id, "text": text, "tokens": len(ids), "finish_reason": reason},
            own=own[request.id],
        )
    summary.batches.append(len(batch))
    summary.completed += len(batch)
    summary.generated_tokens += result.generated_tokens
    summary.peak_kv_bytes = max(summary.peak_kv_bytes, result.peak_kv_bytes)
    summary.ttfts_s += [waited_s + result.ttft_s] * len(batch)


def _groups(requests: list[Request], job) -> list[list[Request]]:
    """Requests that can share a batch: the same generation options."""
    groups: dict[tuple, list[Request]] = {}
    for request in requests:
        options = {"max_new_tokens": job.max_new_tokens, **request.options}
        groups.setdefault(tuple(sorted(options.items())), []).append(request)
    return list(groups.values())
