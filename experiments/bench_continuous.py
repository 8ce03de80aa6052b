"""Continuous batching under one KV byte budget: alisa continuous vs static vs transformers.

    python -m experiments.bench_continuous --plot docs/figures/continuous_batching.png
    python -m experiments.bench_continuous --prompts 16 --systems continuous-drop,hf   # quick

One workload for every system (:func:`build_workload`): XSum articles asked for a one-sentence
summary in the model's chat template, each answer stopping at EOS or at its own ``max_new_tokens``
drawn (seeded) from ``--new-tokens``; greedy. One KV byte budget for every system (``alisa batch
--kv-memory``; transformers' paged ``num_blocks``). The systems run one after another in one
process, each after a short warm-up; ``--repeats`` runs them all again and reports medians.

Systems (``--systems``):
    static-drop, continuous-drop        ``alisa batch --static`` vs ``alisa batch``, SWA r=0.2
    static-host, continuous-host        the same with retention="host"
    continuous-drop-separate,           continuous, each newcomer prefilled in a forward of its
    continuous-host-separate            own (``--separate-prefills``), not in the decode step
    continuous-dense                    ``alisa batch`` at r = 1 (every token kept)
    continuous-drop-reserve, -host-     the same, admitting rows with room for ``--reserve-
    reserve, continuous-dense-reserve   tokens`` new tokens; rows that outgrow it are paused
    hf                                  transformers 5.23's continuous batching (the engine
                                        behind ``generate_batch``), sdpa, paged KV
Named only (not in ``all``):
    static-dense                        ``alisa batch --static`` at r = 1
    static-drop-compiled,               ``--static --compile on``: decode steps compiled, each
    static-dense-compiled               batch's cache sized to a capacity bucket, finished
                                        rows kept in their batch (one graph per batch size
                                        and bucket; ``--new-tokens 64`` keeps one group)
    continuous-drop-compiled,           ``--compile on``: continuous batching's decode steps
    continuous-dense-compiled           compiled, one graph per bucket of rows (1, 2, 4, ...)

Prints a table, then one JSON line with :func:`experiments.timing.environment`; ``--plot PATH``
draws rows in flight and tokens/s over time (``--plot-systems`` picks the lines). Seconds the
process was stopped from outside are left out (:class:`experiments.timeline.PauseWatch`).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from alisa import AlisaConfig, BatchJob, load_model, run_batch
from alisa.model.loading import chat_prompt, resolve_dtype
from alisa.runtime.requests import PREFILL_TOKENS
from alisa.sizes import format_bytes, parse_budget
from experiments.data import data_dir, data_file, read_jsonl
from experiments.flags import positive_ints
from experiments.timeline import PauseWatch, Timeline, plot_timelines
from experiments.timing import environment

SPARSE = {"policy": "swa", "caching_ratio": 0.2}
CACHES = {"drop": SPARSE, "host": {**SPARSE, "retention": "host"}, "dense": {}}
SYSTEMS = (
    *("static-drop", "continuous-drop", "static-host", "continuous-host"),
    *("continuous-drop-separate", "continuous-host-separate", "continuous-dense"),
    *("continuous-drop-reserve", "continuous-host-reserve", "continuous-dense-reserve", "hf"),
)
# Named only, not in "all": compiling takes minutes on a CPU, and the default workload's drawn
# answer lengths split static batches into many shapes.
NAMED_ONLY = (
    *("static-dense", "static-drop-compiled", "static-dense-compiled"),
    *("continuous-drop-compiled", "continuous-dense-compiled"),
)


def workload_parser(*, prompts: int, systems: str) -> argparse.ArgumentParser:
    """The flags of the workload, the KV budget and transformers' paging that this benchmark
    and :mod:`experiments.bench_serve` share (a parent parser)."""
    parser = argparse.ArgumentParser(add_help=False)
    add = parser.add_argument
    add("--model", default="smollm2-135m", help="as alisa.load_model (alisa serve --model)")
    add("--dtype", default="float32")
    add("--data-dir", default=None, help="holds xsum/h2o_xsum_0shot.jsonl")
    add("--prompts", type=int, default=prompts, help="XSum prompts (requests)")
    add("--max-prompt-tokens", type=int, default=512)
    add("--seed", type=int, default=0, help="of the drawn lengths and arrival times")
    add("--kv-budget", default="160MiB", help="KV byte budget of every system")
    add("--max-rows", type=int, default=64, help="rows at most, every system")
    add("--page-size", type=int, default=16, help="transformers' page (tokens)")
    add("--max-batch-tokens", type=int, default=1024, help="transformers' M")
    add("--systems", default=systems, help="comma-separated names, or all")
    add("--threads", type=int, default=2, help="torch threads (bench_serve: of each server)")
    return parser


def check_workload(args: argparse.Namespace, *counts: str) -> None:
    """A ``ValueError`` naming the first shared flag (or one of ``counts``) out of range."""
    shared = ("prompts", "max_prompt_tokens", "max_rows", "page_size", "max_batch_tokens")
    for name in (*shared, "threads", *counts):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    try:
        resolve_dtype(args.dtype)
    except ValueError as error:
        raise ValueError(f"--dtype {args.dtype!r}: {error}") from None
    parse_budget(args.kv_budget, field="--kv-budget")


def choose(
    names: str, valid: tuple[str, ...], flag: str = "--systems", named_only: tuple[str, ...] = ()
) -> list[str]:
    """The systems ``flag`` names (comma-separated, or ``all``: every one of ``valid``; those of
    ``named_only`` only by name), or a ``ValueError`` listing the valid names."""
    chosen = list(valid) if names == "all" else names.split(",")
    if unknown := [name for name in chosen if name not in (*valid, *named_only)]:
        listed = ", ".join((*valid, *named_only))
        raise ValueError(f"{flag} {','.join(unknown)} unknown; valid: {listed}")
    return chosen


def ratios(rows: list[dict], wanted: dict[str, tuple[str, str, str]]) -> dict:
    """``{name: (key, top, bottom)}`` -> system ``top``'s ``key`` over ``bottom``'s, None where
    either did not run or has no value."""
    by = {row["system"]: row for row in rows if "error" not in row}
    return {
        name: by[top][key] / by[bottom][key]
        if top in by and bottom in by and by[top][key] is not None and by[bottom][key]
        else None
        for name, (key, top, bottom) in wanted.items()
    }


@dataclass(frozen=True, kw_only=True)
class Workload:
    """The requests every system runs, in submission order."""

    texts: list[str]  # prompts in the chat template
    prompt_ids: list[list[int]]
    new_tokens: list[int]
    references: list[str]  # XSum's reference summaries

    def head(self, count: int, new_tokens: int) -> Workload:
        """The first ``count`` requests, each asking ``new_tokens`` (a warm-up)."""
        texts = self.texts[:count]
        return Workload(
            texts=texts,
            prompt_ids=self.prompt_ids[:count],
            new_tokens=[new_tokens] * len(texts),
            references=self.references[:count],
        )


def build_workload(tokenizer, root: Path, args: argparse.Namespace, choices: list[int]) -> Workload:
    """The first ``--prompts`` XSum articles whose chat prompt fits ``--max-prompt-tokens``, each
    with a ``max_new_tokens`` drawn from ``choices`` (seeded by ``--seed``)."""
    texts, ids, references = [], [], []
    for row in read_jsonl(data_file(root, "xsum/h2o_xsum_0shot.jsonl")):
        text = chat_prompt(tokenizer, row["article"].strip())
        encoded = tokenizer(text)["input_ids"]
        if len(encoded) <= args.max_prompt_tokens:
            texts.append(text)
            ids.append(list(encoded))
            references.append(row["summary_gt"])
        if len(texts) == args.prompts:
            break
    if len(texts) < args.prompts:
        raise ValueError(
            f"--prompts {args.prompts}: only {len(texts)} XSum prompts fit --max-prompt-tokens "
            f"{args.max_prompt_tokens}"
        )
    draws = np.random.default_rng(args.seed).choice(choices, size=len(texts)).tolist()
    return Workload(texts=texts, prompt_ids=ids, new_tokens=draws, references=references)


def block_bytes(config, dtype: torch.dtype, page_size: int) -> int:
    """Bytes of one transformers paged-cache block: ``page_size`` tokens of K and V in every
    layer of a model with this config in ``dtype``."""
    from transformers.generation.continuous_batching.cache_allocators.full_attention import (
        FullAttentionCacheAllocator,
    )

    heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    page = FullAttentionCacheAllocator.get_bytes_per_page(heads, head_dim, dtype, page_size)
    return config.num_hidden_layers * page


@dataclass(kw_only=True)
class PagedRun:
    """One run of transformers' continuous batching: per request (workload order) its generated
    ids (EOS included) and their ``time.perf_counter()`` times (a request soft reset keeps only
    those after its reset); when the requests were submitted and the seconds until the last
    finished; the paged cache's bytes; requests offloaded (preempted); requests that came back
    with ``error`` set (transformers does not raise)."""

    tokens: list[list[int]]
    token_times: list[list[float]]
    started_s: float
    seconds: float
    kv_bytes: int
    preemptions: int = 0
    errors: list[str] = field(default_factory=list)


def run_paged(
    model,
    prompt_ids: list[list[int]],
    new_tokens: list[int],
    *,
    kv_bytes: int,
    eos_ids: list[int],
    page_size: int = 16,
    max_batch_tokens: int = 1024,
    max_rows: int = 64,
) -> PagedRun:
    """Greedy completions of ``prompt_ids`` (each up to its ``new_tokens``, stopping at EOS)
    by transformers' continuous batching with a paged cache of at most ``kv_bytes``.

    Requests go to the engine behind ``generate_batch`` (which takes one ``max_new_tokens``
    for all), each with its own. The model must use sdpa (or eager) attention; CUDA graphs,
    async batching, flash switching and prefix sharing are off, as on CPU they do not apply.
    """
    from transformers import ContinuousBatchingConfig, GenerationConfig

    block = block_bytes(model.config, model.dtype, page_size)
    if (blocks := kv_bytes // block) < 1:
        raise ValueError(f"kv_bytes={kv_bytes} holds no block of {page_size} tokens")
    paged = ContinuousBatchingConfig(
        num_blocks=blocks,
        page_size=page_size,
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_rows,
        allow_block_sharing=False,
        auto_switch_to_flash=False,
        use_cuda_graph=False,
        use_async_batching=False,
        scheduler_type="fifo",
    )
    generation = GenerationConfig(
        do_sample=False, max_new_tokens=max(new_tokens), eos_token_id=eos_ids
    )
    with (
        counting_offloads() as offloads,
        model.continuous_batching_context_manager(
            generation_config=generation, continuous_batching_config=paged, warmup=False, timeout=60
        ) as manager,
    ):
        started = time.perf_counter()
        names = [
            manager.add_request(ids, f"r{index}", max_new_tokens=count, record_timestamps=True)
            for index, (ids, count) in enumerate(zip(prompt_ids, new_tokens, strict=True))
        ]
        results = {}
        while len(results) < len(names):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching stopped before finishing")
        seconds = time.perf_counter() - started
    ordered = [results[name] for name in names]
    return PagedRun(
        tokens=[list(r.generated_tokens) for r in ordered],
        token_times=[list(r.timestamps or []) for r in ordered],
        started_s=started,
        seconds=seconds,
        kv_bytes=blocks * block,
        preemptions=sum(offloads),
        errors=[f"{r.request_id}: {r.error}" for r in ordered if r.error is not None],
    )


@contextmanager
def counting_offloads() -> Iterator[list[int]]:
    """The requests transformers' continuous batching logs meanwhile as offloaded (preempted:
    "Offloaded 2 requests ..."), its INFO lines counted, not printed."""
    logger, counts = logging.getLogger("ContinuousBatchingLogger"), []

    def count(record: logging.LogRecord) -> bool:
        words = record.getMessage().split()
        if len(words) > 1 and words[0] == "Offloaded" and words[1].isdigit():
            counts.append(int(words[1]))
        return record.levelno > logging.INFO

    level = logger.level
    logger.addFilter(count)
    logger.setLevel(logging.INFO)  # the line is logged at INFO only
    try:
        yield counts
    finally:
        logger.removeFilter(count)
        logger.setLevel(level)


@dataclass(frozen=True, kw_only=True)
class System:
    """One way to run the workload: alisa's batch job (``config``), or transformers (None)."""

    name: str
    config: AlisaConfig | None
    static: bool = False
    reserve: bool = False  # admit rows with room for --reserve-tokens only
    mixed: bool = True  # newcomers prefilled inside the running rows' decode step
    compiled: bool = False  # decode steps through torch.compile


def systems(names: str) -> list[System]:
    """The systems named (see the module docstring), or a ``ValueError`` listing them."""
    chosen = []
    for name in choose(names, SYSTEMS, named_only=NAMED_ONLY):
        if name == "hf":
            chosen.append(System(name=name, config=None))
            continue
        kind, cache, *rest = name.split("-")
        config = AlisaConfig(**CACHES[cache])
        mixed, reserve = "separate" not in rest, "reserve" in rest
        chosen.append(
            System(
                name=name,
                config=config,
                static=kind == "static",
                reserve=reserve,
                mixed=mixed,
                compiled="compiled" in rest,
            )
        )
    return chosen


@dataclass(kw_only=True)
class Run:
    """One system's pass over the workload (times without this process's stops)."""

    texts: list[str]
    seconds: float
    generated_tokens: int
    ttfts_s: list[float]
    timeline: Timeline
    peak_kv_bytes: int
    preemptions: int = 0
    errors: int = 0
    paused_s: float = 0.0  # seconds this process was stopped from outside, left out above
    compile_s: float = 0.0  # seconds of the first compiled steps (included in seconds)


def run_alisa(model, tokenizer, system: System, workload: Workload, args, folder, watch) -> Run:
    """The workload as an ``alisa batch`` job (``--static`` or continuous)."""
    source, target = folder / f"{system.name}.in.jsonl", folder / f"{system.name}.out.jsonl"
    target.unlink(missing_ok=True)
    rows = enumerate(zip(workload.texts, workload.new_tokens, strict=True))
    with source.open("w") as handle:
        for index, (text, count) in rows:
            print(json.dumps({"id": index, "prompt": text, "max_new_tokens": count}), file=handle)
    job = BatchJob(
        input=str(source),
        output=str(target),
        config=system.config,
        kv_memory=parse_budget(args.kv_budget, field="--kv-budget"),
        max_new_tokens=max(workload.new_tokens),
        max_batch=args.max_rows,
        progress=False,
        static=system.static,
        reserve_tokens=args.reserve_tokens if system.reserve else None,
        prefill_tokens=args.prefill_tokens or None,
        mixed_forwards=system.mixed,
        compile="on" if system.compiled else "off",
    )
    timeline = Timeline(time.perf_counter())
    summary = run_batch(model, tokenizer, job, on_step=timeline.add)
    end = time.perf_counter()
    start = timeline.started_s = end - summary.seconds  # the job's own clock
    texts = {row["id"]: row["text"] for row in read_jsonl(target)}
    return Run(
        texts=[texts.get(index, "") for index in range(len(workload.texts))],
        seconds=watch.active(start, end),
        generated_tokens=summary.generated_tokens,
        ttfts_s=[watch.active(start, start + ttft) for ttft in summary.ttfts_s],
        timeline=timeline.excluding(watch.paused),
        peak_kv_bytes=summary.peak_kv_bytes,
        preemptions=summary.preemptions,
        errors=len(summary.failed),
        paused_s=watch.paused(start, end),
        compile_s=summary.compile_s,
    )


def run_hf(model, tokenizer, workload: Workload, args, watch) -> Run:
    """The workload through transformers' continuous batching (sdpa, paged KV)."""
    eos = model.generation_config.eos_token_id
    paged = run_paged(
        model,
        workload.prompt_ids,
        workload.new_tokens,
        kv_bytes=parse_budget(args.kv_budget, field="--kv-budget"),
        eos_ids=[eos] if isinstance(eos, int) else list(eos),
        page_size=args.page_size,
        max_batch_tokens=args.max_batch_tokens,
        max_rows=args.max_rows,
    )
    start, end = paged.started_s, paged.started_s + paged.seconds
    return Run(
        texts=[tokenizer.decode(ids, skip_special_tokens=True) for ids in paged.tokens],
        seconds=watch.active(start, end),
        generated_tokens=sum(len(ids) for ids in paged.tokens),
        ttfts_s=[watch.active(start, (times or [start])[0]) for times in paged.token_times],
        timeline=Timeline.from_tokens(start, paged.token_times).excluding(watch.paused),
        peak_kv_bytes=paged.kv_bytes,
        preemptions=paged.preemptions,
        errors=len(paged.errors),
        paused_s=watch.paused(start, end),
    )


def run_system(model, tokenizer, system: System, workload: Workload, args, folder, watch) -> Run:
    """One pass of the workload by ``system`` (times without the stops ``watch`` saw)."""
    if system.config is None:
        return run_hf(model, tokenizer, workload, args, watch)
    return run_alisa(model, tokenizer, system, workload, args, folder, watch)


def rouge_l(texts: list[str], references: list[str]) -> float:
    """Mean ROUGE-L F of the summaries' first lines against XSum's references."""
    from experiments.extras import bench_module

    scorer = bench_module("rouge_score.rouge_scorer").RougeScorer(["rougeL"], use_stemmer=True)
    pairs = zip(texts, references, strict=True)
    return statistics.mean(
        scorer.score(reference, text.strip().split("\n")[0])["rougeL"].fmeasure
        for text, reference in pairs
    )


def metrics(name: str, runs: list[Run], workload: Workload) -> dict:
    """One table row: medians over the repeats, quality from the first run."""
    rates = [run.generated_tokens / run.seconds for run in runs]
    first = runs[0]

    def median(value) -> float:
        return statistics.median(value(run) for run in runs)

    return {
        "system": name,
        "tokens_per_s": statistics.median(rates),
        "tokens_per_s_runs": rates,
        "seconds": median(lambda run: run.seconds),
        "generated_tokens": first.generated_tokens,
        "ttft_p50_s": median(lambda run: float(np.percentile(run.ttfts_s, 50))),
        "ttft_p95_s": median(lambda run: float(np.percentile(run.ttfts_s, 95))),
        "max_rows": max(run.timeline.max_rows() for run in runs),
        "mean_rows": median(lambda run: run.timeline.mean_rows()),
        "peak_kv_bytes": max(run.peak_kv_bytes for run in runs),
        "preemptions": first.preemptions,
        "errors": first.errors,
        "paused_s": sum(run.paused_s for run in runs),
        "compile_s": first.compile_s,
        "rouge_l": rouge_l(first.texts, workload.references),
    }


RATIOS = {
    "continuous_vs_static_drop": ("tokens_per_s", "continuous-drop", "static-drop"),
    "continuous_vs_static_host": ("tokens_per_s", "continuous-host", "static-host"),
    "reserve_vs_static_drop": ("tokens_per_s", "continuous-drop-reserve", "static-drop"),
    "reserve_vs_static_host": ("tokens_per_s", "continuous-host-reserve", "static-host"),
    "mixed_vs_separate_drop": ("tokens_per_s", "continuous-drop", "continuous-drop-separate"),
    "mixed_vs_separate_host": ("tokens_per_s", "continuous-host", "continuous-host-separate"),
    "r0.2_vs_hf": ("tokens_per_s", "continuous-drop", "hf"),
    "r0.2_reserve_vs_hf": ("tokens_per_s", "continuous-drop-reserve", "hf"),
    "r1_vs_hf": ("tokens_per_s", "continuous-dense", "hf"),
    "r1_reserve_vs_hf": ("tokens_per_s", "continuous-dense-reserve", "hf"),
    "rows_r0.2_vs_dense": ("max_rows", "continuous-drop", "continuous-dense"),
    "ttft_p95_continuous_vs_static_drop": ("ttft_p95_s", "continuous-drop", "static-drop"),
    "ttft_p95_continuous_vs_static_host": ("ttft_p95_s", "continuous-host", "static-host"),
    "compiled_vs_eager_static_drop": ("tokens_per_s", "static-drop-compiled", "static-drop"),
    "compiled_vs_eager_static_dense": ("tokens_per_s", "static-dense-compiled", "static-dense"),
    "compiled_vs_eager_continuous_drop": (
        *("tokens_per_s", "continuous-drop-compiled", "continuous-drop"),
    ),
}


def print_table(rows: list[dict], args) -> None:
    paused = sum(row["paused_s"] for row in rows)
    print(
        f"KV budget {args.kv_budget} for every system; greedy; {args.dtype}; medians of "
        f"{args.repeats} run(s); {paused:.0f} s this process was stopped from outside, left out"
    )
    print(
        "| system | tokens/s | TTFT p50 / p95 (s) | rows in flight max / mean | peak KV | "
        "pauses | compile s | ROUGE-L |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        compiled = f"{row['compile_s']:.1f}" if row["compile_s"] else "–"
        print(
            f"| {row['system']} | {row['tokens_per_s']:.1f} | {row['ttft_p50_s']:.1f} / "
            f"{row['ttft_p95_s']:.1f} | {row['max_rows']} / {row['mean_rows']:.1f} | "
            f"{format_bytes(row['peak_kv_bytes'])} | {row['preemptions']} | {compiled} | "
            f"{row['rouge_l']:.3f} |"
        )


def parse_args(argv=None) -> argparse.Namespace:
    parents = [workload_parser(prompts=128, systems="all")]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], parents=parents)
    add = parser.add_argument
    add("--new-tokens", type=positive_ints, default="16,32,64,128,256", help="drawn max_new_tokens")
    add("--reserve-tokens", type=int, default=32)
    add(
        "--prefill-tokens",
        type=int,
        default=PREFILL_TOKENS,
        help="alisa continuous: padded prompt tokens per prefill forward at most (0: no bound)",
    )
    add("--repeats", type=int, default=1)
    add("--plot", default=None, help="PNG of rows in flight and tokens/s")
    add("--plot-systems", default=None, help="comma-separated systems to plot (default: all run)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        check_workload(args, "repeats", "reserve_tokens")
        chosen = systems(args.systems)
        plotted = [system.name for system in chosen]
        if args.plot_systems:
            plotted = choose(
                args.plot_systems, SYSTEMS, flag="--plot-systems", named_only=NAMED_ONLY
            )
        if missing := [name for name in plotted if name not in {s.name for s in chosen}]:
            raise ValueError(f"--plot-systems {','.join(missing)}: not among --systems")
        root = data_dir(args.data_dir)
        torch.set_num_threads(args.threads)
        alisa_model, tokenizer = load_model(args.model, dtype=args.dtype)
        workload = build_workload(tokenizer, root, args, args.new_tokens)
    except ValueError as error:
        print(f"bench_continuous: error: {error}", file=sys.stderr)
        return 1

    paged_model = None
    if any(system.config is None for system in chosen):
        # Its own copy: transformers' continuous batching switches the model's attention.
        paged_model, _ = load_model(args.model, dtype=args.dtype, attn_implementation="sdpa")
    runs: dict[str, list[Run]] = {system.name: [] for system in chosen}
    with tempfile.TemporaryDirectory(prefix="alisa-bench-cb-") as scratch, PauseWatch() as watch:
        folder = Path(scratch)
        for repeat in range(args.repeats):
            for system in chosen:
                model = paged_model if system.config is None else alisa_model
                if repeat == 0:  # a few short requests first: first-call costs stay out
                    run_system(model, tokenizer, system, workload.head(4, 8), args, folder, watch)
                run = run_system(model, tokenizer, system, workload, args, folder, watch)
                runs[system.name].append(run)
                rate = run.generated_tokens / run.seconds
                print(f"[{repeat + 1}] {system.name}: {rate:.1f} tok/s", file=sys.stderr)
    rows = [metrics(name, done, workload) for name, done in runs.items()]
    if args.plot:
        plot_timelines({name: runs[name][0].timeline for name in plotted}, args.plot)
    print_table(rows, args)
    keys = ("prompts", "seed", "reserve_tokens", "prefill_tokens", "page_size", "max_batch_tokens")
    report = {
        "benchmark": "continuous_batching",
        "model": args.model,
        "dtype": args.dtype,
        "decoding": "greedy",
        "alisa_sparse": "policy=swa caching_ratio=0.2 preset=default",
        "kv_budget_bytes": parse_budget(args.kv_budget, field="--kv-budget"),
        "prompt_tokens": [len(ids) for ids in workload.prompt_ids],
        "new_tokens_choices": args.new_tokens,
        **{key: getattr(args, key) for key in (*keys, "max_rows", "repeats", "threads")},
        "machine": environment(args.threads),
        "systems": rows,
        "ratios": ratios(rows, RATIOS),
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
