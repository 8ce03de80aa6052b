"""Host retention's fetch per layer: the chosen rows gathered from the host region, then copied up.

    python -m experiments.bench_fetch                    # Llama-3.1-8B's KV heads, B = 16 x 8K
    python -m experiments.bench_fetch --batch 16 --heads 3 --head-dim 64 --positions 2080

Each decode step brings back, per layer, the tokens its selection wants that the device does not
hold: rows scattered through the whole history of every (sequence, KV head), as INT8 codes with
a scale and a zero point each (the host region's default format). On an H100 at 16 x 8K the
gather was 40 % of the step (docs/gpu.md): PyTorch's ``index_select`` of each tensor, then a
second copy into page-locked memory so the copy up is asynchronous. This times that way against
:func:`alisa.storage.pages.gathered` (one compiled pass per tensor, rows split over torch's
threads, written straight into page-locked memory on CUDA), each through the copy to the model's
device, on random codes (the time depends on shapes, not values). Prints a table, then one JSON
line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from alisa.kernel_threads import kernel_parts
from alisa.storage.pages import gathered


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--heads", type=int, default=8, help="KV heads (Llama-3.1-8B: 8)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--positions", type=int, default=8192, help="tokens in the host region")
    parser.add_argument(
        "--fetched", default="32,128,512", help="rows fetched per (sequence, KV head), a,b,..."
    )
    parser.add_argument("--calls", type=int, default=30, help="timed calls per cell")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    try:
        args.fetched = [int(v) for v in args.fetched.split(",")]
    except ValueError:
        parser.error(f"--fetched={args.fetched!r}: comma-separated integers")
    for name in ("batch", "heads", "head_dim", "positions", "calls", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")
    if min(args.fetched) < 1 or max(args.fetched) > args.positions:
        parser.error(f"--fetched={args.fetched}: each between 1 and --positions")
    return args


def median_ms(run, flat: torch.Tensor, calls: int, device: torch.device) -> float:
    """Median wall time of ``run(flat)`` in ms, through its copies to ``device``."""
    times = []
    for call in range(calls + 3):  # three warm-up calls (the kernel compiles on the first)
        start = time.perf_counter()
        run(flat)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if call >= 3:
            times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    pin = device.type == "cuda"
    rows = args.batch * args.heads * args.positions
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (2, rows, args.head_dim), dtype=torch.uint8)
    region = (codes, torch.rand(2, rows, 1).half(), torch.rand(2, rows, 1).half())
    if pin:
        region = tuple(t.pin_memory() for t in region)

    def torch_way(flat: torch.Tensor) -> None:  # as FetchedRows did before the kernel
        picked = [t.index_select(1, flat) for t in region]
        if pin:
            picked = [t.pin_memory() for t in picked]
        for t in picked:
            t.to(device, non_blocking=True)

    def kernel_way(flat: torch.Tensor) -> None:
        for t in region:
            gathered(t, flat, pin=pin).to(device, non_blocking=True)

    results = []
    for fetched in args.fetched:
        # Each (sequence, KV head) fetches `fetched` of its positions, ascending, as the swap
        # lists them.
        picks = torch.rand(args.batch * args.heads, args.positions, generator=generator)
        chosen = picks.topk(fetched, dim=1).indices.sort(dim=1).values
        base = torch.arange(args.batch * args.heads).unsqueeze(1) * args.positions
        flat = (base + chosen).flatten().contiguous()
        if not torch.equal(gathered(region[0], flat, pin=False), region[0].index_select(1, flat)):
            raise RuntimeError("the compiled gather read other bytes than index_select")
        row = {
            "fetched_per_head": fetched,
            "rows": int(flat.numel()),
            "torch_ms": median_ms(torch_way, flat, args.calls, device),
            "kernel_ms": median_ms(kernel_way, flat, args.calls, device),
            "parts": kernel_parts(int(flat.numel())),
        }
        row["speedup"] = row["torch_ms"] / row["kernel_ms"]
        results.append(row)
    print(
        "| rows fetched / head | rows | index_select (+ pin) ms | compiled ms | parts | speed-up |"
    )
    print("|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['fetched_per_head']} | {r['rows']} | {r['torch_ms']:.3f} | {r['kernel_ms']:.3f} "
            f"| {r['parts']} | {r['speedup']:.2f}x |"
        )
    environment = {
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if pin else None,
        "threads": args.threads,
        "torch": torch.__version__,
    }
    shape = {k: getattr(args, k) for k in ("batch", "heads", "head_dim", "positions")}
    print(json.dumps({"benchmark": "host_fetch", **shape, **environment, "rows": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
