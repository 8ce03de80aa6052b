"""A decode step's attention over one layer's slots, PyTorch's path against the compiled kernels.

    python -m experiments.bench_attend                      # SmolLM2-135M's shapes
    python -m experiments.bench_attend --batches 4 --slots 1700 --heads 8 --groups 4

On a CPU a float32 decode step's attention is computed by the store itself
(:mod:`alisa.storage.attend`): compiled passes over the slots, an INT8 region's codes dequantized
in registers. PyTorch's path (the reference, and CUDA's) reads the region as float tensors: an
INT8 region dequantized whole first, with its full-precision ring written over it. This times
both ways, for a float32 and an INT8 region, on random keys and values (the time depends on
shapes, not values) with every slot held. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from alisa.kv.attention import _visible, grouped_attention_parts
from alisa.storage.quantized import QuantizedStore
from alisa.storage.store import DenseStore

WAYS = ("float32_torch", "float32_kernels", "int8_torch", "int8_kernels")


def counts(text: str) -> list[int]:
    """A comma-separated list of positive integers (an argparse type)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated integers") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be at least 1")
    return values


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=counts, default=[1, 4, 16], help="sequences, a,b,...")
    parser.add_argument("--slots", type=counts, default=[420, 1700], help="slots held, a,b,...")
    parser.add_argument("--heads", type=int, default=3, help="KV heads (SmolLM2-135M: 3)")
    parser.add_argument("--groups", type=int, default=3, help="query heads per KV head")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--ring", type=int, default=64, help="INT8 region's full-precision ring")
    parser.add_argument("--calls", type=int, default=100, help="timed calls per cell")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    for name in ("heads", "groups", "head_dim", "calls", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")
    if args.ring < 0:
        parser.error(f"--ring={args.ring} must be at least 0")
    return args


def median_us(run, calls: int) -> float:
    """Median microseconds of ``run()`` after a few warm-up calls (the kernels compile first)."""
    for _ in range(min(10, calls)):
        run()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def time_cell(args: argparse.Namespace, batch: int, slots: int) -> dict:
    """Each way's median time for ``batch`` sequences holding ``slots`` tokens each."""
    generator = torch.Generator().manual_seed(0)
    shape = (batch, args.heads, slots, args.head_dim)
    keys, values = (torch.randn(shape, generator=generator) for _ in range(2))
    query = torch.randn(batch, args.heads * args.groups, 1, args.head_dim, generator=generator)
    positions = torch.arange(slots).expand(batch, 1, slots).contiguous()
    scaling = args.head_dim**-0.5
    stores = {
        "float32": DenseStore(keys, values, slots),
        "int8": QuantizedStore(
            keys, values, slots, bits=8, group_size=None, residual_tokens=args.ring, groups=1
        ),
    }

    def torch_way(store) -> None:  # reads the region each call, as a decode step does
        parts = store.parts(positions)
        grouped_attention_parts(query, parts, _visible(parts, slots, 1, None), scaling)

    row = {"batch": batch, "slots": slots}
    for name, store in stores.items():
        row[f"{name}_torch_us"] = median_us(lambda store=store: torch_way(store), args.calls)
        row[f"{name}_kernels_us"] = median_us(
            lambda store=store: store.attend(positions, query, slots, None, scaling), args.calls
        )
    return row


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [time_cell(args, batch, slots) for batch in args.batches for slots in args.slots]
    print(
        "| B × slots | float32: PyTorch µs | float32: kernels µs | INT8: PyTorch µs "
        "(dequantized copy) | INT8: kernels µs |"
    )
    print("|---|---|---|---|---|")
    for row in rows:
        times = " | ".join(f"{row[f'{way}_us']:,.0f}" for way in WAYS)
        print(f"| {row['batch']} × {row['slots']:,} | {times} |")
    print(
        json.dumps(
            {
                "benchmark": "slot_attention",
                "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                "threads": args.threads,
                "torch": torch.__version__,
                "heads": args.heads,
                "groups": args.groups,
                "head_dim": args.head_dim,
                "ring": args.ring,
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
