"""Turn a run's ``results.jsonl`` into markdown tables and PNG plots.

    python -m experiments.report results/NAME            # the newest run of NAME
    python -m experiments.report results/NAME/<timestamp>
    python -m experiments.report RUN RUN ... --out DIR    # RULER runs of different seeds, pooled

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

from experiments.data import REPO_ROOT, read_jsonl
from experiments.extras import pyplot, save_figure
from experiments.flags import markdown_table
from experiments.tasks.ruler.pool import pool_runs, seed_of

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
    cells = [
        [str(row["point"].get(k, "")) for k in varying]
        + [_fmt(row["metrics"].get(m)) for m in metrics]
        for row in sorted(rows, key=lambda r: [json.dumps(r["point"].get(k)) for k in varying])
    ]
    return "\n".join([f"### {task}", "", *markdown_table(varying + metrics, cells)])


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def sparsity_lines(task: str, rows: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """{series: [(KV sparsity %, the task's main metric), ...]} sorted, one series per
    :func:`series_name`; empty for a task without a main metric or a caching ratio."""
    swept = any("caching_ratio" in row["point"] for row in rows)
    if task not in MAIN_METRIC or task == "throughput" or not swept:
        return {}
    metric = MAIN_METRIC[task]
    lines = defaultdict(list)
    for row in rows:
        sparsity = 100 * (1 - row["point"].get("caching_ratio", 1.0))
        lines[series_name(row["point"])].append((sparsity, row["metrics"][metric]))
    return {name: sorted(points) for name, points in lines.items()}


def plot_sparsity_curves(task: str, rows: list[dict], folder: Path) -> Path | None:
    """The task's main metric vs KV sparsity, a policy that keeps every token as one flat line."""
    lines = sparsity_lines(task, rows)
    if not lines:
        return None
    dense = [v for name, points in lines.items() if "policy=dense" in name for _, v in points]
    metric = MAIN_METRIC[task]
    return _plot(
        {name: points for name, points in lines.items() if "policy=dense" not in name},
        folder / f"{task}_vs_sparsity.png",
        labels=("KV sparsity (%) = 1 - caching ratio", metric, f"{task}: {metric} vs KV sparsity"),
        log=metric == "perplexity",  # one weak policy would otherwise flatten all the others
        dense=dense[0] if dense else None,
    )


def plot_throughput(rows: list[dict], folder: Path) -> Path:
    lines = defaultdict(list)
    for row in rows:
        point = row["point"]
        lines[series_name(point)].append((point.get("batch", 1), row["metrics"]["tokens_per_s"]))
    title = "throughput vs batch under a fixed memory budget"
    labels = ("requested batch", "generated tokens/s", title)
    return _plot(lines, folder / "throughput_vs_batch.png", labels=labels)


def _plot(lines: dict, path: Path, *, labels: tuple, log=False, dense=None) -> Path:
    """One line per series of (x, y) points; ``labels`` are the x axis', the y axis' and the
    title; ``dense`` a horizontal reference line."""
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(6, 4))
    for name, points in sorted(lines.items()):
        points = sorted(points)
        axis.plot([x for x, _ in points], [y for _, y in points], marker="o", label=name)
    if dense is not None:
        axis.axhline(dense, color="black", linestyle="--", label="dense")
    axis.set_xlabel(labels[0])
    axis.set_ylabel(labels[1])
    axis.set_title(labels[2])
    if log:
        axis.set_yscale("log")
    axis.legend(fontsize=7)
    return save_figure(figure, path)


def plot_layer_sparsity(rows: list[dict], folder: Path) -> Path:
    plt = pyplot()
    values = [r["metrics"]["per_layer"] for r in rows]
    figure, axis = plt.subplots(figsize=(8, 1.2 + 0.4 * len(values)))
    image = axis.imshow(values, aspect="auto", cmap="viridis", vmin=0, vmax=1)
    axis.set_xlabel("layer")
    axis.set_yticks(range(len(values)), [series_name(r["point"]) for r in rows], fontsize=7)
    axis.set_title("share of attention weights below 1 % of the row maximum")
    figure.colorbar(image, ax=axis)
    return save_figure(figure, folder / "attention_sparsity_per_layer.png")


RULER_TASKS = ("ruler", "ruler_cost")  # one section for both (experiments.tasks.ruler.report)


def _environment(env: dict) -> str:
    # Runs recorded before the CPU's capability was (alisa.record) show without it.
    capability = f" {env['cpu_capability']}" if env.get("cpu_capability") else ""
    return (
        f"torch {env['torch']}, transformers {env['transformers']}, "
        f"{env['cpu']}{capability} x{env['cpu_count']} ({env['threads']} threads), "
        f"GPU: {env['gpu'] or 'none'}, commit {str(env['git_commit'])[:10]}"
    )


def _build(folders: list[Path], out: Path) -> tuple[str, dict | None]:
    """The report of one run, or of several RULER runs' rows pooled (written into ``out``)."""
    runs = [
        (
            folder,
            json.loads((folder / "config.json").read_text()),
            read_jsonl(folder / "results.jsonl"),
        )
        for folder in folders
    ]
    config = runs[0][1]
    rows = runs[0][2] if len(runs) == 1 else pool_runs(runs)
    out.mkdir(parents=True, exist_ok=True)
    by_task = defaultdict(list)
    for row in rows:
        if row["point"]["task"] not in RULER_TASKS:
            by_task[row["point"]["task"]].append(row)
    envs = [json.loads((folder / "env.json").read_text()) for folder in folders]
    sections = [f"# {config['name']}", "", f"{len(rows)} points; {_environment(envs[0])}", ""]
    if len(runs) > 1:
        sections[2] = f"{len(rows)} points pooled from {len(runs)} runs:"
        sections[3:3] = [
            f"- `{folder}` (options.ruler.seed={seed_of(run_config)}): {_environment(env)}"
            for (folder, run_config, _), env in zip(runs, envs, strict=True)
        ] + ["", f"Samples per point: {_sample_counts(rows)}", ""]
    for task, task_rows in sorted(by_task.items()):
        sections += [metric_table(task, task_rows), ""]
        plots = []
        if task == "throughput":
            plots.append(plot_throughput(task_rows, out))
        elif task == "attention_sparsity":
            plots.append(plot_layer_sparsity(task_rows, out))
        else:
            plots.append(plot_sparsity_curves(task, task_rows, out))
        sections += [f"![{p.stem}]({p.name})" for p in plots if p is not None] + [""]
    summary = None
    ruler = [row for row in rows if row["point"]["task"] in RULER_TASKS]
    if ruler:
        from experiments.tasks.ruler.report import section

        partial = _partial(config, ruler) if len(runs) == 1 else None
        text, summary = section(ruler, out, partial=partial, runs=len(runs))
        sections.append(text)
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    text = "\n".join(sections)
    (out / "report.md").write_text(text)
    return text, summary


def _partial(config: dict, rows: list[dict]) -> str | None:
    """Why a run is not its config's whole RULER report (None: it is): points not written yet,
    or, for a config shipped as ``experiments/configs/NAME.toml``, a narrower sweep or fewer
    samples than that file asks (a run of some families with ``--set`` is not the report)."""
    from experiments.runconfig import RunConfig, load_config
    from experiments.tasks.ruler.options import RulerOptions

    def ruler_points(run: RunConfig) -> int:
        return sum(1 for point in run.points() if point["task"] == "ruler")

    def samples(options: dict) -> int:
        return RulerOptions.read(options.get("ruler", {})).samples

    done = sum(1 for row in rows if row["point"]["task"] == "ruler")
    try:
        asked = ruler_points(RunConfig(**config))
    except (TypeError, KeyError, ValueError):
        return None
    if done < asked:
        return f"{done} of {asked} ruler points"
    shipped = REPO_ROOT / "experiments" / "configs" / f"{config['name']}.toml"
    if not shipped.is_file():
        return None
    full = load_config(shipped)
    full_points = ruler_points(full)
    if asked < full_points:
        return f"{asked} of {shipped.name}'s {full_points} ruler points"
    ran, full_samples = samples(config.get("options", {})), samples(full.options)
    if ran < full_samples:
        return f"{ran} of {shipped.name}'s {full_samples} samples a point"
    return None


def _sample_counts(rows: list[dict]) -> str:
    """``length family: samples`` of the pooled ``ruler`` points (a point some runs did not
    measure has fewer samples; systems of one point differing show as ``10-20``)."""
    counts = defaultdict(set)
    for row in rows:
        if row["point"]["task"] == "ruler":
            counts[(row["point"]["length"], row["point"]["family"])].add(row["metrics"]["samples"])
    return "; ".join(
        f"{length} {family}: {min(n)}" + (f"-{max(n)}" if len(n) > 1 else "")
        for (length, family), n in sorted(counts.items())
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="experiments.report", description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, nargs="+", help="a run, or results/NAME (its newest)")
    parser.add_argument(
        "--out",
        type=Path,
        help="folder for the report of several runs pooled (required with more than one path)",
    )
    args = parser.parse_args(argv)
    try:
        folders = [find_run(path) for path in args.path]
        if len(folders) > 1 and args.out is None:
            raise ValueError(f"{len(folders)} runs given: --out names the pooled report's folder")
        if len(folders) == 1 and args.out is not None:
            raise ValueError(f"--out={str(args.out)!r} is for several runs pooled; one was given")
        text, summary = _build(folders, args.out if args.out is not None else folders[0])
        print(text)
        if summary is not None:
            print(json.dumps(summary))  # the last line: every figure, for scripts
    except ValueError as error:
        print(f"experiments.report: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
