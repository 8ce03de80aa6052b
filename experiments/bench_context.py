"""Decode step time vs context length, and what host retention costs per context token.

    python -m experiments.bench_context --model shape:llama-3.2-1b --threads 1 --plot ctx.png
    python -m experiments.bench_context --contexts 256,512 --batches 1 --new-tokens 4   # quick

Every batch x prompt length (context) x system runs in its own :mod:`experiments.worker` process,
as in :mod:`experiments.bench_speed` (``--model`` takes its specs, ``shape:NAME`` included); with
``--interleave STEPS`` each cell's systems run in one process instead, decoding in turns
(:mod:`experiments.interleave`), so that the differences the overhead columns read (host - drop,
r = 1 - drop) are taken under the same minute's conditions: one process per cell made single
cells noisier than those differences on a 2-core machine (docs/host-speed.md, stop 55).
Prints a markdown table of median decode step times, then the marginal table (below), then one
JSON line with every row.

For each ``retention=host`` system H, its drop partner D (the same config with
``retention=drop``) and the r = 1 drop system F (D with ``caching_ratio=1.0``), per cell of batch
B and context T:

- host overhead: ``H - D`` ms per step, and per context token ``(H - D) / (B * T)``;
- dense attention per context token, estimated as ``(F - D) / (B * T * (1 - r))``: F attends to
  every token and D to a share r of them, the rest of the step (weights, sampling) being the same,
  so their difference is the attention over (1 - r) of the context less D's selection work: a
  lower bound, negative where selecting costs more than the attention it saves (short contexts).
  The default r = 0.2 gives ``(F - D) / (B * T * 0.8)``;
- their ratio: how many dense-attention token reads one retained host token costs a step.

Those per-cell figures divide the whole overhead by the context, so a cost paid once a step
(per-layer calls, whatever the context) reads as a per-token cost that falls as the context grows.
The marginal table separates the two, per batch size over the contexts swept (at least two): a
least-squares line through ``H - D`` against ``B * T`` gives the fixed cost of a step (its
intercept, ms) and the cost of each further context token (its slope, ns), and one through
``(F - D) / (1 - r)`` gives dense attention's cost of each further token; the ratio of the slopes
is what selecting over one more stored token costs against attending to it densely.

Systems without their partners in ``--systems`` get no overhead columns.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from experiments.bench_speed import (
    check_model,
    environment,
    interleave_error,
    positive_int,
    run_rounds,
    run_systems,
    worker_options,
)
from experiments.systems import HostPair, host_pairs
from experiments.worker import add_prompts_argument

SYSTEMS = (
    "hf-dynamic",
    "alisa:policy=swa,caching_ratio=1.0",
    "alisa:policy=swa,caching_ratio=0.2",
    "alisa:policy=swa,caching_ratio=0.2,retention=host",
    "alisa:policy=swa,caching_ratio=0.1,retention=host",
)


def positive_ints(text: str) -> list[int]:
    """``"2048,4096"`` -> [2048, 4096]; anything else is an argparse error naming the value."""
    try:
        return [positive_int(item) for item in text.split(",")]
    except argparse.ArgumentTypeError:
        message = f"{text!r} is not a comma list of positive integers"
        raise argparse.ArgumentTypeError(message) from None


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="smollm2-135m", help="alisa.load_model spec, or shape:NAME"
    )
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--contexts", type=positive_ints, default=[2048, 4096, 8192])
    parser.add_argument("--batches", type=positive_ints, default=[1, 4])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument(
        "--systems",
        default=";".join(SYSTEMS),
        help="';'-separated system names (see experiments.systems)",
    )
    parser.add_argument("--plot", type=Path, default=None, help="PNG of step time vs context")
    parser.add_argument(
        "--interleave",
        type=positive_int,
        default=None,
        metavar="STEPS",
        help="run each cell's systems in one process, decoding in turns of STEPS steps "
        "(experiments.interleave): the machine's drift falls on every system of a cell alike",
    )
    add_prompts_argument(parser)
    return parser.parse_args(argv)


def overheads(steps_ms: dict[str, float], batch: int, context: int, pair: HostPair) -> dict:
    """The host overhead and dense-attention estimate of one cell (module docstring); None for a
    figure whose systems did not run."""
    host, drop = steps_ms.get(pair.host), steps_ms.get(pair.drop)
    full = steps_ms.get(pair.full) if pair.full else None
    tokens = batch * context
    extra = host - drop if host is not None and drop is not None else None
    per_token = extra * 1e6 / tokens if extra is not None else None
    dense = None
    if full is not None and drop is not None and pair.caching_ratio < 1:
        dense = (full - drop) * 1e6 / (tokens * (1 - pair.caching_ratio))
    return {
        "host_minus_drop_ms": extra,
        "host_overhead_ns_per_token": per_token,
        "dense_attention_ns_per_token": dense,
        "overhead_vs_dense": per_token / dense if per_token is not None and dense else None,
    }


def cells(rows: list[dict]) -> dict[tuple[int, int], dict[str, float]]:
    """{(batch, context): {system: median step ms}} in the rows' order."""
    out: dict[tuple[int, int], dict[str, float]] = {}
    for row in rows:
        out.setdefault((row["batch"], row["context"]), {})[row["system"]] = row["median_step_ms"]
    return out


def summary(rows: list[dict], systems: list[str]) -> list[dict]:
    """One entry per cell: batch, context, and each host system's :func:`overheads`."""
    pairs = host_pairs(systems)
    return [
        {
            "batch": batch,
            "context": context,
            "hosts": {pair.host: overheads(steps, batch, context, pair) for pair in pairs},
        }
        for (batch, context), steps in cells(rows).items()
    ]


def _line(tokens: list[int], values: list[float]) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line through ``values`` against ``tokens``."""
    slope, intercept = np.polyfit(np.asarray(tokens, float), np.asarray(values, float), 1)
    return float(slope), float(intercept)


def marginal(rows: list[dict], systems: list[str]) -> list[dict]:
    """Per batch size with two or more contexts and per host system, the fixed and per-token
    parts of its overhead and dense attention's cost per further token (module docstring); None
    for a figure whose systems did not all run in every context of the batch."""
    steps = cells(rows)
    out = []
    for batch in sorted({batch for batch, _ in steps}):
        contexts = sorted(context for b, context in steps if b == batch)
        if len(contexts) < 2:
            continue
        tokens = [batch * context for context in contexts]
        runs = [steps[batch, context] for context in contexts]
        hosts = {}
        for pair in host_pairs(systems):
            figures = dict.fromkeys(
                ("fixed_ms", "overhead_ns_per_token", "dense_ns_per_token", "overhead_vs_dense")
            )
            if all(pair.host in run and pair.drop in run for run in runs):
                slope, intercept = _line(tokens, [run[pair.host] - run[pair.drop] for run in runs])
                figures.update(fixed_ms=intercept, overhead_ns_per_token=slope * 1e6)
            if pair.full and pair.caching_ratio < 1 and all(pair.full in run for run in runs):
                saved = [
                    (run[pair.full] - run[pair.drop]) / (1 - pair.caching_ratio) for run in runs
                ]
                figures["dense_ns_per_token"] = _line(tokens, saved)[0] * 1e6
            over, dense = figures["overhead_ns_per_token"], figures["dense_ns_per_token"]
            if over is not None and dense is not None and dense > 0:
                figures["overhead_vs_dense"] = over / dense
            hosts[pair.host] = figures
        out.append({"batch": batch, "contexts": contexts, "hosts": hosts})
    return out


def marginal_lines(entries: list[dict]) -> list[str]:
    """The markdown table of :func:`marginal`'s ``entries``: one row per batch size and host
    system."""
    lines = [
        "| B | contexts | system | fixed ms a step | ns per further token | dense ns per further"
        " token | x dense |",
        "|---|---|---|---|---|---|---|",
    ]
    for entry in entries:
        for host, figures in entry["hosts"].items():
            values = [str(entry["batch"]), ",".join(map(str, entry["contexts"])), host]
            values += _columns(figures)
            lines.append("| " + " | ".join(values) + " |")
    return lines


def _figure(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _columns(figures: dict[str, float | None]) -> list[str]:
    """A host system's overhead figures as table cells, in their order; ratios to 2 digits."""
    return [
        _figure(value, 2 if key == "overhead_vs_dense" else 1) for key, value in figures.items()
    ]


def table_lines(rows: list[dict], systems: list[str]) -> list[str]:
    """The markdown table: median step ms per system, then per host system its overhead (ms,
    ns per context token), the dense-attention estimate and their ratio."""
    pairs = host_pairs(systems)
    header = ["B", "context", *(f"{system} ms" for system in systems)]
    for pair in pairs:
        r = f"r={pair.caching_ratio:g}"
        header += [f"host-drop {r} ms", f"ns/token {r}", f"dense ns/token {r}", f"x dense {r}"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    steps = cells(rows)
    for cell in summary(rows, systems):
        batch, context = cell["batch"], cell["context"]
        values = [str(batch), str(context)]
        values += [_figure(steps[batch, context].get(system), 0) for system in systems]
        for pair in pairs:
            values += _columns(cell["hosts"][pair.host])
        lines.append("| " + " | ".join(values) + " |")
    return lines


def plot(rows: list[dict], systems: list[str], path: Path, title: str = "") -> None:
    """Median step time vs context, one panel per batch size, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = cells(rows)
    batches = sorted({batch for batch, _ in steps})
    figure, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
    for axis, batch in zip(axes[0], batches, strict=True):
        contexts = sorted(context for b, context in steps if b == batch)
        for system in systems:
            points = [(c, steps[batch, c][system]) for c in contexts if system in steps[batch, c]]
            if points:
                axis.plot(*zip(*points, strict=True), marker="o", label=system)
        axis.set_xscale("log", base=2)
        axis.set_xticks(contexts, [str(c) for c in contexts])
        axis.set_xlabel("context (prompt tokens)")
        axis.set_ylabel("median decode step (ms)")
        axis.set_title(f"batch {batch}" + (f", {title}" if title else ""), fontsize=10)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv=None) -> int:
    args = parse_args(argv)
    systems = args.systems.split(";")
    error = interleave_error(args) or check_model(args.model, args.dtype)
    if error is not None:
        print(f"bench_context: error: {error}", file=sys.stderr)
        return 2
    rows = []
    for batch in args.batches:
        for context in args.contexts:
            cell = argparse.Namespace(**vars(args), batch=batch, prompt_tokens=context)
            if args.interleave is not None:  # one process, the systems in turns
                [measured] = run_rounds(systems, cell)
            else:
                measured = run_systems(systems, worker_options(cell), f"B={batch} T={context} ")
            for row in measured:
                row.pop("token_ids", None)
                rows.append({**row, "context": context})
    fitted = marginal(rows, systems)
    print("\n".join(table_lines(rows, systems)))
    print("\n".join(["", *marginal_lines(fitted)]))
    if args.plot is not None:
        plot(rows, systems, args.plot, title=f"{args.model}, {args.dtype}")
    report = {
        "benchmark": "context_sweep",
        **{key: value for key, value in vars(args).items() if key != "plot"},
        "plot": str(args.plot) if args.plot else None,
        **environment(args),
        "rows": rows,
        "cells": summary(rows, systems),
        "marginal": fitted,
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
