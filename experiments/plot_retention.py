"""Perplexity vs caching ratio for both retentions, from ``experiments.fidelity`` JSON lines.

    python -m experiments.fidelity --policies dense,swa --ratios 0.5,0.2 > drop.txt
    python -m experiments.fidelity --policies swa --ratios 0.5,0.2,0.1 --retention host > host.txt
    python -m experiments.plot_retention drop.txt host.txt -o docs/figures/retention_perplexity.png

Each input is a fidelity run's output (its last JSON line is read); rows are grouped by policy,
retention and preset (``paper`` rows dotted), for one ``--protocol``. Prints the points it
plotted and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def last_json(path: Path) -> dict:
    """The last line of ``path`` that parses as a JSON object (a fidelity report)."""
    for line in reversed(path.read_text(encoding="utf-8").splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError(f"{path}: no JSON report line (run experiments.fidelity into it)")


def series(
    reports: list[dict], protocol: str = "streaming"
) -> dict[str, list[tuple[float, float]]]:
    """{"swa (host)": [(r, perplexity), ...]} of one protocol over every report; dense as one
    flat line."""
    out: dict[str, list[tuple[float, float]]] = {}
    for report in reports:
        retention = report.get("retention", "drop")
        label = retention + (", paper" if report.get("preset") == "paper" else "")
        for key, value in report["perplexity"].get(protocol, {}).items():
            policy, ratio = key.split("@")
            name = "dense" if policy == "dense" else f"{policy} ({label})"
            out.setdefault(name, []).append((float(ratio), value))
    return {name: sorted(set(points)) for name, points in out.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path)
    parser.add_argument("-o", "--output", type=Path, required=True)
    parser.add_argument("--protocol", default="streaming", help="perplexity protocol to plot")
    parser.add_argument("--policies", default=None, help="comma list to plot (default: all)")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    lines = series([last_json(path) for path in args.reports], args.protocol)
    if args.policies:
        wanted = {"dense", *args.policies.split(",")}
        lines = {name: points for name, points in lines.items() if name.split(" ")[0] in wanted}
    figure, axis = plt.subplots(figsize=(6, 4))
    dense = dict(lines.pop("dense", [])).get(1.0)
    for name, points in sorted(lines.items()):
        ratios, values = zip(*points, strict=True)
        style = ":" if "paper" in name else "--" if "drop" in name else "-"
        axis.plot(ratios, values, marker="o", linestyle=style, label=name)
    if dense is not None:
        axis.axhline(dense, color="black", linewidth=0.8, label=f"dense ({dense:.2f})")
    axis.set_xlabel("caching ratio r (share of tokens attended)")
    axis.set_ylabel("WikiText-2 perplexity (SmolLM2-135M)")
    axis.set_xscale("log")
    axis.set_yscale("log")
    ratios = sorted({r for points in lines.values() for r, _ in points})
    axis.set_xticks(ratios, [f"{r:g}" for r in ratios])
    axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axis.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    axis.yaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
    if args.title:
        axis.set_title(args.title, fontsize=10)
    axis.legend(fontsize=8)
    axis.grid(True, which="both", alpha=0.3)
    figure.tight_layout()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.output, dpi=120)
    for name, points in sorted(lines.items()):
        print(name, " ".join(f"r={r:g}:{v:.2f}" for r, v in points))
    print(json.dumps({"plot": str(args.output), "series": lines, "dense": dense}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
