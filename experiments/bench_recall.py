"""Recall's effect on passkey retrieval with SWA at r = 0.2 (SmolLM2).

    python -m experiments.bench_recall                  # prompts up to 2048 tokens

Prints accuracy for dense, SWA r=0.2, and SWA r=0.2 with recall every m steps; then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from alisa import AlisaConfig, load_model
from experiments.data import data_dir, load_passkey
from experiments.tasks.passkey import passkey_accuracy


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--max-prompt-tokens", type=int, default=2048)
    parser.add_argument("--ratio", type=float, default=0.2)
    parser.add_argument("--every", default="1,4", help="recall intervals to try")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, dtype="float32")
    rows = load_passkey(data_dir(args.data_dir))
    configs = {
        "dense": AlisaConfig(),
        f"swa r={args.ratio:g}": AlisaConfig(policy="swa", caching_ratio=args.ratio),
    }
    for every in (int(e) for e in args.every.split(",")):
        configs[f"swa r={args.ratio:g} + recall every {every}"] = AlisaConfig(
            policy="swa", caching_ratio=args.ratio, recall_every=every, recall_tokens=16
        )
    results = {}
    for name, config in configs.items():
        result = passkey_accuracy(
            model, tokenizer, rows, config, max_prompt_tokens=args.max_prompt_tokens
        )
        results[name] = {"accuracy": result.accuracy, "n": result.total}
        print(f"{name}: {result.accuracy:.3f} ({result.correct}/{result.total})", file=sys.stderr)
    print("| configuration | passkey accuracy |")
    print("|---|---|")
    for name, value in results.items():
        print(f"| {name} | {value['accuracy']:.2f} ({value['n']} prompts) |")
    print(
        json.dumps(
            {
                "benchmark": "recall_passkey",
                "max_prompt_tokens": args.max_prompt_tokens,
                "results": results,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
