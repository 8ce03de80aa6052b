"""Turn a run's ``results.jsonl`` into markdown tables and PNG plots.

    python -m experiments.report results/NAME            # the newest run of NAME
    python -m experiments.report results/NAME/<timestamp>

Writes ``report.md`` and plots (accuracy vs KV sparsity, throughput vs batch, per-layer attention
sparsity; for RULER runs the scores, cost and targets, the NIAH grid heatmaps and score vs r) into
the run directory and prints the markdown; a RULER run's last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from experiments.data import read_jsonl  # noqa: E402

MAIN_METRIC = {
    "perplexity": "perplexity",
    "piqa": "acc",
    "copa": "acc",
    "passkey": "accuracy",
    "niah": "accuracy",
    "xsum": "rougeL",
    "throughput": "tokens_per_s",
}
SERIES_KEYS = ("policy", "kv_bits", "system", "retention", "gpu_memory", "preset", "protocol")


def find_run(path: Path) -> Path:
    """The run directory itself, or the newest run under a results/NAME directory."""
    if (path / "results.jsonl").is_file():
        return path
    runs = (
        sorted(p for p in path.glob("*") if (p / "results.jsonl").is_file())
        if path.is_dir()
        else []
    )
    if not runs:
        raise ValueError(f"no results.jsonl under {str(path)!r}")
    return runs[-1]


def series_name(point: dict) -> str:
    if point.get("system", "alisa") != "alisa":
        return str(point["system"])  # a peer cache: the ALISA options do not apply to it
    parts = [f"{k}={point[k]}" for k in SERIES_KEYS if k in point]
    return ", ".join(parts) or "default"


def metric_table(task: str, rows: list[dict]) -> str:
    """Markdown table: the point keys that vary, then every scalar metric."""
    varying = [
        k
        for k in sorted({k for r in rows for k in r["point"]})
        if k != "task" and len({json.dumps(r["point"].get(k)) for r in rows}) > 1
    ]
    metrics = sorted(
        {k for r in rows for k, v in r["metrics"].items() if isinstance(v, int | float)}
    )
    lines = [
        f"### {task}",
        "",
        "| " + " | ".join(varying + metrics) + " |",
        "|" + "---|" * (len(varying) + len(metrics)),
    ]
    for row in sorted(rows, key=lambda r: [json.dumps(r["point"].get(k)) for k in varying]):
        cells = [str(row["point"].get(k, "")) for k in varying]
        cells += [_fmt(row["metrics"].get(m)) for m in metrics]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def plot_sparsity_curves(task: str, rows: list[dict], folder: Path) -> Path | None:
    metric = MAIN_METRIC.get(task)
    if (
        metric is None
        or task == "throughput"
        or not any("caching_ratio" in r["point"] for r in rows)
    ):
        return None
    lines = defaultdict(list)
    for row in rows:
        sparsity = 100 * (1 - row["point"].get("caching_ratio", 1.0))
        lines[series_name(row["point"])].append((sparsity, row["metrics"][metric]))
    dense = [v for name, values in lines.items() if "policy=dense" in name for _, v in values]
    figure, axis = plt.subplots(figsize=(6, 4))
    for name, values in sorted(lines.items()):
        if "policy=dense" in name:
            continue
        values.sort()
        axis.plot([x for x, _ in values], [y for _, y in values], marker="o", label=name)
    if dense:
        axis.axhline(dense[0], color="black", linestyle="--", label="dense")
    axis.set_xlabel("KV sparsity (%) = 1 - caching ratio")
    axis.set_ylabel(metric)
    if metric == "perplexity":
        axis.set_yscale("log")  # one weak policy would otherwise flatten all the others
    axis.set_title(f"{task}: {metric} vs KV sparsity")
    axis.legend(fontsize=7)
    return _save(figure, folder / f"{task}_vs_sparsity.png")


def plot_throughput(rows: list[dict], folder: Path) -> Path:
    lines = defaultdict(list)
    for row in rows:
        lines[series_name(row["point"])].append(
            (row["point"].get("batch", 1), row["metrics"]["tokens_per_s"])
        )
    figure, axis = plt.subplots(figsize=(6, 4))
    for name, values in sorted(lines.items()):
        values.sort()
        axis.plot([x for x, _ in values], [y for _, y in values], marker="o", label=name)
    axis.set_xlabel("requested batch")
    axis.set_ylabel("generated tokens/s")
    axis.set_title("throughput vs batch under a fixed memory budget")
    axis.legend(fontsize=7)
    return _save(figure, folder / "throughput_vs_batch.png")


def plot_layer_sparsity(rows: list[dict], folder: Path) -> Path:
    values = [r["metrics"]["per_layer"] for r in rows]
    figure, axis = plt.subplots(figsize=(8, 1.2 + 0.4 * len(values)))
    image = axis.imshow(values, aspect="auto", cmap="viridis", vmin=0, vmax=1)
    axis.set_xlabel("layer")
    axis.set_yticks(range(len(values)), [series_name(r["point"]) for r in rows], fontsize=7)
    axis.set_title("share of attention weights below 1 % of the row maximum")
    figure.colorbar(image, ax=axis)
    return _save(figure, folder / "attention_sparsity_per_layer.png")


def _save(figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


RULER_TASKS = ("ruler", "ruler_cost")  # one section for both (experiments.tasks.ruler.report)


def build_report(folder: Path) -> str:
    """``report.md`` (returned) and the plots of a run; a run with RULER rows also writes
    ``summary.json`` (what :func:`main` prints as its last line)."""
    return _build(folder)[0]


def _build(folder: Path) -> tuple[str, dict | None]:
    rows = read_jsonl(folder / "results.jsonl")
    by_task = defaultdict(list)
    for row in rows:
        if row["point"]["task"] not in RULER_TASKS:
            by_task[row["point"]["task"]].append(row)
    config = json.loads((folder / "config.json").read_text())
    env = json.loads((folder / "env.json").read_text())
    sections = [
        f"# {config['name']}",
        "",
        f"{len(rows)} points; torch {env['torch']}, transformers {env['transformers']}, "
        f"{env['cpu']} x{env['cpu_count']} ({env['threads']} threads), "
        f"GPU: {env['gpu'] or 'none'}, "
        f"commit {str(env['git_commit'])[:10]}",
        "",
    ]
    for task, task_rows in sorted(by_task.items()):
        sections += [metric_table(task, task_rows), ""]
        plots = []
        if task == "throughput":
            plots.append(plot_throughput(task_rows, folder))
        elif task == "attention_sparsity":
            plots.append(plot_layer_sparsity(task_rows, folder))
        else:
            plots.append(plot_sparsity_curves(task, task_rows, folder))
        sections += [f"![{p.stem}]({p.name})" for p in plots if p is not None] + [""]
    summary = None
    ruler = [row for row in rows if row["point"]["task"] in RULER_TASKS]
    if ruler:
        from experiments.tasks.ruler.report import section

        text, summary = section(ruler, folder, expected=_ruler_points(config))
        sections.append(text)
        (folder / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    text = "\n".join(sections)
    (folder / "report.md").write_text(text)
    return text, summary


def _ruler_points(config: dict) -> int | None:
    """How many ``ruler`` points the run's config asks for (None: a config without a sweep)."""
    from experiments.runconfig import RunConfig

    try:
        points = RunConfig(**config).points()
    except (TypeError, KeyError, ValueError):
        return None
    return sum(1 for point in points if point["task"] == "ruler")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="experiments.report", description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    args = parser.parse_args(argv)
    try:
        folder = find_run(args.path)
        text, summary = _build(folder)
        print(text)
        if summary is not None:
            print(json.dumps(summary))  # the last line: every figure, for scripts
    except ValueError as error:
        print(f"experiments.report: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
