"""One kernel of host retention's decode step per layer, each way it can run, on this machine.

    python -m experiments.kernels sketch   # the key sketch's product, SmolLM2-135M's shapes
    python -m experiments.kernels sketch --batches 4 --positions 8000 --heads 8 --groups 4
    python -m experiments.kernels attend   # attention over one layer's slots, SmolLM2-135M
    python -m experiments.kernels attend --batches 4 --slots 1700 --heads 8 --groups 4
    python -m experiments.kernels fetch    # the fetched rows' gather, Llama-3.1-8B, B = 16 x 8K
    python -m experiments.kernels fetch --batch 16 --heads 3 --head-dim 64 --positions 2080
    python -m experiments.kernels products # one pass over SmolLM2-135M's weights, each form
    python -m experiments.kernels products --model llama-3.2-1b --batches 1,4

``sketch``: ``KeySketch.logits``, each product forced (PyTorch in bfloat16, PyTorch on the sketch
widened to float32, the compiled kernel), so :func:`alisa.ops.backends.choose_ops`'s choice can be
checked. ``attend``: a float32 and an INT8 region's attention by the store's compiled kernel
(:func:`alisa.ops.cpu.attend_slots`) against PyTorch's path, every slot held. ``fetch``: the rows
a step fetches from the host region (INT8 codes, scale, zero point), ``index_select`` (then pinned
on CUDA) against :func:`alisa.storage.pages.gathered`, each through the copy to ``--device``.
``products``: a decode step's weight products, one pass over every matrix of a model shape
(:mod:`experiments.shapes`, float32) at each batch size: PyTorch's ``F.linear``, ``(W @ xᵀ)ᵀ`` by
the BLAS, and by the CPU's row kernel (:func:`alisa.ops.cpu.weight_product`), which the
transposed form runs at up to :data:`alisa.ops.products.ROW_KERNEL_ROWS` rows.

Random tensors (time depends on shapes, not values); each cell is the median of ``--calls`` calls
after warm-up (:func:`experiments.timing.median_seconds`). Prints a table, then one JSON line
whose every row carries the machine (:func:`experiments.timing.environment`) and the backend.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import NamedTuple

import torch

from alisa.kv.attention import _visible, grouped_attention_parts
from alisa.kv.ranking import KeySketch
from alisa.ops.backends import PRODUCTS, Ops, choose_ops
from alisa.ops.cpu import kernel_parts
from alisa.storage.pages import gathered
from alisa.storage.quantized import QuantizedStore
from alisa.storage.store import DenseStore
from experiments.flags import markdown_table, positive_ints
from experiments.timing import environment, median_seconds

ATTEND_WAYS = ("float32_torch", "float32_kernels", "int8_torch", "int8_kernels")


class Report(NamedTuple):
    """What one kernel's run prints: lines before the table, the table's columns (header and
    how a row shows), the JSON line's fields beside its rows, and the rows."""

    benchmark: str
    preamble: list[str]
    columns: list[tuple[str, Callable[[dict], str]]]
    fields: dict
    rows: list[dict]


def device_name(text: str) -> torch.device:
    """A torch device this machine has (an argparse type)."""
    here = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in here:
        raise argparse.ArgumentTypeError(f"{text!r}: not a device here ({', '.join(here)})")
    return device


def micros(run: Callable[[], object], calls: int) -> float:
    """Median µs of ``run()`` on a CPU after up to ten warm-up calls (kernels compile first)."""
    return 1e6 * median_seconds(run, repeats=calls, warm_up=min(10, calls))


def sketch(args: argparse.Namespace, ops: Ops) -> Report:
    """Each product's median µs per (batch, positions) cell, each product forced."""

    def cell(batch: int, positions: int, product: str) -> float:
        generator = torch.Generator().manual_seed(0)
        keys = torch.randn(batch, args.heads, positions, args.head_dim, generator=generator)
        query = torch.randn(batch, args.heads, args.groups, args.head_dim, generator=generator)
        sketched = KeySketch(
            batch, args.heads, args.head_dim, positions, keys.device, product=product
        )
        sketched.write(0, keys, torch.ones(batch, positions, dtype=torch.bool))
        return micros(lambda: sketched.logits(query), args.calls)

    rows = [
        {"batch": b, "positions": p, **{f"{k}_us": cell(b, p, k) for k in PRODUCTS}}
        for b in args.batches
        for p in args.positions
    ]
    chosen = ops.product
    labels = ("bfloat16 product", "float32 product", "compiled kernel")
    columns = [("B × positions", lambda r: f"{r['batch']} × {r['positions']:,}")]
    for product, label in zip(PRODUCTS, labels, strict=True):
        label += " µs (widening included)" if product == "float32" else " µs"
        columns.append((label, lambda r, key=f"{product}_us": f"{r[key]:,.0f}"))
    fields = {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "chosen": chosen}
    fields.update(shape_fields(args, "heads", "groups", "head_dim"))
    return Report("sketch_product", [f"product used on this CPU: {chosen}"], columns, fields, rows)


def attend(args: argparse.Namespace, ops: Ops) -> Report:
    """Each way's median µs per (batch, slots) cell (see the module docstring); the stores run
    ``ops``' compiled kernels."""

    def cell(batch: int, slots: int) -> dict:
        generator = torch.Generator().manual_seed(0)
        shape = (batch, args.heads, slots, args.head_dim)
        keys, values = (torch.randn(shape, generator=generator) for _ in range(2))
        query = torch.randn(batch, args.heads * args.groups, 1, args.head_dim, generator=generator)
        positions = torch.arange(slots).expand(batch, 1, slots).contiguous()
        scaling = args.head_dim**-0.5
        coded = dict(bits=8, group_size=None, residual_tokens=args.ring, groups=1)
        stores = {
            "float32": DenseStore(keys, values, slots, compiled=ops.compiled),
            "int8": QuantizedStore(keys, values, slots, **coded, compiled=ops.compiled),
        }
        row = {"batch": batch, "slots": slots}
        for name, store in stores.items():

            def torch_way(store=store) -> None:  # reads the region each call, as a step does
                parts = store.parts(positions)
                grouped_attention_parts(query, parts, _visible(parts, slots, 1, None), scaling)

            def kernels(store=store):
                return store.attend(positions, query, slots, None, scaling)

            if kernels() is None:  # the store would fall back to PyTorch's path: nothing to time
                raise RuntimeError(f"the {name} store has no compiled attention on this machine")
            row[f"{name}_torch_us"] = micros(torch_way, args.calls)
            row[f"{name}_kernels_us"] = micros(kernels, args.calls)
        return row

    rows = [cell(batch, slots) for batch in args.batches for slots in args.slots]
    labels = ("float32: PyTorch", "float32: kernels", "INT8: PyTorch", "INT8: kernels")
    columns = [("B × slots", lambda r: f"{r['batch']} × {r['slots']:,}")]
    for way, label in zip(ATTEND_WAYS, labels, strict=True):
        label += " µs (dequantized copy)" if way == "int8_torch" else " µs"
        columns.append((label, lambda r, key=f"{way}_us": f"{r[key]:,.0f}"))
    fields = {"cpu_capability": torch.backends.cpu.get_cpu_capability()}
    fields.update(shape_fields(args, "heads", "groups", "head_dim", "ring"))
    return Report("slot_attention", [], columns, fields, rows)


def fetch(args: argparse.Namespace, ops: Ops) -> Report:
    """Both ways' median ms per rows-fetched-per-head cell, through the copy to the device."""
    device, pin = args.device, args.device.type == "cuda"
    rows = args.batch * args.heads * args.positions
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
            gathered(t, flat, pin=pin, compiled=ops.compiled).to(device, non_blocking=True)

    def ms(run: Callable[[torch.Tensor], None], flat: torch.Tensor) -> float:
        timed = median_seconds(lambda: run(flat), repeats=args.calls, warm_up=3, device=device)
        return 1000 * timed

    generator = torch.Generator().manual_seed(0)
    results = []
    for fetched in args.fetched:
        # Each (sequence, KV head) fetches `fetched` of its positions, ascending, as the swap
        # lists them.
        picks = torch.rand(args.batch * args.heads, args.positions, generator=generator)
        chosen = picks.topk(fetched, dim=1).indices.sort(dim=1).values
        base = torch.arange(args.batch * args.heads).unsqueeze(1) * args.positions
        flat = (base + chosen).flatten().contiguous()
        kernel = gathered(region[0], flat, pin=False, compiled=ops.compiled)
        if not torch.equal(kernel, region[0].index_select(1, flat)):
            raise RuntimeError("the compiled gather read other bytes than index_select")
        row = {"fetched_per_head": fetched, "rows": int(flat.numel())}
        row.update(torch_ms=ms(torch_way, flat), kernel_ms=ms(kernel_way, flat))
        row.update(parts=kernel_parts(row["rows"]), speedup=row["torch_ms"] / row["kernel_ms"])
        results.append(row)
    columns = [
        ("rows fetched / head", lambda r: str(r["fetched_per_head"])),
        ("rows", lambda r: str(r["rows"])),
        ("index_select (+ pin) ms", lambda r: f"{r['torch_ms']:.3f}"),
        ("compiled ms", lambda r: f"{r['kernel_ms']:.3f}"),
        ("parts", lambda r: str(r["parts"])),
        ("speed-up", lambda r: f"{r['speedup']:.2f}x"),
    ]
    fields = shape_fields(args, "batch", "heads", "head_dim", "positions")
    fields.update(device=str(device), gpu=torch.cuda.get_device_name(device) if pin else None)
    return Report("host_fetch", [], columns, fields, results)


PRODUCT_WAYS = ("linear", "blas_transposed", "row_kernel")


def products(args: argparse.Namespace, ops: Ops) -> Report:
    """Each way's median ms for one pass over the shape's weight matrices, per batch size."""
    from alisa.ops.cpu import weight_product
    from alisa.ops.products import blas_transposed
    from experiments.shapes import shape_config

    overrides = {} if args.layers is None else {"num_hidden_layers": args.layers}
    config = shape_config(args.model, **overrides)
    hidden, inner = config.hidden_size, config.intermediate_size
    query, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads
    kv *= config.head_dim
    layer = [(query, hidden), (kv, hidden), (kv, hidden), (hidden, query)]
    layer += [(inner, hidden), (inner, hidden), (hidden, inner)]
    shapes = layer * config.num_hidden_layers + [(config.vocab_size, hidden)]
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=generator) for shape in shapes]
    megabytes = sum(w.numel() * 4 for w in weights) / 1e6
    ways = {
        "linear": torch.nn.functional.linear,
        "blas_transposed": lambda x, w: blas_transposed(x, w).contiguous(),
        "row_kernel": weight_product,
    }

    def cell(batch: int) -> dict:
        inputs = {k: torch.randn(batch, k, generator=generator) for k in {k for _, k in shapes}}
        row = {"batch": batch}
        for way, product in ways.items():

            def one_pass(product=product) -> None:
                for weight in weights:
                    product(inputs[weight.shape[1]], weight)

            timed = median_seconds(one_pass, repeats=args.calls, warm_up=2)
            row[f"{way}_ms"] = 1000 * timed
        row["gb_per_s_row_kernel"] = megabytes / row["row_kernel_ms"]  # MB per ms
        return row

    rows = [cell(batch) for batch in args.batches]
    columns = [("B", lambda r: str(r["batch"]))]
    labels = ("F.linear ms", "(W @ xᵀ)ᵀ by the BLAS ms", "row kernel ms")
    for way, label in zip(PRODUCT_WAYS, labels, strict=True):
        columns.append((label, lambda r, key=f"{way}_ms": f"{r[key]:,.1f}"))
    columns.append(("row kernel GB/s", lambda r: f"{r['gb_per_s_row_kernel']:.1f}"))
    preamble = [f"{len(weights)} float32 matrices of {args.model}, {megabytes:,.0f} MB a pass"]
    fields = {"model": args.model, "layers": config.num_hidden_layers, "megabytes": megabytes}
    fields["matrices"] = len(weights)
    return Report("weight_products", preamble, columns, fields, rows)


def shape_fields(args: argparse.Namespace, *names: str) -> dict:
    return {name: getattr(args, name) for name in names}


KERNELS = {"sketch": sketch, "attend": attend, "fetch": fetch, "products": products}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.kernels", description=__doc__.splitlines()[0]
    )
    commands = parser.add_subparsers(
        dest="kernel", required=True, metavar="{" + ",".join(KERNELS) + "}"
    )
    subs = {name: commands.add_parser(name, help=f"time the {name} kernel") for name in KERNELS}
    # Defaults: SmolLM2-135M's shapes for the two per-token kernels, Llama-3.1-8B's for the fetch.
    for name, (heads, head_dim, calls) in (
        ("sketch", (3, 64, 100)),
        ("attend", (3, 64, 100)),
        ("fetch", (8, 128, 30)),
    ):
        subs[name].add_argument("--heads", type=int, default=heads, help="KV heads")
        subs[name].add_argument("--head-dim", type=int, default=head_dim)
        subs[name].add_argument("--calls", type=int, default=calls, help="timed calls per cell")
        subs[name].add_argument("--threads", type=int, default=2)
    for name in ("sketch", "attend"):
        subs[name].add_argument("--groups", type=int, default=3, help="query heads per KV head")
        subs[name].add_argument("--batches", type=positive_ints, default=[1, 4, 16], help="a,b,...")
    subs["sketch"].add_argument(
        "--positions", type=positive_ints, default=[2080], help="tokens, a,..."
    )
    subs["attend"].add_argument(
        "--slots", type=positive_ints, default=[420, 1700], help="held, a,..."
    )
    subs["attend"].add_argument("--ring", type=int, default=64, help="INT8 region's fp ring")
    fetch_ = subs["fetch"]
    fetch_.add_argument("--batch", type=int, default=16)
    fetch_.add_argument("--positions", type=int, default=8192, help="tokens in the host region")
    fetch_.add_argument(
        "--fetched", type=positive_ints, default=[32, 128, 512], help="rows per head"
    )
    subs["products"].add_argument("--model", default="smollm2-135m", help="a shape's name")
    subs["products"].add_argument("--layers", type=int, help="fewer layers than the shape's")
    subs["products"].add_argument("--batches", type=positive_ints, default=[1, 2, 4, 8, 16])
    subs["products"].add_argument("--calls", type=int, default=7, help="timed passes per cell")
    subs["products"].add_argument("--threads", type=int, default=2)
    default = "cuda" if torch.cuda.is_available() else "cpu"
    fetch_.add_argument("--device", type=device_name, default=torch.device(default))
    args = parser.parse_args(argv)
    # The smallest value of each integer option (one a kernel lacks, or a list, is skipped).
    least = {"heads": 1, "head_dim": 1, "calls": 1, "threads": 1, "groups": 1, "ring": 0}
    if args.kernel == "products":  # a shape's name checked here, as the others' numbers
        from experiments.shapes import shape_config

        try:
            shape_config(args.model)
        except ValueError as error:
            subs["products"].error(str(error))
    least.update(batch=1, positions=1, layers=1, head_dim=2 if args.kernel == "sketch" else 1)
    for name, low in least.items():
        value = getattr(args, name, low)
        if isinstance(value, int) and value < low:
            subs[args.kernel].error(f"--{name.replace('_', '-')}={value} must be at least {low}")
    if args.kernel == "fetch" and max(args.fetched) > args.positions:
        fetch_.error(f"--fetched={args.fetched}: each at most --positions={args.positions}")
    return args


def print_report(report: Report, threads: int, machine: dict, backend: str) -> None:
    """The table, then the JSON line; every row records the machine and the backend."""
    for line in report.preamble:
        print(line)
    cells = [[show(row) for _, show in report.columns] for row in report.rows]
    print("\n".join(markdown_table([header for header, _ in report.columns], cells)))
    rows = [{**row, "machine": machine, "backend": backend} for row in report.rows]
    fields = {"threads": threads, "torch": torch.__version__, **report.fields}
    print(json.dumps({"benchmark": report.benchmark, **fields, "rows": rows}))


def main(argv=None) -> int:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        # Every kernel timed here is the CPU backend's (numba), against PyTorch's ops.
        ops = choose_ops("cpu", torch.float32, "cpu")
        report = KERNELS[args.kernel](args, ops)
        print_report(report, args.threads, environment(args.threads), ops.describe())
    finally:
        torch.set_num_threads(threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
