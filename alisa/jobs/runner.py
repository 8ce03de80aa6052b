"""Run a file of prompts through one device under a byte budget, batch by batch, resumably."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil
from tqdm.auto import tqdm

from alisa.architecture import model_shape
from alisa.config import AlisaConfig
from alisa.generate import SamplingOptions, generate
from alisa.jobs.io import OutputLog, Request, read_requests
from alisa.jobs.sizing import BatchMemory, batch_memory, largest_batch
from alisa.memory import PeakMemory, format_bytes, parse_bytes
from alisa.planning import model_spec


@dataclass(frozen=True, kw_only=True)
class BatchJob:
    """What to run.

    Parameters
    ----------
    input, output
        JSONL paths: rows ``{"id", "prompt", ...options}`` in; results appended out.
    config
        KV policy and storage for every batch.
    gpu_memory
        Device byte budget for weights, KV and activations (``"8GiB"``); ``None``: no limit.
    kv_memory
        Byte budget for the KV cache alone (the comparison the paper makes: the same KV bytes
        for every system); ``None``: only ``gpu_memory`` limits the batches.
    max_new_tokens
        Default tokens per prompt (a row's ``max_new_tokens`` overrides it).
    max_batch
        Upper bound on the batch size whatever the budget allows.
    stop_at_eos
        False: every prompt generates exactly its ``max_new_tokens`` (benchmarks).
    """

    input: str
    output: str
    config: AlisaConfig = field(default_factory=AlisaConfig)
    gpu_memory: int | str | None = None
    kv_memory: int | str | None = None
    max_new_tokens: int = 64
    max_batch: int = 64
    stop_at_eos: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("gpu_memory", "kv_memory"):
            if getattr(self, name) is not None:
                parse_bytes(getattr(self, name), field=name)
        for name in ("max_new_tokens", "max_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")


@dataclass(kw_only=True)
class JobSummary:
    """What a job did and what it cost."""

    prompts: int = 0
    already_done: int = 0
    completed: int = 0
    did_not_fit: list = field(default_factory=list)
    batches: list = field(default_factory=list)  # sizes of the batches run
    generated_tokens: int = 0
    seconds: float = 0.0
    peak_kv_bytes: int = 0
    peak_memory_bytes: int = 0
    budget_bytes: int | None = None
    ttfts_s: list = field(default_factory=list)  # time to first token of each batch

    @property
    def mean_ttft_s(self) -> float:
        return sum(self.ttfts_s) / len(self.ttfts_s) if self.ttfts_s else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0

    def describe(self) -> str:
        budget = format_bytes(self.budget_bytes) if self.budget_bytes else "unlimited"
        return (
            f"{self.completed} prompts done ({self.already_done} already done before), "
            f"{len(self.did_not_fit)} did not fit, {len(self.batches)} batches "
            f"(sizes {min(self.batches, default=0)}-{max(self.batches, default=0)}); "
            f"{self.generated_tokens} tokens in {self.seconds:.1f} s = "
            f"{self.tokens_per_s:.1f} tok/s; "
            f"peak KV {format_bytes(self.peak_kv_bytes)}, peak memory "
            f"{format_bytes(self.peak_memory_bytes)} (budget {budget})"
        )


def run_batch(
    model, tokenizer, job: BatchJob, *, cache_factory: Callable | None = None
) -> JobSummary:
    """Generate for every pending prompt of ``job.input``, appending results to ``job.output``.

    Batches are formed per generation-option group from prompts sorted by length, each as large
    as the predicted peak memory allows under ``job.gpu_memory`` (see ``alisa.jobs.sizing``).
    ``cache_factory`` replaces the ALISA cache (e.g. ``DynamicCache`` for a baseline; it is then
    sized as a dense cache).

    Raises
    ------
    ValueError
        Bad input rows (file and line), an unwritable output, or a budget below the weights.
    """
    requests = read_requests(job.input)
    log = OutputLog(job.output)
    try:
        return _run(model, tokenizer, job, requests, log, cache_factory)
    finally:
        log.close()


def _run(model, tokenizer, job, requests, log, cache_factory) -> JobSummary:
    spec = model_spec(model, model_shape(model))
    sizing = None if cache_factory is not None else job.config
    budget = parse_bytes(job.gpu_memory, field="gpu_memory") if job.gpu_memory is not None else None
    kv_budget = parse_bytes(job.kv_memory, field="kv_memory") if job.kv_memory is not None else None
    if budget is not None and budget <= spec.total_weight_bytes:
        raise ValueError(
            f"gpu_memory={job.gpu_memory!r} ({budget} bytes) is smaller than the weights "
            f"({spec.total_weight_bytes} bytes)"
        )
    if next(model.parameters()).device.type == "cpu":
        # On a CPU the device is host memory: never plan past what is free (weights are loaded).
        free = spec.total_weight_bytes + int(0.9 * psutil.virtual_memory().available)
        budget = free if budget is None else min(budget, free)
    summary = JobSummary(prompts=len(requests), budget_bytes=budget)
    pending = [r for r in requests if r.id not in log.done]
    summary.already_done = len(requests) - len(pending)
    encoded = tokenizer([r.prompt for r in pending])["input_ids"] if pending else []
    lengths = {r.id: len(ids) for r, ids in zip(pending, encoded, strict=True)}
    bar = tqdm(total=len(pending), unit="prompt", disable=not job.progress, desc="alisa batch")
    started = time.perf_counter()
    with PeakMemory(next(model.parameters()).device) as memory:
        for batch, new_tokens in _batches(pending, lengths, job, spec, sizing, budget, kv_budget):
            if len(batch) == 1 and isinstance(batch[0], dict):  # did not fit even alone
                log.append(batch[0])
                summary.did_not_fit.append(batch[0]["id"])
            else:
                result = generate(
                    model,
                    tokenizer,
                    [r.prompt for r in batch],
                    job.config,
                    max_new_tokens=new_tokens,
                    sampling=_sampling(batch[0].options),
                    past_key_values=cache_factory() if cache_factory else None,
                    prune_finished=True,
                    stop_at_eos=job.stop_at_eos,
                )
                _record(log, summary, batch, result)
            bar.update(len(batch))
            rate = summary.generated_tokens / (time.perf_counter() - started)
            bar.set_postfix(tok_s=f"{rate:.1f}", batch=len(batch))
    bar.close()
    summary.seconds = time.perf_counter() - started
    summary.peak_memory_bytes = memory.peak_bytes
    return summary


def _batches(pending, lengths, job, spec, sizing, budget, kv_budget):
    """(batch, new_tokens) in run order: longest prompts first within each option group.

    A prompt that cannot fit even alone comes out as a one-element batch holding its error row.
    """
    for group in _groups(pending, job):
        new_tokens = group[0].options.get("max_new_tokens", job.max_new_tokens)
        queue = sorted(group, key=lambda r: lengths[r.id], reverse=True)
        while queue:
            longest = lengths[queue[0].id]
            size = largest_batch(
                spec, sizing, budget, longest, new_tokens, job.max_batch, kv_budget
            )
            if size == 0:
                need = batch_memory(spec, sizing, 1, longest, new_tokens)
                yield [_too_large(queue.pop(0), need, budget, kv_budget)], new_tokens
                continue
            batch, queue = queue[:size], queue[size:]
            yield batch, new_tokens


def _record(log: OutputLog, summary: JobSummary, batch: list[Request], result) -> None:
    rows = zip(batch, result.texts, result.token_ids, result.finish_reasons, strict=True)
    for request, text, ids, reason in rows:
        log.append({"id": request.id, "text": text, "tokens": len(ids), "finish_reason": reason})
    summary.batches.append(len(batch))
    summary.completed += len(batch)
    summary.generated_tokens += result.generated_tokens
    summary.peak_kv_bytes = max(summary.peak_kv_bytes, result.peak_kv_bytes)
    summary.ttfts_s.append(result.ttft_s)


def _groups(requests: list[Request], job: BatchJob) -> list[list[Request]]:
    """Requests that can share a batch: the same generation options."""
    groups: dict[tuple, list[Request]] = {}
    for request in requests:
        options = {"max_new_tokens": job.max_new_tokens, **request.options}
        groups.setdefault(tuple(sorted(options.items())), []).append(request)
    return list(groups.values())


def _sampling(options: dict) -> SamplingOptions:
    keys = ("do_sample", "temperature", "top_k", "top_p", "seed")
    return SamplingOptions(**{k: options[k] for k in keys if k in options})


def _too_large(request: Request, need: BatchMemory, budget, kv_budget) -> dict:
    return {
        "id": request.id,
        "text": None,
        "tokens": 0,
        "finish_reason": "did_not_fit",
        "error": (
            f"needs about {need.total} bytes of device memory ({need.kv} of KV) even alone; "
            f"the budget is {budget} bytes (KV budget {kv_budget})"
        ),
    }
