"""Batch jobs under one KV budget: ALISA (SWA r=0.2 + INT8) vs HF DynamicCache batched to fit.

    python -m experiments.bench_batch                    # 160 XSum prompts, SmolLM2 bf16
    python -m experiments.bench_batch --prompts 40 --new-tokens 32    # quick look

Both systems run the same ``alisa batch`` machinery (budget-sized batches, longest first) under
the same ``kv_memory``: every batch's KV cache must fit the same bytes; only the cache differs.
Reports generated tokens/s, batches, peak KV bytes and resident memory, and the output agreement
of the dense ALISA cache with DynamicCache. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from transformers import DynamicCache

from alisa import AlisaConfig, BatchJob, load_model, run_batch
from alisa.sizes import format_bytes, parse_bytes
from experiments.data import data_dir, data_file, read_jsonl


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--prompts", type=int, default=160)
    parser.add_argument("--min-tokens", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--kv-budget", default="48MiB", help="KV byte budget of both systems")
    parser.add_argument("--agreement-prompts", type=int, default=24)
    parser.add_argument("--agreement-tokens", type=int, default=64)
    parser.add_argument(
        "--agreement-dtype",
        default="float32",
        help="also check r = 1 agreement in this dtype (bf16 kernels round differently)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--preset", default="default", choices=("default", "paper"), help="AlisaConfig preset"
    )
    return parser.parse_args(argv)


def build_prompts(tokenizer, root: Path, count: int, low: int, high: int, path: Path) -> None:
    """XSum articles cut to lengths spread evenly over [low, high] tokens, as job input."""
    rows = read_jsonl(data_file(root, "xsum/h2o_xsum_0shot.jsonl"))
    with path.open("w") as handle:
        for index in range(count):
            article = rows[index % len(rows)]["article"]
            ids = tokenizer(article)["input_ids"]
            length = low + (high - low) * index // max(1, count - 1)
            prompt = tokenizer.decode(ids[:length]) + "\nSummary:"
            handle.write(json.dumps({"id": index, "prompt": prompt}) + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    weights = sum(p.nbytes for p in model.parameters())
    work = Path(tempfile.mkdtemp(prefix="alisa-bench-batch-"))
    source = work / "prompts.jsonl"
    build_prompts(
        tokenizer, data_dir(args.data_dir), args.prompts, args.min_tokens, args.max_tokens, source
    )
    # The same KV byte budget for both systems (what ALISA's comparison fixes).
    kv_budget = parse_bytes(args.kv_budget)
    systems = {
        # All-INT8 storage as the paper (no full-precision residual window).
        "alisa swa r=0.2 int8": (
            AlisaConfig(
                policy="swa",
                caching_ratio=0.2,
                kv_bits=8,
                residual_tokens=0,
                preset=args.preset,
            ),
            None,
        ),
        "hf DynamicCache": (AlisaConfig(), DynamicCache),
    }
    rows = []
    for name, (config, factory) in systems.items():
        job = BatchJob(
            input=str(source),
            output=str(work / f"{len(rows)}.jsonl"),
            config=config,
            kv_memory=kv_budget,
            max_new_tokens=args.new_tokens,
            max_batch=64,
            stop_at_eos=False,  # equal work: every prompt generates new_tokens
        )
        summary = run_batch(model, tokenizer, job, cache_factory=factory)
        rows.append(
            {
                "system": name,
                "tokens_per_s": summary.tokens_per_s,
                "seconds": summary.seconds,
                "batches": len(summary.batches),
                "largest_batch": max(summary.batches),
                "generated_tokens": summary.generated_tokens,
                "peak_kv_bytes": summary.peak_kv_bytes,
                "peak_rss_bytes": summary.peak_memory_bytes,
                "did_not_fit": len(summary.did_not_fit),
            }
        )
        print(f"{name}: {summary.describe()}", file=sys.stderr)
    agreement = {args.dtype: output_agreement(model, tokenizer, source, work, args)}
    if args.agreement_dtype != args.dtype:
        exact_model, _ = load_model(args.model, dtype=args.agreement_dtype)
        agreement[args.agreement_dtype] = output_agreement(
            exact_model, tokenizer, source, work, args
        )
    speedup = rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"]
    print(f"KV budget {format_bytes(kv_budget)} for both (weights {format_bytes(weights)})")
    print("| system | tokens/s | batches (largest) | peak KV | peak RSS |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['system']} | {row['tokens_per_s']:.1f} | "
            f"{row['batches']} ({row['largest_batch']}) | "
            f"{format_bytes(row['peak_kv_bytes'])} | {format_bytes(row['peak_rss_bytes'])} |"
        )
    same = ", ".join(f"{share:.0%} in {dtype}" for dtype, share in agreement.items())
    print(
        f"speed-up {speedup:.2f}x (target >= 3x); dense ALISA vs DynamicCache identical outputs "
        f"({args.agreement_prompts} prompts x {args.agreement_tokens} tokens): {same}"
    )
    print(
        json.dumps(
            {
                "benchmark": "batch_job",
                "kv_budget_bytes": kv_budget,
                "weights_bytes": weights,
                "prompts": args.prompts,
                "new_tokens": args.new_tokens,
                "systems": rows,
                "speedup": speedup,
                "target_3x": speedup >= 3,
                "r1_agreement": agreement,
            }
        )
    )
    return 0


def output_agreement(model, tokenizer, source: Path, work: Path, args) -> float:
    """Share of prompts with identical text from dense ALISA and DynamicCache (r = 1).

    Both run the same batches (8 prompts each, no budget) so only the cache differs.
    """
    subset = work / "subset.jsonl"
    subset.write_text(
        "".join(source.read_text().splitlines(keepends=True)[: args.agreement_prompts])
    )
    outputs = []
    for index, factory in enumerate((None, DynamicCache)):
        # One file per dtype: the runner resumes from an existing file.
        target = work / f"agree-{next(model.parameters()).dtype}-{index}.jsonl"
        job = BatchJob(
            input=str(subset),
            output=str(target),
            max_new_tokens=args.agreement_tokens,
            max_batch=8,
            progress=False,
            stop_at_eos=False,
        )
        run_batch(model, tokenizer, job, cache_factory=factory)
        outputs.append({r["id"]: r["text"] for r in read_jsonl(target)})
    same = sum(outputs[0][key] == outputs[1][key] for key in outputs[0])
    return same / len(outputs[0])


if __name__ == "__main__":
    sys.exit(main())
