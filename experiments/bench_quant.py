"""INT8/INT4 KV storage on SmolLM2: bytes per token, perplexity cost, decode speed vs HF's caches.

    python -m experiments.bench_quant                  # the issue's measurements (about 25 min)
    python -m experiments.bench_quant --skip-perplexity --new-tokens 8   # speed and bytes only

Perplexity runs in the decode regime (experiments.tasks.perplexity); speed is B=1 decode at a
2K-token context, each system in its own process (HQQ/quanto need `pip install '.[peers]'`).
Prints tables, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from alisa import AlisaCache, AlisaConfig, load_model
from experiments.bench_speed import compare, environment, print_table
from experiments.data import data_dir, load_wikitext2
from experiments.tasks.perplexity import decode_perplexity, text_segments
from experiments.worker import run_in_subprocess

SPEED_SYSTEMS = (
    "hf-dynamic",
    "alisa:kv_bits=8",
    "alisa:kv_bits=8,residual_tokens=0",
    "alisa:kv_bits=4",
    "hf-hqq8",
    "hf-quanto4",
    "hf-fp8",
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--segments", type=int, default=4)
    parser.add_argument("--segment-tokens", type=int, default=1024)
    parser.add_argument("--ratios", default="1.0,0.2")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-perplexity", action="store_true")
    parser.add_argument(
        "--preset", default="default", choices=("default", "paper"), help="AlisaConfig preset"
    )
    return parser.parse_args(argv)


def bytes_per_token(model, tokens: int = 512) -> dict:
    """Measured KV bytes per stored token (all layers) at 16/8/4 bits, with and without the ring."""
    ids = torch.randint(100, 30000, (1, tokens))
    result = {}
    for bits, residual in ((16, 0), (8, 0), (4, 0), (8, 64), (4, 64)):
        cache = AlisaCache(model, AlisaConfig(kv_bits=bits, residual_tokens=residual))
        with torch.inference_mode():
            model(input_ids=ids, past_key_values=cache)
        per_slot = cache.kv_bytes() / cache.layers[0].store.capacity
        result[f"{bits}bit" + (f"+r{residual}" if residual and bits < 16 else "")] = per_slot
    return result


def perplexities(model, tokenizer, args) -> dict:
    segments = text_segments(
        tokenizer, load_wikitext2(data_dir(args.data_dir)), args.segment_tokens, args.segments
    )
    result = {}
    for ratio in (float(r) for r in args.ratios.split(",")):
        for bits, residual in ((16, 0), (8, 0), (8, 64), (4, 0), (4, 64)):
            config = AlisaConfig(
                policy="swa",
                caching_ratio=ratio,
                kv_bits=bits,
                residual_tokens=residual,
                preset=args.preset,
            )
            value = decode_perplexity(model, segments, config).perplexity
            key = f"swa r={ratio:g} {bits}bit" + (f"+r{residual}" if residual else "")
            result[key] = value
            print(f"{key}: {value:.3f}", file=sys.stderr)
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, dtype="float32")
    sizes = bytes_per_token(model)
    ppl = {} if args.skip_perplexity else perplexities(model, tokenizer, args)
    del model
    options = {
        "model": args.model,
        "dtype": "float32",
        "batch": 1,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "threads": args.threads,
        "data_dir": args.data_dir,
    }
    rows = []
    for system in SPEED_SYSTEMS:
        try:
            rows.append(run_in_subprocess(system, options))
        except RuntimeError as error:  # a peer package missing: report, keep going
            print(f"{system}: skipped ({str(error).splitlines()[-1]})", file=sys.stderr)
    dense_tokens = rows[0]["token_ids"][0] if rows and rows[0]["system"] == "hf-dynamic" else None
    for row in rows:
        if dense_tokens is not None:
            same = next(
                (
                    i
                    for i, (a, b) in enumerate(zip(dense_tokens, row["token_ids"][0], strict=False))
                    if a != b
                ),
                len(dense_tokens),
            )
            row["greedy_tokens_equal_to_dynamic"] = same
    compare(rows, "hf-dynamic")
    print("KV bytes per token (all layers):", json.dumps({k: round(v) for k, v in sizes.items()}))
    for key, value in ppl.items():
        print(f"{key}: ppl {value:.3f}")
    print_table(rows)
    report = {
        "benchmark": "kv_quantization",
        **options,
        **environment(args),
        "kv_bytes_per_token": sizes,
        "perplexity": ppl,
        "speed": rows,
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
