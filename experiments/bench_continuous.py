"""Continuous batching under one KV byte budget: alisa continuous vs static vs transformers.

    python -m experiments.bench_continuous --plot docs/figures/continuous_batching.png
    python -m experiments.bench_continuous --prompts 16 --systems continuous-drop,hf   # quick

One workload for every system: XSum articles (H2O's 0-shot prompts, read from the data
directory) asked for a one-sentence summary in SmolLM2's chat template, prompts of mixed lengths
(up to ``--max-prompt-tokens``), each answer stopping at EOS or at its own ``max_new_tokens``
drawn (seeded) from ``--new-tokens``. Greedy decoding everywhere. The same KV byte budget for
every system: alisa sizes its rows by it (``alisa batch --kv-memory``), transformers' paged
cache gets ``num_blocks`` worth of it. One process runs the systems one after another, each
after a short warm-up; ``--repeats`` runs them all again, interleaved, and reports medians.

Systems (``--systems``):
    static-drop, continuous-drop        ``alisa batch --static`` vs ``alisa batch``, SWA r=0.2
    static-host, continuous-host        the same with retention="host"
    continuous-drop-separate,           continuous, each newcomer prefilled in a forward of its
    continuous-host-separate            own (``alisa batch --separate-prefills``), not inside
                                        the running rows' decode step
    continuous-dense                    ``alisa batch`` at r = 1 (every token kept)
    continuous-drop-reserve,            the same, admitting rows with room for ``--reserve-
    continuous-host-reserve,            tokens`` new tokens; rows that outgrow it are paused
    continuous-dense-reserve
    hf                                  transformers 5.23's continuous batching, sdpa, paged KV

Prints a table (generated tokens/s, TTFT p50/p95 from the start, rows in flight, KV, ROUGE-L of
the summaries), then one JSON line; ``--plot PATH`` draws rows in flight and tokens/s over time
(``--plot-systems`` picks the lines). Seconds in which the process was stopped from outside (a
``SIGSTOP`` from another benchmark's quiet wrapper, a suspended VM) are left out of every time
(:class:`experiments.pauses.PauseWatch`); the table says how many.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from alisa import AlisaConfig, BatchJob, load_model, run_batch
from alisa.model.loading import chat_prompt
from alisa.runtime.requests import PREFILL_TOKENS
from alisa.sizes import format_bytes, parse_bytes
from experiments.data import data_dir, data_file, read_jsonl
from experiments.hf_continuous import run_paged
from experiments.pauses import PauseWatch
from experiments.timeline import Timeline, plot_timelines

SPARSE = {"policy": "swa", "caching_ratio": 0.2}


@dataclass(frozen=True, kw_only=True)
class System:
    """One way to run the workload: alisa's batch job (``config``), or transformers (None)."""

    name: str
    config: AlisaConfig | None
    static: bool = False
    reserve: bool = False  # admit rows with room for --reserve-tokens only
    mixed: bool = True  # newcomers prefilled inside the running rows' decode step


def systems(names: list[str]) -> list[System]:
    """The systems named (see the module docstring), or a ``ValueError`` listing them."""
    host = {**SPARSE, "retention": "host"}
    table = {
        "static-drop": {"config": AlisaConfig(**SPARSE), "static": True},
        "continuous-drop": {"config": AlisaConfig(**SPARSE)},
        "static-host": {"config": AlisaConfig(**host), "static": True},
        "continuous-host": {"config": AlisaConfig(**host)},
        "continuous-drop-separate": {"config": AlisaConfig(**SPARSE), "mixed": False},
        "continuous-host-separate": {"config": AlisaConfig(**host), "mixed": False},
        "continuous-dense": {"config": AlisaConfig()},
        "continuous-drop-reserve": {"config": AlisaConfig(**SPARSE), "reserve": True},
        "continuous-host-reserve": {"config": AlisaConfig(**host), "reserve": True},
        "continuous-dense-reserve": {"config": AlisaConfig(), "reserve": True},
        "hf": {"config": None},
    }
    if names == ["all"]:
        names = list(table)
    unknown = [name for name in names if name not in table]
    if unknown:
        raise ValueError(f"--systems {','.join(unknown)} unknown; valid: {', '.join(table)}")
    return [System(name=name, **table[name]) for name in names]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--data-dir", default=None, help="holds xsum/h2o_xsum_0shot.jsonl")
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", default="16,32,64,128,256", help="max_new_tokens drawn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-budget", default="160MiB", help="KV byte budget of every system")
    parser.add_argument("--max-rows", type=int, default=64, help="rows at most, every system")
    parser.add_argument("--reserve-tokens", type=int, default=32)
    parser.add_argument(
        "--prefill-tokens",
        type=int,
        default=PREFILL_TOKENS,
        help="alisa continuous: padded prompt tokens per prefill forward at most (0: no bound)",
    )
    parser.add_argument("--page-size", type=int, default=16, help="transformers' page (tokens)")
    parser.add_argument("--max-batch-tokens", type=int, default=1024, help="transformers' M")
    parser.add_argument("--systems", default="all", help="comma-separated names, or all")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--plot", default=None, help="PNG of rows in flight and tokens/s")
    parser.add_argument(
        "--plot-systems", default=None, help="comma-separated systems to plot (default: all run)"
    )
    return parser.parse_args(argv)


@dataclass(frozen=True, kw_only=True)
class Workload:
    """The requests every system runs, in submission order."""

    texts: list[str]  # prompts in the chat template
    prompt_ids: list[list[int]]
    new_tokens: list[int]
    references: list[str]  # XSum's reference summaries


def build_workload(tokenizer, root: Path, args: argparse.Namespace) -> Workload:
    """The first ``--prompts`` XSum articles whose chat prompt fits ``--max-prompt-tokens``."""
    choices = [int(value) for value in args.new_tokens.split(",")]
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


@dataclass(kw_only=True)
class Run:
    """One system's pass over the workload."""

    texts: list[str]
    seconds: float
    generated_tokens: int
    ttfts_s: list[float]
    timeline: Timeline
    peak_kv_bytes: int
    preemptions: int = 0
    errors: int = 0
    paused_s: float = 0.0  # seconds this process was stopped from outside, left out above


def run_alisa(
    model, tokenizer, system: System, workload: Workload, args, folder: Path, watch: PauseWatch
) -> Run:
    """The workload as an ``alisa batch`` job (``--static`` or continuous); times without the
    stops ``watch`` saw."""
    source, target = folder / f"{system.name}.in.jsonl", folder / f"{system.name}.out.jsonl"
    target.unlink(missing_ok=True)
    rows = zip(workload.texts, workload.new_tokens, strict=True)
    source.write_text(
        "".join(
            json.dumps({"id": index, "prompt": text, "max_new_tokens": count}) + "\n"
            for index, (text, count) in enumerate(rows)
        )
    )
    job = BatchJob(
        input=str(source),
        output=str(target),
        config=system.config,
        kv_memory=parse_bytes(args.kv_budget),
        max_new_tokens=max(workload.new_tokens),
        max_batch=args.max_rows,
        progress=False,
        static=system.static,
        reserve_tokens=args.reserve_tokens if system.reserve else None,
        prefill_tokens=args.prefill_tokens or None,
        mixed_forwards=system.mixed,
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
    )


def run_hf(model, tokenizer, workload: Workload, args, watch: PauseWatch) -> Run:
    """The workload through transformers' continuous batching (sdpa, paged KV); times without
    the stops ``watch`` saw."""
    eos = model.generation_config.eos_token_id
    paged = run_paged(
        model,
        workload.prompt_ids,
        workload.new_tokens,
        kv_bytes=parse_bytes(args.kv_budget),
        eos_ids=[eos] if isinstance(eos, int) else list(eos),
        page_size=args.page_size,
        max_batch_tokens=args.max_batch_tokens,
        max_rows=args.max_rows,
    )
    start, end = paged.started_s, paged.started_s + paged.seconds
    firsts = [(times or [start])[0] for times in paged.token_times]
    return Run(
        texts=[tokenizer.decode(ids, skip_special_tokens=True) for ids in paged.tokens],
        seconds=watch.active(start, end),
        generated_tokens=sum(len(ids) for ids in paged.tokens),
        ttfts_s=[watch.active(start, first) for first in firsts],
        timeline=Timeline.from_tokens(start, paged.token_times).excluding(watch.paused),
        peak_kv_bytes=paged.kv_bytes,
        preemptions=paged.preemptions,
        errors=len(paged.errors),
        paused_s=watch.paused(start, end),
    )


def rouge_l(texts: list[str], references: list[str]) -> float:
    """Mean ROUGE-L F of the summaries' first lines against XSum's references."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    scores = [
        scorer.score(reference, text.strip().split("\n")[0])["rougeL"].fmeasure
        for text, reference in zip(texts, references, strict=True)
    ]
    return sum(scores) / len(scores)


def metrics(system: System, runs: list[Run], workload: Workload) -> dict:
    """One table row: medians over the repeats, quality from the first run."""
    rates = [run.generated_tokens / run.seconds for run in runs]
    first = runs[0]
    return {
        "system": system.name,
        "tokens_per_s": statistics.median(rates),
        "tokens_per_s_runs": rates,
        "seconds": statistics.median(run.seconds for run in runs),
        "generated_tokens": first.generated_tokens,
        "ttft_p50_s": statistics.median(float(np.percentile(r.ttfts_s, 50)) for r in runs),
        "ttft_p95_s": statistics.median(float(np.percentile(r.ttfts_s, 95)) for r in runs),
        "max_rows": max(run.timeline.max_rows() for run in runs),
        "mean_rows": statistics.median(run.timeline.mean_rows() for run in runs),
        "peak_kv_bytes": max(run.peak_kv_bytes for run in runs),
        "preemptions": first.preemptions,
        "errors": first.errors,
        "paused_s": sum(run.paused_s for run in runs),
        "rouge_l": rouge_l(first.texts, workload.references),
    }


def warm_up(
    model, tokenizer, system: System, workload: Workload, args, folder: Path, watch: PauseWatch
) -> None:
    """A few short requests through the same path (first-call costs stay out of the timing)."""
    small = Workload(
        texts=workload.texts[:4],
        prompt_ids=workload.prompt_ids[:4],
        new_tokens=[8] * 4,
        references=workload.references[:4],
    )
    if system.config is None:
        run_hf(model, tokenizer, small, args, watch)
    else:
        run_alisa(model, tokenizer, system, small, args, folder, watch)


def print_table(rows: list[dict], args) -> None:
    paused = sum(row["paused_s"] for row in rows)
    print(
        f"KV budget {args.kv_budget} for every system; greedy; {args.dtype}; medians of "
        f"{args.repeats} run(s); {paused:.0f} s this process was stopped from outside, left out"
    )
    print(
        "| system | tokens/s | TTFT p50 / p95 (s) | rows in flight max / mean | peak KV | "
        "pauses | ROUGE-L |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['system']} | {row['tokens_per_s']:.1f} | {row['ttft_p50_s']:.1f} / "
            f"{row['ttft_p95_s']:.1f} | {row['max_rows']} / {row['mean_rows']:.1f} | "
            f"{format_bytes(row['peak_kv_bytes'])} | {row['preemptions']} | "
            f"{row['rouge_l']:.3f} |"
        )


def ratios(rows: list[dict]) -> dict:
    """The issue's targets, where both sides ran."""
    by = {row["system"]: row for row in rows}

    def ratio(key: str, top: str, bottom: str) -> float | None:
        if top not in by or bottom not in by or not by[bottom][key]:
            return None
        return by[top][key] / by[bottom][key]

    return {
        "continuous_vs_static_drop": ratio("tokens_per_s", "continuous-drop", "static-drop"),
        "continuous_vs_static_host": ratio("tokens_per_s", "continuous-host", "static-host"),
        "reserve_vs_static_drop": ratio("tokens_per_s", "continuous-drop-reserve", "static-drop"),
        "reserve_vs_static_host": ratio("tokens_per_s", "continuous-host-reserve", "static-host"),
        "mixed_vs_separate_drop": ratio(
            "tokens_per_s", "continuous-drop", "continuous-drop-separate"
        ),
        "mixed_vs_separate_host": ratio(
            "tokens_per_s", "continuous-host", "continuous-host-separate"
        ),
        "r0.2_vs_hf": ratio("tokens_per_s", "continuous-drop", "hf"),
        "r0.2_reserve_vs_hf": ratio("tokens_per_s", "continuous-drop-reserve", "hf"),
        "r1_vs_hf": ratio("tokens_per_s", "continuous-dense", "hf"),
        "r1_reserve_vs_hf": ratio("tokens_per_s", "continuous-dense-reserve", "hf"),
        "rows_r0.2_vs_dense": ratio("max_rows", "continuous-drop", "continuous-dense"),
        "ttft_p95_continuous_vs_static_drop": ratio("ttft_p95_s", "continuous-drop", "static-drop"),
        "ttft_p95_continuous_vs_static_host": ratio("ttft_p95_s", "continuous-host", "static-host"),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        chosen = systems(args.systems.split(","))
        plotted = [system.name for system in systems((args.plot_systems or "all").split(","))]
        if not args.plot_systems:
            plotted = [system.name for system in chosen]
        if missing := [name for name in plotted if name not in {s.name for s in chosen}]:
            raise ValueError(f"--plot-systems {','.join(missing)}: not among --systems")
        root = data_dir(args.data_dir)
        torch.set_num_threads(args.threads)
        model, tokenizer = load_model(args.model, dtype=args.dtype)
        workload = build_workload(tokenizer, root, args)
    except ValueError as error:
        print(f"bench_continuous: error: {error}", file=sys.stderr)
        return 1
    paged_model = None
    if any(system.config is None for system in chosen):
        # Its own copy: transformers' continuous batching switches the model's attention.
        paged_model, _ = load_model(args.model, dtype=args.dtype, attn_implementation="sdpa")
    runs: dict[str, list[Run]] = {system.name: [] for system in chosen}
    temporary = tempfile.TemporaryDirectory(prefix="alisa-bench-cb-")
    with temporary as folder, PauseWatch() as watch:
        for repeat in range(args.repeats):
            for system in chosen:
                target = paged_model if system.config is None else model
                if repeat == 0:
                    warm_up(target, tokenizer, system, workload, args, Path(folder), watch)
                if system.config is None:
                    run = run_hf(target, tokenizer, workload, args, watch)
                else:
                    run = run_alisa(target, tokenizer, system, workload, args, Path(folder), watch)
                runs[system.name].append(run)
                rate = run.generated_tokens / run.seconds
                print(f"[{repeat + 1}] {system.name}: {rate:.1f} tok/s", file=sys.stderr)
    rows = [metrics(system, runs[system.name], workload) for system in chosen]
    if args.plot:
        plot_timelines({name: runs[name][0].timeline for name in plotted}, args.plot)
    print_table(rows, args)
    report = {
        "benchmark": "continuous_batching",
        "model": args.model,
        "dtype": args.dtype,
        "decoding": "greedy",
        "alisa_sparse": "policy=swa caching_ratio=0.2 preset=default",
        "kv_budget_bytes": parse_bytes(args.kv_budget),
        "prompts": args.prompts,
        "prompt_tokens": [len(ids) for ids in workload.prompt_ids],
        "new_tokens_choices": args.new_tokens,
        "seed": args.seed,
        "reserve_tokens": args.reserve_tokens,
        "prefill_tokens": args.prefill_tokens,
        "page_size": args.page_size,
        "max_batch_tokens": args.max_batch_tokens,
        "max_rows": args.max_rows,
        "repeats": args.repeats,
        "threads": args.threads,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "systems": rows,
        "ratios": ratios(rows),
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
