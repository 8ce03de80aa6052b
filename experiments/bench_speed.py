"""Decode speed of KV-cache systems (ALISA configurations, HF's caches), in four ``--mode``s.

    python -m experiments.bench_speed                   # SmolLM2 bf16, batch 16, 2048-token prompts
    python -m experiments.bench_speed --batch 4 --prompt-tokens 512 --new-tokens 16   # quick
    python -m experiments.bench_speed --mode context --model shape:llama-3.2-1b --plot ctx.png
    python -m experiments.bench_speed --mode quant --new-tokens 8
    python -m experiments.bench_speed --mode batch --requests 40 --new-tokens 32

- ``decode`` (targets: SWA r=0.2 >= 2x HF ``DynamicCache``; r=1 within +10 %): each system in its
  own process after a warm-up; decode speed is batch / median step time. ``--rounds N`` alternates
  the systems' order N times (one system's step moves by 20-50 % between processes on a small
  shared CPU: docs/host-speed.md); ``--interleave STEPS`` decodes them in turns in one process
  (:mod:`experiments.interleave`).
- ``context``: every ``--batch`` x ``--prompt-tokens`` cell timed as ``decode``, then host
  retention's cost per context token (:func:`overheads`, :func:`marginal`); ``--plot PATH``.
- ``quant``: INT8/INT4 KV against HF's quantized caches at B = 1 and 2K tokens (HQQ and quanto need
  the ``peers`` extra; a system that cannot run is a row with its error), after the KV bytes per
  stored token at each precision. Their perplexity: ``experiments.run`` (docs/results.md).
- ``batch``: each system runs ``alisa batch`` on ``--requests`` XSum prompts of lengths spread over
  ``--prompt-tokens MIN,MAX`` under one ``--kv-budget``; then the share of identical outputs of
  dense ALISA and ``DynamicCache``.

Every row reads its speed-up against ``DynamicCache`` and against the fastest of HF's three caches
(``hf-dynamic``, ``hf-static``, ``hf-static-compiled``: ``speedup_vs_fastest_hf``, the fair one).
``--model`` is an ``alisa.load_model`` spec or ``shape:NAME`` (:mod:`experiments.shapes`). Every
mode prints its tables, then one JSON line: the settings, :func:`environment` and every row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from alisa.sizes import format_bytes, parse_bytes
from experiments.flags import figure, markdown_table, positive_int, positive_ints
from experiments.systems import HostPair, host_pairs
from experiments.worker import add_prompts_argument, run_in_subprocess

BASELINE = "hf-dynamic"
FULL = "alisa:policy=swa,caching_ratio=1.0"
SPARSE = "alisa:policy=swa,caching_ratio=0.2"
# HF's three caches without quantization: a speed-up is claimed against the fastest of them.
HF_ANCHORS = (BASELINE, "hf-static", "hf-static-compiled")
CONTEXT_SYSTEMS = (
    *HF_ANCHORS,
    FULL,
    SPARSE,
    "alisa:policy=swa,caching_ratio=0.2,retention=host",
    "alisa:policy=swa,caching_ratio=0.1,retention=host",
)
QUANT_SYSTEMS = (
    BASELINE,
    "alisa:kv_bits=8",
    "alisa:kv_bits=8,residual_tokens=0",
    "alisa:kv_bits=4",
    "hf-hqq8",
    "hf-quanto4",
    "hf-fp8",
)
# All-INT8 storage as the paper (no full-precision residual window), against DynamicCache.
BATCH_SYSTEMS = ("alisa:policy=swa,caching_ratio=0.2,kv_bits=8,residual_tokens=0", BASELINE)
SPEED = {"rounds": 1, "in_process": False, "prompts": "text"}  # what the timed modes read
MODES = {
    "decode": {**SPEED, "dtype": "bfloat16", "batch": [16], "prompt_tokens": [2048],
               "new_tokens": 64, "systems": (*HF_ANCHORS, FULL, SPARSE)},
    "context": {**SPEED, "dtype": "float32", "batch": [1, 4], "prompt_tokens": [2048, 4096, 8192],
                "new_tokens": 32, "systems": CONTEXT_SYSTEMS},
    "quant": {**SPEED, "dtype": "float32", "batch": [1], "prompt_tokens": [2048],
              "new_tokens": 32, "systems": QUANT_SYSTEMS},
    "batch": {"dtype": "bfloat16", "batch": [64], "prompt_tokens": [96, 384], "new_tokens": 256,
              "systems": BATCH_SYSTEMS, "requests": 160, "kv_budget": parse_bytes("48MiB"),
              "agreement_prompts": 24, "agreement_tokens": 64, "agreement_dtype": "float32"},
}  # fmt: skip
BENCHMARK = {"decode": "decode_speed", "context": "context_sweep", "quant": "kv_quantization",
             "batch": "batch_job"}  # fmt: skip
# Flags only some modes read: given to another mode they are refused, not silently ignored.
ONLY = {
    **dict.fromkeys(("rounds", "in_process", "interleave", "budget", "prompts", "text"),
                    ("decode", "context", "quant")),
    "plot": ("context",),
    **dict.fromkeys(("requests", "kv_budget", "agreement_prompts", "agreement_tokens",
                     "agreement_dtype"), ("batch",)),
}  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, each mode's defaults filled in; a flag the mode does not read is an error."""
    parser = argparse.ArgumentParser(prog="bench_speed", description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=tuple(MODES), default="decode")
    parser.add_argument("--model", default="smollm2-135m", help="load_model spec, or shape:NAME")
    parser.add_argument("--dtype", help="decode, batch: bfloat16; context, quant: float32")
    parser.add_argument(
        "--batch",
        type=positive_ints,
        help="sequences decoded together (context: a comma list; batch: the largest batch)",
    )
    parser.add_argument(
        "--prompt-tokens",
        type=positive_ints,
        help="prompt length (context: a comma list; batch: MIN,MAX of the prompts' lengths)",
    )
    parser.add_argument("--new-tokens", type=int)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--systems", help="';'-separated system names (see experiments.systems)")
    add_prompts_argument(parser)
    parser.set_defaults(prompts=None)  # "text" unless --mode batch (XSum), which takes no --prompts
    parser.add_argument(
        "--in-process",
        action="store_true",
        default=None,
        help="every system on one model in this process (a large shape on a GPU costs more to "
        "draw than to run); each row's peak is still its own",
    )
    parser.add_argument(
        "--rounds",
        type=positive_int,
        help="run the systems N times, every other round in reverse: a row's median step over "
        "rounds, its speed-up the median of each round's ratio to that round's baseline",
    )
    parser.add_argument(
        "--interleave",
        type=positive_int,
        metavar="STEPS",
        help="a cell's systems in this process, prefilled once each, decoding in turns of STEPS "
        "steps; speed-ups are the median of each turn's ratio to the baseline (no per-row peak)",
    )
    parser.add_argument(
        "--budget",
        type=parse_bytes,
        help="a memory size (40GiB): each row adds the batch its peak, linear in the batch, fits",
    )
    parser.add_argument("--plot", type=Path, help="context: a PNG of step time vs context")
    parser.add_argument("--requests", type=positive_int, help="batch: prompts in the job (160)")
    parser.add_argument("--kv-budget", type=parse_bytes, help="batch: every system's KV (48MiB)")
    parser.add_argument("--agreement-prompts", type=positive_int, help="batch: 24")
    parser.add_argument("--agreement-tokens", type=positive_int, help="batch: 64")
    parser.add_argument("--agreement-dtype", help="batch: and in this dtype (float32)")
    args = parser.parse_args(argv)
    for name, modes in ONLY.items():
        if getattr(args, name) is not None and args.mode not in modes:
            flag = "--" + name.replace("_", "-")
            parser.error(f"{flag} is for --mode {' or '.join(modes)}, not --mode {args.mode}")
    for name, value in MODES[args.mode].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.systems = args.systems.split(";") if isinstance(args.systems, str) else list(args.systems)
    return args


def usage_error(args: argparse.Namespace) -> str | None:
    """Why the run of ``args`` cannot be measured as asked (said before any work), or None."""
    if args.mode != "context" and len(args.batch) > 1:
        return f"--mode {args.mode} takes one --batch; a sweep of several is --mode context"
    if args.mode in ("decode", "quant") and len(args.prompt_tokens) > 1:
        return f"--mode {args.mode} takes one --prompt-tokens; a sweep is --mode context"
    if args.interleave is not None and (args.rounds > 1 or args.budget is not None):
        which = "--rounds" if args.rounds > 1 else "--budget"
        return (
            f"--interleave takes no {which} (one process, one run; no per-system peak to fit a "
            "budget with)"
        )
    if args.interleave is not None and args.new_tokens < 2:
        return f"--new-tokens {args.new_tokens} times no decode step; --interleave needs at least 2"
    from experiments.shapes import check_fits, is_shape

    try:  # a shape unknown or too large for memory, before any worker starts
        if is_shape(args.model):
            check_fits(args.model, args.dtype)
    except ValueError as error:
        return str(error)
    return None


def worker_options(args: argparse.Namespace) -> dict:
    """The worker flags shared by every system of one run (one batch and prompt length)."""
    keys = ("model", "dtype", "batch", "prompt_tokens", "new_tokens", "threads", "data_dir")
    return {key: getattr(args, key) for key in (*keys, "prompts", "text")}


def run_systems(systems: list[str], options: dict, label: str = "") -> list[dict]:
    """One worker row per system, each in its own process (a progress line each on stderr,
    ``label`` first); a system that cannot run here is a row with its error."""
    rows = []
    for system in systems:
        try:
            rows.append(run_in_subprocess(system, options))
        except RuntimeError as error:
            rows.append({"system": system, "error": str(error).strip().splitlines()[-1][:300]})
            print(f"{label}{error}", file=sys.stderr)
            continue
        print(f"{label}{system}: {rows[-1]['decode_tokens_per_s']:.1f} tok/s", file=sys.stderr)
    return rows


def run_in_process(systems: list[str], workload: tuple, new_tokens: int) -> list[dict]:
    """One row per system, all on one loaded ``workload`` (model, tokenizer, prompts); freed
    blocks are returned between systems, so each row's peak is its own."""
    import gc

    import torch

    from experiments.worker import measure_system

    model, tokenizer, prompts = workload
    rows = []
    for system in systems:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        try:
            rows.append(measure_system(model, tokenizer, prompts, system, new_tokens))
        except (torch.OutOfMemoryError, ValueError, RuntimeError) as error:
            # a system that does not fit, or cannot run here, is a row of the table
            rows.append({"system": system, "error": f"{type(error).__name__}: {str(error)[:300]}"})
            print(f"{system}: {rows[-1]['error']}", file=sys.stderr)
            continue
        # each row as it comes: a run cut off by a time limit keeps what it measured
        row = {key: value for key, value in rows[-1].items() if key != "token_ids"}
        print(json.dumps(row), file=sys.stderr)
    return rows


def run_rounds(systems: list[str], args: argparse.Namespace, label: str = "") -> list[list[dict]]:
    """``args.rounds`` lists of rows of one cell in the order of ``systems`` (odd rounds run in
    reverse), each compared with its own round's baseline; with ``--interleave`` one list."""
    from experiments.worker import load_workload

    if args.interleave is not None:
        from experiments.interleave import interleaved_rows

        model, tokenizer, prompts = load_workload(args)
        rows = interleaved_rows(
            model, tokenizer, prompts, systems, args.new_tokens, args.interleave, BASELINE
        )
        compare(rows, BASELINE)
        return [rows]
    workload = load_workload(args) if args.in_process else None
    rounds = []
    for index in range(args.rounds):
        order = systems if index % 2 == 0 else systems[::-1]
        tag = label + (f"round {index + 1}/{args.rounds} " if args.rounds > 1 else "")
        if workload is not None:
            rows = run_in_process(order, workload, args.new_tokens)
        else:
            rows = run_systems(order, worker_options(args), tag)
        compare(rows, BASELINE)
        rounds.append(rows if index % 2 == 0 else rows[::-1])
    return rounds


def merge_rounds(rounds: list[list[dict]]) -> list[dict]:
    """One row per system from its rounds: medians of the step, TTFT and speed-up, the largest
    peak and each round's figures; a system that failed in any round is that error row."""
    merged = []
    for runs in zip(*rounds, strict=True):
        failed = next((row for row in runs if "error" in row), None)
        if failed is not None or len(runs) == 1:
            merged.append(failed or runs[0])
            continue
        steps = [row["median_step_ms"] for row in runs]
        row = {**runs[0], "median_step_ms": statistics.median(steps), "round_step_ms": steps}
        row["decode_tokens_per_s"] = row["batch"] / (row["median_step_ms"] / 1000)
        row["ttft_s"] = statistics.median(run["ttft_s"] for run in runs)
        row["peak_rss_bytes"] = max(run["peak_rss_bytes"] for run in runs)
        if all("speedup_vs_baseline" in run for run in runs):
            speedups = [run["speedup_vs_baseline"] for run in runs]
            row["speedup_vs_baseline"] = statistics.median(speedups)
            row["round_speedups"] = speedups
        merged.append(row)
    return merged


def cells_of(args: argparse.Namespace) -> list[argparse.Namespace]:
    """``args`` of each cell of ``--batch`` x ``--prompt-tokens``: one batch, one prompt length."""
    return [
        argparse.Namespace(**{**vars(args), "batch": batch, "prompt_tokens": context})
        for batch in args.batch
        for context in args.prompt_tokens
    ]


def measure(args: argparse.Namespace) -> list[dict]:
    """Every system's row in every cell, with its ``batch``, ``context`` and, with ``--budget``,
    the batch that would fit it."""
    grid = cells_of(args)
    rows = []
    for cell in grid:
        label = f"B={cell.batch} T={cell.prompt_tokens} " if len(grid) > 1 else ""
        merged = merge_rounds(run_rounds(args.systems, cell, label))
        versus_fastest_hf(merged)
        rows.extend({"batch": cell.batch, **row, "context": cell.prompt_tokens} for row in merged)
    for row in rows:
        if args.budget is not None and "error" not in row:
            row["batch_in_budget"] = fitting_batch(row, args.budget)
    return rows


def fitting_batch(row: dict, budget: int) -> int:
    """The largest batch whose peak fits ``budget`` bytes, were the peak above the weights
    linear in the batch (an estimate from one measured batch)."""
    per_row = (row["peak_rss_bytes"] - row["weight_bytes"]) / row["batch"]
    return max(0, int((budget - row["weight_bytes"]) // per_row)) if per_row > 0 else 0


def compare(rows: list[dict], baseline: str) -> None:
    """Add each row's speed-up over the baseline (unless ``--interleave`` paired it) and how many
    first greedy tokens of every sequence equal the baseline's; drop the token ids."""
    base = next((r for r in rows if r["system"] == baseline and "error" not in r), None)
    for row in rows:
        if base is not None and "error" not in row:
            speedup = row["decode_tokens_per_s"] / base["decode_tokens_per_s"]
            row.setdefault("speedup_vs_baseline", speedup)
            pairs = zip(base["token_ids"], row["token_ids"], strict=True)
            row["greedy_tokens_equal_to_baseline"] = min(_same_prefix(*pair) for pair in pairs)
    for row in rows:
        row.pop("token_ids", None)


def versus_fastest_hf(rows: list[dict]) -> None:
    """Each row's speed-up over the fastest HF cache of its cell (``DynamicCache`` is HF's
    slowest), paired by turn where the systems decoded in turns, else by median step."""
    anchors = [row for row in rows if row["system"].startswith("hf-") and "error" not in row]
    if not anchors:
        return
    fastest = min(anchors, key=lambda row: row["median_step_ms"])
    for row in rows:
        if "error" not in row:
            row["fastest_hf"] = fastest["system"]
            row["speedup_vs_fastest_hf"] = step_ratio(fastest, row)


def step_ratio(over: dict, row: dict) -> float:
    """``over``'s step time over ``row``'s: the median of the turns' ratios where the systems
    decoded in turns (``--interleave``), else the ratio of their median steps."""
    if "turn_step_ms" in row:
        turns = zip(over["turn_step_ms"], row["turn_step_ms"], strict=True)
        return statistics.median(o / r for o, r in turns)
    return over["median_step_ms"] / row["median_step_ms"]


def _same_prefix(first: list[int], second: list[int]) -> int:
    pairs = zip(first, second, strict=False)
    return next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(first), len(second)))


def host_vs_drop(rows: list[dict]) -> dict[str, float]:
    """Each ``retention=host`` row's step over its drop partner's where both ran (issue 26's
    target: at most 1.25), by :func:`step_ratio`."""
    ran = {row["system"]: row for row in rows if "error" not in row}
    return {pair.host: step_ratio(ran[pair.host], ran[pair.drop]) for pair in host_pairs(list(ran))}


def print_table(rows: list[dict]) -> None:
    print(
        "| system | decode tok/s | median step ms | TTFT s | KV MiB | device / host KV vs fp32 "
        "| peak RSS MiB | compile s | speed-up | vs fastest HF |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        if "error" in row:
            print(f"| {row['system']} | {row['error']} | | | | | | | | |")
            continue
        tiers, dense = row["kv_tier_bytes"], row["dense_fp32_kv_bytes"]
        shares = f"{tiers['device'] / dense:.3f} / {tiers.get('host', 0) / dense:.3f}"
        step = f"{row['median_step_ms']:.0f}"
        speedup = "–" if "speedup_vs_baseline" not in row else f"{row['speedup_vs_baseline']:.2f}x"
        if "round_step_ms" in row:  # the rounds' own figures after the median
            step += " (" + ", ".join(f"{value:.0f}" for value in row["round_step_ms"]) + ")"
        peak = "–" if row["peak_rss_bytes"] is None else f"{row['peak_rss_bytes'] / 2**20:.0f}"
        compiled = "–" if row.get("compile_s") is None else f"{row['compile_s']:.1f}"
        fastest = "–" if "fastest_hf" not in row else f"{row['speedup_vs_fastest_hf']:.2f}x"
        if "round_speedups" in row:
            speedup += " (" + ", ".join(f"{value:.2f}" for value in row["round_speedups"]) + ")"
        print(
            f"| {row['system']} | {row['decode_tokens_per_s']:.1f} | {step} | "
            f"{row['ttft_s']:.1f} | {row['kv_bytes'] / 2**20:.1f} | {shares} | "
            f"{peak} | {compiled} | {speedup} | {fastest} |"
        )


def decode(args: argparse.Namespace) -> dict:
    """``--mode decode`` and ``--mode quant`` (which first measures the KV bytes per token)."""
    report = {}
    if args.mode == "quant":
        report["kv_bytes_per_token"] = kv_bytes_per_token(args)
    rows = measure(args)
    paired = host_vs_drop(rows)
    if "kv_bytes_per_token" in report:
        sizes = {key: round(value) for key, value in report["kv_bytes_per_token"].items()}
        print("KV bytes per token (all layers):", json.dumps(sizes))
    print_table(rows)
    for host, ratio in paired.items():
        print(f"host / drop step, {host}: {ratio:.3f}")
    report.update(systems=rows, host_vs_drop_step=paired)
    if args.mode == "decode":
        speed = {row["system"]: row.get("speedup_vs_baseline") for row in rows}
        report["target_swa_r0.2_2x"] = speed.get(SPARSE) is not None and speed[SPARSE] >= 2.0
        report["target_r1_within_10pct"] = speed.get(FULL) is not None and speed[FULL] >= 1 / 1.1
    return report


def kv_bytes_per_token(args: argparse.Namespace) -> dict[str, float]:
    """Measured KV bytes per stored token (all layers) after a 512-token prefill, at 16/8/4 bits
    and at 8/4 bits with 64 recent tokens in full precision (``8bit+r64``)."""
    import torch

    from alisa import AlisaCache, AlisaConfig
    from experiments.shapes import load_benchmark_model

    torch.set_num_threads(args.threads)
    model, _ = load_benchmark_model(args.model, dtype=args.dtype, tokenizer="bytes")
    seed = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, 512), generator=seed)
    result = {}
    for bits, residual in ((16, 0), (8, 0), (4, 0), (8, 64), (4, 64)):
        cache = AlisaCache(model, AlisaConfig(kv_bits=bits, residual_tokens=residual))
        with torch.inference_mode():
            model(input_ids=ids, past_key_values=cache)
        per_slot = cache.kv_bytes() / cache.layers[0].store.capacity
        result[f"{bits}bit" + (f"+r{residual}" if residual else "")] = per_slot
    return result


# --mode context. Per ``retention=host`` system H, its drop partner D and the r = 1 drop system F,
# per cell of batch B and context T: host overhead H - D ms a step and (H - D) / (B * T) per
# context token; dense attention per token (F - D) / (B * T * (1 - r)) (a lower bound: D's
# selection work is in it); their ratio. The marginal table fits lines against B * T per batch
# size: H - D gives a step's fixed cost (intercept) and each further token's (slope), (F - D) /
# (1 - r) dense attention's. Systems without their partners in --systems get no overhead columns.


def context(args: argparse.Namespace) -> dict:
    """``--mode context``: the step table, the overheads, the marginal table and ``--plot``."""
    rows = measure(args)
    fitted = marginal(rows, args.systems)
    print("\n".join(table_lines(rows, args.systems)))
    print("\n".join(["", *marginal_lines(fitted)]))
    if args.plot is not None:
        plot(rows, args.systems, args.plot, title=f"{args.model}, {args.dtype}")
    return {"rows": rows, "cells": summary(rows, args.systems), "marginal": fitted}


def overheads(steps_ms: dict[str, float], batch: int, context: int, pair: HostPair) -> dict:
    """The host overhead and dense-attention estimate of one cell (above); None where a system
    did not run."""
    host, drop = steps_ms.get(pair.host), steps_ms.get(pair.drop)
    full = steps_ms.get(pair.full) if pair.full else None
    tokens = batch * context
    extra = host - drop if host is not None and drop is not None else None
    per_token = extra * 1e6 / tokens if extra is not None else None
    dense = None
    if full is not None and drop is not None and pair.caching_ratio < 1:
        dense = (full - drop) * 1e6 / (tokens * (1 - pair.caching_ratio))
    return {
        "host_minus_drop_ms": extra,
        "host_overhead_ns_per_token": per_token,
        "dense_attention_ns_per_token": dense,
        "overhead_vs_dense": per_token / dense if per_token is not None and dense else None,
    }


def cells(rows: list[dict]) -> dict[tuple[int, int], dict[str, float]]:
    """{(batch, context): {system: median step ms}} of the rows that ran, in their order."""
    out: dict[tuple[int, int], dict[str, float]] = {}
    for row in rows:
        if "error" not in row:
            steps = out.setdefault((row["batch"], row["context"]), {})
            steps[row["system"]] = row["median_step_ms"]
    return out


def summary(rows: list[dict], systems: list[str]) -> list[dict]:
    """One entry per cell: batch, context, and each host system's :func:`overheads`."""
    pairs = host_pairs(systems)
    return [
        {
            "batch": batch,
            "context": context,
            "hosts": {pair.host: overheads(steps, batch, context, pair) for pair in pairs},
        }
        for (batch, context), steps in cells(rows).items()
    ]


def _line(tokens: list[int], values: list[float]) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line through ``values`` against ``tokens``."""
    slope, intercept = np.polyfit(np.asarray(tokens, float), np.asarray(values, float), 1)
    return float(slope), float(intercept)


def marginal(rows: list[dict], systems: list[str]) -> list[dict]:
    """Per batch size with two or more contexts and per host system, the fixed and per-token
    parts of its overhead and dense attention's (above); None where a system did not run."""
    steps = cells(rows)
    out = []
    for batch in sorted({batch for batch, _ in steps}):
        contexts = sorted(context for b, context in steps if b == batch)
        if len(contexts) < 2:
            continue
        tokens = [batch * context for context in contexts]
        runs = [steps[batch, context] for context in contexts]
        hosts = {}
        for pair in host_pairs(systems):
            figures = dict.fromkeys(
                ("fixed_ms", "overhead_ns_per_token", "dense_ns_per_token", "overhead_vs_dense")
            )
            if all(pair.host in run and pair.drop in run for run in runs):
                slope, intercept = _line(tokens, [run[pair.host] - run[pair.drop] for run in runs])
                figures.update(fixed_ms=intercept, overhead_ns_per_token=slope * 1e6)
            if pair.full and pair.caching_ratio < 1 and all(pair.full in run for run in runs):
                saved = [
                    (run[pair.full] - run[pair.drop]) / (1 - pair.caching_ratio) for run in runs
                ]
                figures["dense_ns_per_token"] = _line(tokens, saved)[0] * 1e6
            over, dense = figures["overhead_ns_per_token"], figures["dense_ns_per_token"]
            if over is not None and dense is not None and dense > 0:
                figures["overhead_vs_dense"] = over / dense
            hosts[pair.host] = figures
        out.append({"batch": batch, "contexts": contexts, "hosts": hosts})
    return out


def marginal_lines(entries: list[dict]) -> list[str]:
    """The markdown table of :func:`marginal`'s ``entries``: a row per batch size and host."""
    header = "B|contexts|system|fixed ms a step|ns per further token|dense ns per further token"
    cells = [
        [str(entry["batch"]), ",".join(map(str, entry["contexts"])), host, *_columns(figures)]
        for entry in entries
        for host, figures in entry["hosts"].items()
    ]
    return markdown_table([*header.split("|"), "x dense"], cells)


def _columns(figures: dict[str, float | None]) -> list[str]:
    """A host system's overhead figures as table cells, in their order; ratios to 2 digits."""
    return [figure(value, 2 if key == "overhead_vs_dense" else 1) for key, value in figures.items()]


def table_lines(rows: list[dict], systems: list[str]) -> list[str]:
    """The markdown table: median step ms per system, then per host system its overhead (ms,
    ns per context token), the dense-attention estimate and their ratio."""
    pairs = host_pairs(systems)
    header = ["B", "context", *(f"{system} ms" for system in systems)]
    for pair in pairs:
        r = f"r={pair.caching_ratio:g}"
        header += [f"host-drop {r} ms", f"ns/token {r}", f"dense ns/token {r}", f"x dense {r}"]
    steps, lines = cells(rows), []
    for cell in summary(rows, systems):
        batch, context = cell["batch"], cell["context"]
        values = [str(batch), str(context)]
        values += [figure(steps[batch, context].get(system), 0) for system in systems]
        for pair in pairs:
            values += _columns(cell["hosts"][pair.host])
        lines.append(values)
    return markdown_table(header, lines)


def plot(rows: list[dict], systems: list[str], path: Path, title: str = "") -> None:
    """Median step time vs context, one panel per batch size, one line per system."""
    from experiments.extras import pyplot, save_figure

    plt = pyplot()
    steps = cells(rows)
    batches = sorted({batch for batch, _ in steps})
    figure, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
    for axis, batch in zip(axes[0], batches, strict=True):
        contexts = sorted(context for b, context in steps if b == batch)
        for system in systems:
            points = [(c, steps[batch, c][system]) for c in contexts if system in steps[batch, c]]
            if points:
                axis.plot(*zip(*points, strict=True), marker="o", label=system)
        axis.set_xscale("log", base=2)
        axis.set_xticks(contexts, [str(c) for c in contexts])
        axis.set_xlabel("context (prompt tokens)")
        axis.set_ylabel("median decode step (ms)")
        axis.set_title(f"batch {batch}" + (f", {title}" if title else ""), fontsize=10)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(figure, path, dpi=120)


def batch_jobs(args: argparse.Namespace) -> dict:
    """``--mode batch``: every system's job under one KV budget, then the share of identical
    outputs of dense ALISA and ``DynamicCache`` (the same batches of 8, no budget) in ``--dtype``
    and ``--agreement-dtype``."""
    import tempfile

    import torch

    from experiments.data import build_prompts, data_dir
    from experiments.shapes import load_benchmark_model

    torch.set_num_threads(args.threads)
    model, tokenizer = load_benchmark_model(args.model, dtype=args.dtype)
    weights = sum(p.nbytes for p in model.parameters())
    with tempfile.TemporaryDirectory(prefix="alisa-bench-batch-") as folder:
        work = Path(folder)
        low, high = min(args.prompt_tokens), max(args.prompt_tokens)
        build_prompts(tokenizer, data_dir(args.data_dir), args.requests, low, high, work / "in")
        rows = []
        for index, system in enumerate(args.systems):
            limits = {"max_batch": args.batch[0], "kv_memory": args.kv_budget, "progress": True}
            job = (work / "in", work / f"{index}.jsonl", args.new_tokens)
            rows.append(batch_job(model, tokenizer, system, *job, **limits)[0])
        lines = (work / "in").read_text().splitlines(keepends=True)
        (work / "few").write_text("".join(lines[: args.agreement_prompts]))
        agreement = {}
        for dtype in dict.fromkeys((args.dtype, args.agreement_dtype)):
            if dtype != args.dtype:
                model, _ = load_benchmark_model(args.model, dtype=dtype)
            alisa, hf = (
                batch_job(model, tokenizer, system, work / "few", out, args.agreement_tokens)[1]
                for system, out in (("alisa", work / f"{dtype}-a"), (BASELINE, work / f"{dtype}-b"))
            )
            agreement[dtype] = sum(alisa[key] == hf[key] for key in alisa) / len(alisa)
    print(f"KV budget {format_bytes(args.kv_budget)} for each (weights {format_bytes(weights)})")
    print("| system | tokens/s | batches (largest) | peak KV | peak RSS | speed-up |")
    print("|---|---|---|---|---|---|")
    base = next((row for row in rows if row["system"] == BASELINE), None)
    for row in rows:
        if base is not None:
            row["speedup_vs_baseline"] = row["tokens_per_s"] / base["tokens_per_s"]
        print(
            f"| {row['system']} | {row['tokens_per_s']:.1f} | "
            f"{row['batches']} ({row['largest_batch']}) | {format_bytes(row['peak_kv_bytes'])} | "
            f"{format_bytes(row['peak_rss_bytes'])} | {row.get('speedup_vs_baseline', 0):.2f}x |"
        )
    same = ", ".join(f"{share:.0%} in {dtype}" for dtype, share in agreement.items())
    print(
        f"dense ALISA vs DynamicCache identical outputs ({args.agreement_prompts} prompts x "
        f"{args.agreement_tokens} tokens): {same}"
    )
    return {"weights_bytes": weights, "systems": rows, "r1_agreement": agreement}


def batch_job(
    model, tokenizer, system: str, source: Path, output: Path, new_tokens: int, **limits
) -> tuple[dict, dict]:
    """(row, {id: text}) of one system's ``alisa batch`` job, every prompt generating
    ``new_tokens`` (equal work); ``limits``: ``max_batch`` (8), ``kv_memory``, ``progress``."""
    from alisa import AlisaConfig, BatchJob, run_batch
    from alisa.jsonl import read_jsonl
    from experiments.systems import make_cache

    _, config = make_cache(system, model)  # an unknown name is refused here
    job = BatchJob(
        input=str(source),
        output=str(output),
        config=config or AlisaConfig(),
        max_new_tokens=new_tokens,
        stop_at_eos=False,
        **{"max_batch": 8, "progress": False, **limits},
    )
    factory = None if config is not None else lambda: make_cache(system, model)[0]
    summary = run_batch(model, tokenizer, job, cache_factory=factory)
    if limits.get("progress"):
        print(f"{system}: {summary.describe()}", file=sys.stderr)
    row = {
        "system": system,
        "tokens_per_s": summary.tokens_per_s,
        "seconds": summary.seconds,
        "batches": len(summary.batches),
        # continuous batching runs no fixed batches: its largest is the most rows run together
        "largest_batch": max(summary.batches, default=summary.max_rows),
        "generated_tokens": summary.generated_tokens,
        "peak_kv_bytes": summary.peak_kv_bytes,
        "peak_rss_bytes": summary.peak_memory_bytes,
        "did_not_fit": len(summary.did_not_fit),
    }
    return row, {line["id"]: line["text"] for line in read_jsonl(output)}


RUN = {"decode": decode, "context": context, "quant": decode, "batch": batch_jobs}


def main(argv=None) -> int:
    args = parse_args(argv)
    error = usage_error(args)
    if error is not None:
        print(f"bench_speed: error: {error}", file=sys.stderr)
        return 2
    try:
        report = RUN[args.mode](args)
    except ValueError as error:  # an unknown system, a missing data file: named, no traceback
        print(f"bench_speed: error: {error}", file=sys.stderr)
        return 1
    settings = {k: v for k, v in vars(args).items() if args.mode in ONLY.get(k, (args.mode,))}
    if args.plot is not None:
        settings["plot"] = str(args.plot)
    from experiments.timing import environment  # torch: loaded only once the workers ran

    benchmark = {"benchmark": BENCHMARK[args.mode], **settings, **environment(args.threads)}
    print(json.dumps({**benchmark, **report}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
