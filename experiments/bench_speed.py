"""Decode speed of the ALISA cache vs HF ``DynamicCache`` (targets: SWA r=0.2 >= 2x; r=1 <= +10 %).

    python -m experiments.bench_speed                   # SmolLM2 bf16, batch 16, 2048-token prompts
    python -m experiments.bench_speed --batch 4 --prompt-tokens 512 --new-tokens 16   # quick
    python -m experiments.bench_speed --model shape:llama-3.2-1b --dtype float32 --batch 1

``--model`` is an ``alisa.load_model`` spec or ``shape:NAME`` (``shape:llama-3.2-1b``,
``shape:llama-3.1-8b``, ``shape:smollm2-135m``): a random-weight Llama of that model's dimensions
(:mod:`experiments.shapes`), refused up front when its weights exceed the free memory.

Each system runs in its own process (same environment; allocator settings are reported) after a
warm-up; decode speed is batch / median step time. Prints a table, then one JSON line.

``--rounds N`` runs the systems N times, every other round in reverse order, so that a drift of
the machine's speed falls on every system alike: a row gives the median of its rounds' step times,
its speed-up the median of the rounds' paired ratios (the baseline measured in the same round).
On a small shared CPU the same system's step moves by 20-50 % between processes
(docs/host-speed.md, stop 49), more than the differences a target asks about.

``--interleave STEPS`` runs every system in this process instead, each prefilled once, then
decoding in turns of STEPS steps (:mod:`experiments.interleave`): the systems share every minute
of the run, so a ratio between them is read within minutes, not across a quarter of an hour.
Each ``retention=host`` row's step over its drop partner's (the same configuration, dropping) is
printed after the table and in the JSON line (``host_vs_drop_step``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from alisa.sizes import parse_bytes
from experiments.worker import add_prompts_argument, run_in_subprocess

BASELINE = "hf-dynamic"
FULL = "alisa:policy=swa,caching_ratio=1.0"
SPARSE = "alisa:policy=swa,caching_ratio=0.2"
ALLOCATOR_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="smollm2-135m", help="alisa.load_model spec, or shape:NAME"
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument(
        "--systems",
        default=";".join((BASELINE, FULL, SPARSE)),
        help="';'-separated system names (see experiments.systems)",
    )
    add_prompts_argument(parser)
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run every system in this process on one model (a large shape on a GPU, whose "
        "weights cost more to draw per system than the run itself); peaks are reset per system",
    )
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        help="run the systems this many times, every other round in reverse order; rows give "
        "medians over rounds, speed-ups the median of each round's ratio to the baseline",
    )
    parser.add_argument(
        "--interleave",
        type=positive_int,
        default=None,
        metavar="STEPS",
        help="run every system in this process, prefilled once each, decoding in turns of STEPS "
        "steps (experiments.interleave): a drift of the machine falls on every system alike; "
        "speed-ups are the median of each turn's ratio to the baseline (no per-system peak)",
    )
    parser.add_argument(
        "--budget",
        type=parse_bytes,
        default=None,
        help="a device memory size (40GiB): each row also gives the largest batch whose "
        "measured peak, scaled linearly in the batch, fits it",
    )
    return parser.parse_args(argv)


def positive_int(text: str) -> int:
    """``"3"`` -> 3; anything else is an argparse error naming the value."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def worker_options(args: argparse.Namespace) -> dict:
    """The worker flags shared by every system of one run."""
    keys = (
        "model",
        "dtype",
        "batch",
        "prompt_tokens",
        "new_tokens",
        "threads",
        "data_dir",
        "prompts",
        "text",
    )
    return {key: getattr(args, key) for key in keys}


def run_systems(systems: list[str], options: dict, label: str = "") -> list[dict]:
    """One worker row per system (each in its own process), a progress line per system on
    stderr (``label`` first, e.g. the batch and prompt length of a sweep's cell)."""
    rows = []
    for system in systems:
        rows.append(run_in_subprocess(system, options))
        print(f"{label}{system}: {rows[-1]['decode_tokens_per_s']:.1f} tok/s", file=sys.stderr)
    return rows


def run_in_process(systems: list[str], workload: tuple, new_tokens: int) -> list[dict]:
    """One row per system, all on one loaded ``workload`` (model, tokenizer, prompts); each
    row's peak is its own (the device's peak statistics are reset, and freed blocks returned,
    between systems)."""
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


def interleave_error(args: argparse.Namespace) -> str | None:
    """Why ``--interleave`` cannot time the run of ``args`` (under 2 new tokens: no decode
    step to time), or None."""
    if args.interleave is not None and args.new_tokens < 2:
        return f"--new-tokens {args.new_tokens} times no decode step; --interleave needs at least 2"
    return None


def run_rounds(systems: list[str], args: argparse.Namespace) -> list[list[dict]]:
    """``args.rounds`` lists of rows, each in the order of ``systems`` (odd rounds run in
    reverse), each row with its speed-up against the baseline of its own round. In process,
    the model is loaded once for every round; with ``--interleave`` one list, the systems'
    turns in one process (:func:`experiments.interleave.interleaved_rows`)."""
    if args.interleave is not None:
        from experiments.interleave import interleaved_rows
        from experiments.worker import load_workload

        model, tokenizer, prompts = load_workload(args)
        rows = interleaved_rows(
            model, tokenizer, prompts, systems, args.new_tokens, args.interleave, BASELINE
        )
        for row in rows:
            row.pop("token_ids")
        return [rows]
    workload = None
    if args.in_process:
        from experiments.worker import load_workload

        workload = load_workload(args)
    rounds = []
    for index in range(args.rounds):
        order = systems if index % 2 == 0 else systems[::-1]
        label = f"round {index + 1}/{args.rounds} " if args.rounds > 1 else ""
        if workload is not None:
            rows = run_in_process(order, workload, args.new_tokens)
        else:
            rows = run_systems(order, worker_options(args), label)
        compare(rows, BASELINE)
        rounds.append(rows if index % 2 == 0 else rows[::-1])
    return rounds


def merge_rounds(rounds: list[list[dict]]) -> list[dict]:
    """One row per system from its rounds (lists of rows in the same order): the first round's
    row with the median step time (and the decode speed it gives), the median time to first
    token, the largest peak, the median of the rounds' speed-ups and each round's figures. A
    system that failed in any round is that round's error row."""
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


def fitting_batch(row: dict, budget: int) -> int:
    """The largest batch whose peak fits ``budget`` bytes, were the run's peak above the
    weights linear in the batch (KV and activations per row; an estimate from one measured
    batch)."""
    per_row = (row["peak_rss_bytes"] - row["weight_bytes"]) / row["batch"]
    return max(0, int((budget - row["weight_bytes"]) // per_row)) if per_row > 0 else 0


def check_model(spec: str, dtype: str) -> str | None:
    """Why ``--model`` cannot run (a shape unknown or too large for memory), or None: said
    before any worker starts."""
    from experiments.shapes import check_fits, is_shape

    if not is_shape(spec):
        return None
    try:
        check_fits(spec, dtype)
    except ValueError as error:
        return str(error)
    return None


def compare(rows: list[dict], baseline: str) -> None:
    """Add each row's speed relative to the baseline row."""
    base = next((r for r in rows if r["system"] == baseline and "error" not in r), None)
    for row in rows:
        if "error" in row:
            continue
        if base:
            row["speedup_vs_baseline"] = row["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        row.pop("token_ids", None)


def host_vs_drop(rows: list[dict]) -> dict[str, float]:
    """Each ``retention=host`` row's step over its drop partner's (same configuration, dropping;
    issue 26's target is at most 1.25), where both ran: with ``--interleave`` the median of the
    turns' ratios, else the ratio of the medians."""
    from experiments.systems import host_pairs

    ran = {row["system"]: row for row in rows if "error" not in row}
    ratios = {}
    for pair in host_pairs(list(ran)):
        host, drop = ran[pair.host], ran[pair.drop]
        if "turn_step_ms" in host:
            turns = zip(host["turn_step_ms"], drop["turn_step_ms"], strict=True)
            ratios[pair.host] = statistics.median(h / d for h, d in turns)
        else:
            ratios[pair.host] = host["median_step_ms"] / drop["median_step_ms"]
    return ratios


def print_table(rows: list[dict]) -> None:
    print(
        "| system | decode tok/s | median step ms | TTFT s | KV MiB | device / host KV vs fp32 "
        "| peak RSS MiB | speed-up |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        if "error" in row:
            print(f"| {row['system']} | {row['error']} | | | | | | |")
            continue
        tiers, dense = row["kv_tier_bytes"], row["dense_fp32_kv_bytes"]
        shares = f"{tiers['device'] / dense:.3f} / {tiers.get('host', 0) / dense:.3f}"
        step = f"{row['median_step_ms']:.0f}"
        speedup = f"{row.get('speedup_vs_baseline', 0):.2f}x"
        if "round_step_ms" in row:  # the rounds' own figures after the median
            step += " (" + ", ".join(f"{value:.0f}" for value in row["round_step_ms"]) + ")"
        peak = "–" if row["peak_rss_bytes"] is None else f"{row['peak_rss_bytes'] / 2**20:.0f}"
        if "round_speedups" in row:
            speedup += " (" + ", ".join(f"{value:.2f}" for value in row["round_speedups"]) + ")"
        print(
            f"| {row['system']} | {row['decode_tokens_per_s']:.1f} | {step} | "
            f"{row['ttft_s']:.1f} | {row['kv_bytes'] / 2**20:.1f} | {shares} | "
            f"{peak} | {speedup} |"
        )


def environment(args: argparse.Namespace) -> dict:
    """What a reader needs to reproduce the figures: the machine, its kernels, the versions."""
    import torch

    from alisa.record import machine_record

    record = machine_record()
    return {
        **record,
        "cuda": torch.version.cuda if record["gpu"] else None,
        "threads": args.threads,
        "allocator_env": {key: os.environ.get(key) for key in ALLOCATOR_ENV},
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.interleave is not None and (args.rounds > 1 or args.budget is not None):
        which = "--rounds" if args.rounds > 1 else "--budget"
        print(
            f"bench_speed: error: --interleave takes no {which} (one process, one run; "
            "no per-system peak to fit a budget with)",
            file=sys.stderr,
        )
        return 2
    error = interleave_error(args) or check_model(args.model, args.dtype)
    if error is not None:
        print(f"bench_speed: error: {error}", file=sys.stderr)
        return 2
    rows = merge_rounds(run_rounds(args.systems.split(";"), args))
    if args.budget is not None:
        for row in rows:
            if "error" not in row:
                row["batch_in_budget"] = fitting_batch(row, args.budget)
    speed = {row["system"]: row.get("speedup_vs_baseline") for row in rows}
    paired = host_vs_drop(rows)
    report = {
        "benchmark": "decode_speed",
        **worker_options(args),
        "in_process": args.in_process,
        "rounds": args.rounds,
        "interleave": args.interleave,
        "budget_bytes": args.budget,
        **environment(args),
        "systems": rows,
        "host_vs_drop_step": paired,
        "target_swa_r0.2_2x": speed.get(SPARSE) is not None and speed[SPARSE] >= 2.0,
        "target_r1_within_10pct": speed.get(FULL) is not None and speed[FULL] >= 1 / 1.1,
    }
    print_table(rows)
    for host, ratio in paired.items():
        print(f"host / drop step, {host}: {ratio:.3f}")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
