"""Fidelity of the scheduler's cost model on this machine: predicted vs measured decode steps.

    python -m experiments.bench_cost_model            # SmolLM2 bf16, batch 8, 1024-token prompts

Measures a hardware profile (as ``alisa profile``), then runs the tiered cache with all KV
resident, about half offloaded to the host pool, and about half recomputed; for each, the
placement actually used is costed with ``scheduler.evaluate`` and compared with the median
measured step. Target: within 20 %. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from alisa import AlisaCache, AlisaConfig, generate, load_model
from alisa.architecture import model_shape
from alisa.planning import model_spec
from alisa.profiling import half_offload_budget, measure
from experiments.data import data_dir, load_wikitext2
from experiments.worker import prompts_of_length
from scheduler import Workload, evaluate


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--data-dir", default=None)
    return parser.parse_args(argv)


def placement(cache: AlisaCache) -> dict[str, float]:
    """Fractions of the stored tokens per tier, as the cache really placed them."""
    counts = cache.tier_tokens()
    total = max(1, sum(counts.values()))
    return {
        "g": counts["device"] / total,
        "c": counts["host"] / total,
        "x": counts["recompute"] / total,
        "w": 0.0,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    profile = measure(model)
    spec = model_spec(model, model_shape(model), name=args.model)
    prompts = prompts_of_length(
        tokenizer, load_wikitext2(data_dir(args.data_dir)), args.prompt_tokens, args.batch
    )
    half = half_offload_budget(spec, args.batch, args.prompt_tokens + args.new_tokens)
    configs = {
        "resident": AlisaConfig(),
        "half on host": AlisaConfig(gpu_memory=half, recompute="never"),
        "half recomputed": AlisaConfig(gpu_memory=half, recompute="always"),
    }
    generate(model, tokenizer, [p[:200] for p in prompts], max_new_tokens=4)  # warm-up
    rows = []
    for name, config in configs.items():
        cache = AlisaCache(model, config, max_new_tokens=args.new_tokens)
        result = generate(
            model, tokenizer, prompts, max_new_tokens=args.new_tokens, past_key_values=cache
        )
        measured = statistics.median(result.step_times_s)
        used = placement(cache)
        workload = Workload(
            batch=args.batch, prompt_len=args.prompt_tokens, gen_len=args.new_tokens
        )
        plan = evaluate(profile, spec, workload, used, buckets=1)
        predicted = plan.decode_s / args.new_tokens
        rows.append(
            {
                "config": name,
                "placement": used,
                "measured_step_ms": 1000 * measured,
                "predicted_step_ms": 1000 * predicted,
                "error": predicted / measured - 1,
            }
        )
        print(
            f"{name}: measured {1000 * measured:.1f} ms, predicted {1000 * predicted:.1f} ms",
            file=sys.stderr,
        )
    print("| configuration | device / host / recompute | measured ms | predicted ms | error |")
    print("|---|---|---|---|---|")
    for row in rows:
        p = row["placement"]
        print(
            f"| {row['config']} | {p['g']:.2f} / {p['c']:.2f} / {p['x']:.2f} | "
            f"{row['measured_step_ms']:.1f} | {row['predicted_step_ms']:.1f} | "
            f"{100 * row['error']:+.1f} % |"
        )
    report = {
        "benchmark": "cost_model_fidelity",
        "model": args.model,
        "dtype": args.dtype,
        "batch": args.batch,
        "prompt_tokens": args.prompt_tokens,
        "profile": profile.__dict__,
        "rows": rows,
        "target_within_20pct": all(abs(r["error"]) <= 0.2 for r in rows),
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
