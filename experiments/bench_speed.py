"""Decode speed of the ALISA cache vs HF ``DynamicCache`` (targets: SWA r=0.2 >= 2x; r=1 <= +10 %).

    python -m experiments.bench_speed                   # SmolLM2 bf16, batch 16, 2048-token prompts
    python -m experiments.bench_speed --batch 4 --prompt-tokens 512 --new-tokens 16   # quick

Each system runs in its own process (same environment, allocator settings printed), after a
warm-up generate; decode speed is batch / median step time. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

SYSTEMS = {
    "dynamic": None,  # HF DynamicCache through the same decode loop
    "alisa-r1": {"policy": "swa", "caching_ratio": 1.0},
    "alisa-swa-r0.2": {"policy": "swa", "caching_ratio": 0.2},
}
ALLOCATOR_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def prompts_of_length(tokenizer, root, tokens: int, count: int) -> list[str]:
    """``count`` different WikiText-2 windows of exactly ``tokens`` tokens each."""
    from experiments.data import load_wikitext2

    ids = tokenizer(load_wikitext2(root))["input_ids"]
    stride = max(1, (len(ids) - tokens) // count)
    texts = [tokenizer.decode(ids[i * stride : i * stride + tokens]) for i in range(count)]
    # Decoding and re-encoding can shift a few tokens; trim to the exact length.
    return [tokenizer.decode(tokenizer(t)["input_ids"][:tokens]) for t in texts]


def run_worker(args: argparse.Namespace) -> dict:
    """Time one system in this process; returns its figures."""
    import torch
    from transformers import DynamicCache

    from alisa import AlisaConfig, generate, load_model
    from experiments.data import data_dir

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    prompts = prompts_of_length(tokenizer, data_dir(args.data_dir), args.prompt_tokens, args.batch)
    options = SYSTEMS[args.worker]
    config = AlisaConfig(**options) if options else None

    def run(batch_prompts, new_tokens):
        cache = DynamicCache() if options is None else None
        return generate(
            model,
            tokenizer,
            batch_prompts,
            config,
            max_new_tokens=new_tokens,
            past_key_values=cache,
        )

    run([p[: len(p) // 8] for p in prompts], 4)  # warm-up: kernels, allocator, caches
    result = run(prompts, args.new_tokens)
    median_step = statistics.median(result.step_times_s)
    return {
        "system": args.worker,
        "decode_tokens_per_s": args.batch / median_step,
        "median_step_ms": median_step * 1000,
        "ttft_s": result.ttft_s,
        "kv_bytes": result.kv_bytes,
        "peak_kv_bytes": result.peak_kv_bytes,
        "peak_rss_bytes": result.peak_memory_bytes,
        "generated_tokens": result.generated_tokens,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(args)))
        return 0
    rows = []
    for system in args.systems.split(","):
        command = [sys.executable, "-m", "experiments.bench_speed", "--worker", system]
        command += _forwarded(argv if argv is not None else sys.argv[1:])
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            print(done.stderr, file=sys.stderr)
            return done.returncode
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"{system}: {rows[-1]['decode_tokens_per_s']:.1f} tok/s", file=sys.stderr)
    report = summarize(args, rows)
    print_table(rows)
    print(json.dumps(report))
    return 0


def _forwarded(argv: list[str]) -> list[str]:
    skip = {"--systems"}
    out, drop_next = [], False
    for item in argv:
        if drop_next:
            drop_next = False
            continue
        if item in skip:
            drop_next = True
            continue
        if any(item.startswith(flag + "=") for flag in skip):
            continue
        out.append(item)
    return out


def summarize(args, rows: list[dict]) -> dict:
    by_system = {row["system"]: row for row in rows}
    dynamic = by_system.get("dynamic")
    report = {
        "benchmark": "decode_speed",
        "model": args.model,
        "dtype": args.dtype,
        "batch": args.batch,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "threads": args.threads,
        "cpu": platform.processor() or platform.machine(),
        "allocator_env": {k: os.environ.get(k) for k in ALLOCATOR_ENV},
        "systems": rows,
    }
    if dynamic:
        for row in rows:
            row["speedup_vs_dynamic"] = row["decode_tokens_per_s"] / dynamic["decode_tokens_per_s"]
        if "alisa-swa-r0.2" in by_system:
            report["target_swa_2x"] = by_system["alisa-swa-r0.2"]["speedup_vs_dynamic"] >= 2.0
        if "alisa-r1" in by_system:
            report["target_r1_within_10pct"] = (
                by_system["alisa-r1"]["speedup_vs_dynamic"] >= 1 / 1.1
            )
    return report


def print_table(rows: list[dict]) -> None:
    print(
        "| system | decode tok/s | median step ms | TTFT s | KV MiB | peak RSS MiB | vs dynamic |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['system']} | {row['decode_tokens_per_s']:.1f} | {row['median_step_ms']:.0f} | "
            f"{row['ttft_s']:.1f} | {row['kv_bytes'] / 2**20:.0f} | "
            f"{row['peak_rss_bytes'] / 2**20:.0f} | "
            f"{row.get('speedup_vs_dynamic', float('nan')):.2f}x |"
        )


if __name__ == "__main__":
    sys.exit(main())
