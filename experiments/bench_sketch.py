"""Host retention's key-sketch product per layer, each way it can run, on this machine.

    python -m experiments.bench_sketch                      # SmolLM2-135M's shapes, B = 1/4/16
    python -m experiments.bench_sketch --batches 4 --positions 8000 --heads 8 --groups 4

``KeySketch.logits`` scores every stored token against a step's queries once per layer and
step. It runs its product in bfloat16 where the device has a fast one and, on a CPU without
one, by a compiled kernel that reads the bfloat16 sketch in place
(:func:`alisa.ops.backends.choose_ops`); this times the three ways (PyTorch in bfloat16,
PyTorch on the sketch widened to float32, the kernel) on this machine, so the choice can be
checked where it is made. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from alisa.ops.backends import choose_ops
from alisa.storage.sketch import PRODUCTS, KeySketch


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,4,16", help="sequences per step, comma-separated")
    parser.add_argument("--positions", default="2080", help="tokens stored, comma-separated")
    parser.add_argument("--heads", type=int, default=3, help="KV heads (SmolLM2-135M: 3)")
    parser.add_argument("--groups", type=int, default=3, help="query heads per KV head")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--calls", type=int, default=100, help="timed calls per cell")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    for name in ("batches", "positions"):
        try:
            values = [int(v) for v in getattr(args, name).split(",")]
        except ValueError:
            parser.error(f"--{name}={getattr(args, name)!r}: comma-separated integers")
        if min(values) < 1:
            parser.error(f"--{name}={getattr(args, name)!r}: every value must be at least 1")
        setattr(args, name, values)
    for name in ("heads", "groups", "calls", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)} must be at least 1")
    if args.head_dim < 2:
        parser.error(f"--head-dim={args.head_dim} must be at least 2")
    return args


def time_product(
    batch: int,
    positions: int,
    heads: int,
    groups: int,
    head_dim: int,
    product: str,
    calls: int,
) -> float:
    """Median microseconds of one ``KeySketch.logits`` call over ``positions`` stored keys."""
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(batch, heads, positions, head_dim, generator=generator)
    query = torch.randn(batch, heads, groups, head_dim, generator=generator)
    sketch = KeySketch(batch, heads, head_dim, positions, keys.device, product=product)
    sketch.write(0, keys, torch.ones(batch, positions, dtype=torch.bool))
    for _ in range(min(10, calls)):  # warm-up: first calls pay for allocation and dispatch
        sketch.logits(query)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        sketch.logits(query)
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def measure(args: argparse.Namespace) -> list[dict]:
    rows = []
    for batch in args.batches:
        for positions in args.positions:
            shape = (batch, positions, args.heads, args.groups, args.head_dim)
            row = {"batch": batch, "positions": positions}
            for product in PRODUCTS:
                row[f"{product}_us"] = time_product(*shape, product, args.calls)
            rows.append(row)
    return rows


def print_table(rows: list[dict], chosen: str) -> None:
    print(f"product used on this CPU: {chosen}")
    print(
        "| B × positions | bfloat16 product µs | float32 product µs (widening included) "
        "| compiled kernel µs |"
    )
    print("|---|---|---|---|")
    for row in rows:
        times = " | ".join(f"{row[f'{product}_us']:,.0f}" for product in PRODUCTS)
        print(f"| {row['batch']} × {row['positions']:,} | {times} |")


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = measure(args)
    chosen = choose_ops("cpu", torch.float32).product
    print_table(rows, chosen)
    print(
        json.dumps(
            {
                "benchmark": "sketch_product",
                "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                "chosen": chosen,
                "threads": args.threads,
                "torch": torch.__version__,
                "heads": args.heads,
                "groups": args.groups,
                "head_dim": args.head_dim,
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
