"""Decode speed of the ALISA cache vs HF ``DynamicCache`` (targets: SWA r=0.2 >= 2x; r=1 <= +10 %).

    python -m experiments.bench_speed                   # SmolLM2 bf16, batch 16, 2048-token prompts
    python -m experiments.bench_speed --batch 4 --prompt-tokens 512 --new-tokens 16   # quick
    python -m experiments.bench_speed --model shape:llama-3.2-1b --dtype float32 --batch 1

``--model`` is an ``alisa.load_model`` spec or ``shape:NAME`` (``shape:llama-3.2-1b``,
``shape:llama-3.1-8b``, ``shape:smollm2-135m``): a random-weight Llama of that model's dimensions
(:mod:`experiments.shapes`), refused up front when its weights exceed the free memory.

Each system runs in its own process (same environment; allocator settings are reported) after a
warm-up; decode speed is batch / median step time. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

from experiments.worker import run_in_subprocess

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
    return parser.parse_args(argv)


def worker_options(args: argparse.Namespace) -> dict:
    """The worker flags shared by every system of one run."""
    keys = ("model", "dtype", "batch", "prompt_tokens", "new_tokens", "threads", "data_dir")
    return {key: getattr(args, key) for key in keys}


def run_systems(systems: list[str], options: dict, label: str = "") -> list[dict]:
    """One worker row per system (each in its own process), a progress line per system on
    stderr (``label`` first, e.g. the batch and prompt length of a sweep's cell)."""
    rows = []
    for system in systems:
        rows.append(run_in_subprocess(system, options))
        print(f"{label}{system}: {rows[-1]['decode_tokens_per_s']:.1f} tok/s", file=sys.stderr)
    return rows


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
    base = next((r for r in rows if r["system"] == baseline), None)
    for row in rows:
        if base:
            row["speedup_vs_baseline"] = row["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        row.pop("token_ids", None)


def print_table(rows: list[dict]) -> None:
    print(
        "| system | decode tok/s | median step ms | TTFT s | KV MiB | device / host KV vs fp32 "
        "| peak RSS MiB | speed-up |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        tiers, dense = row["kv_tier_bytes"], row["dense_fp32_kv_bytes"]
        shares = f"{tiers['device'] / dense:.3f} / {tiers.get('host', 0) / dense:.3f}"
        print(
            f"| {row['system']} | {row['decode_tokens_per_s']:.1f} | {row['median_step_ms']:.0f} | "
            f"{row['ttft_s']:.1f} | {row['kv_bytes'] / 2**20:.1f} | {shares} | "
            f"{row['peak_rss_bytes'] / 2**20:.0f} | {row.get('speedup_vs_baseline', 0):.2f}x |"
        )


def environment(args: argparse.Namespace) -> dict:
    """What a reader needs to reproduce the figures."""
    import torch
    import transformers

    return {
        "cpu": platform.processor() or platform.machine(),
        "threads": args.threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "allocator_env": {key: os.environ.get(key) for key in ALLOCATOR_ENV},
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    error = check_model(args.model, args.dtype)
    if error is not None:
        print(f"bench_speed: error: {error}", file=sys.stderr)
        return 2
    rows = run_systems(args.systems.split(";"), worker_options(args))
    compare(rows, BASELINE)
    speed = {row["system"]: row.get("speedup_vs_baseline") for row in rows}
    report = {
        "benchmark": "decode_speed",
        **worker_options(args),
        **environment(args),
        "systems": rows,
        "target_swa_r0.2_2x": speed.get(SPARSE) is not None and speed[SPARSE] >= 2.0,
        "target_r1_within_10pct": speed.get(FULL) is not None and speed[FULL] >= 1 / 1.1,
    }
    print_table(rows)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
