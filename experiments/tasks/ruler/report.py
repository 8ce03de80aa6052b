"""The RULER report of a run: scores by family x length x system, cost, targets, figures.

Scores are RULER's string-match recall (https://arxiv.org/abs/2404.06654) in [0, 1]; the share of
dense is a system's score over the dense system's (``hf-dynamic``) at the same family, length and
batch. Bytes are per sequence. The targets are issue 29's: host retention at r = 0.1 keeps
>= 0.90 of dense's score on every task dense scores >= 0.5 on, >= 0.80 at r = 0.05, finds every
grid needle dense finds, and a whole report runs in under two hours.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from alisa import AlisaConfig
from alisa.sizes import format_bytes
from experiments.extras import bench_module, pyplot, save_figure
from experiments.flags import markdown_table
from experiments.systems import changed_settings, parse_alisa

DENSE = "hf-dynamic"
HOLDS = 0.5  # dense must score at least this for a task to count in the share targets
TIME_TARGET_S = 2 * 3600
# The settings every label names in its own words.
_LABELLED = ("policy", "retention", "caching_ratio", "kv_bits")


@dataclass(frozen=True, kw_only=True)
class System:
    """What the report reads from a system's name (``config`` None: an HF cache)."""

    name: str
    config: AlisaConfig | None

    @classmethod
    def of(cls, name: str) -> System:
        alisa = name == "alisa" or name.startswith("alisa:")
        return cls(name=name, config=parse_alisa(name) if alisa else None)

    @property
    def label(self) -> str:
        """``dense``, ``swa drop r=0.1``, ``swa host r=0.1 INT8``, then the :attr:`others`
        (``swa host r=0.1 estimate_rest=True``): two systems never share a column name."""
        if self.config is None:
            return "dense" if self.name == DENSE else self.name
        config = self.config
        bits = f" INT{config.kv_bits}" if config.kv_bits != 16 else ""
        if config.policy == "dense":
            label = f"alisa dense{bits}"
        else:
            label = f"{config.policy} {config.retention} r={config.caching_ratio:g}{bits}"
        return " ".join([label, *self.others])

    @property
    def others(self) -> list[str]:
        """``name=value`` of the settings besides policy, retention, r and bits that differ from
        the defaults."""
        if self.config is None:
            return []
        settings = changed_settings(self.config)
        return [s for s in settings if s.partition("=")[0] not in _LABELLED]

    def is_host(self, ratio: float) -> bool:
        """Whether this is SWA host retention at r = ``ratio``, every other setting at its
        default (the system the targets name: not, say, the same r with ``estimate_rest``)."""
        config = self.config
        return (
            config is not None
            and not self.others
            and (config.retention, config.policy) == ("host", "swa")
            and (config.caching_ratio, config.kv_bits) == (ratio, 16)
        )


def _key(row: dict) -> tuple:
    point = row["point"]
    return point.get("model", ""), point.get("batch", 1), point["length"]


def score_table(rows: list[dict]) -> dict:
    """{(model, batch, length, family): {system: metrics}} of the ``ruler`` rows."""
    table: dict = defaultdict(dict)
    for row in rows:
        if row["point"]["task"] == "ruler":
            metrics = {**row["metrics"], "command": row.get("command")}
            table[(*_key(row), row["point"]["family"])][row["metrics"]["system"]] = metrics
    return table


def share(scores: dict, system: str) -> float | None:
    """``system``'s score over dense's (None: no dense row, or dense scored 0)."""
    dense = scores.get(DENSE, {}).get("score")
    if not dense or system not in scores:
        return None
    return scores[system]["score"] / dense


def _host(scores: dict, ratio: float) -> str | None:
    return next((s for s in scores if System.of(s).is_host(ratio)), None)


def targets(rows: list[dict], partial: str | None = None, runs: int = 1) -> dict:
    """Issue 29's targets on what the run measured (None where it measured nothing). The time
    target is not judged (its seconds still given) for a ``partial`` run (points missing, a
    narrower sweep or fewer samples than its config file: why) nor for several ``runs`` pooled."""
    table = score_table(rows)
    result = {}
    for ratio, floor in ((0.1, 0.90), (0.05, 0.80)):
        below, counted = [], 0
        for key, scores in sorted(table.items()):
            host = _host(scores, ratio)
            if key[3] == "niah_grid" or scores.get(DENSE, {}).get("score", 0) < HOLDS or not host:
                continue
            counted += 1
            value = share(scores, host)
            if value < floor:
                below.append({"family": key[3], "length": key[2], "share": round(value, 3)})
        met = None if counted == 0 else not below
        result[f"host_r{ratio:g}_share_ge_{floor:g}"] = {
            "met": met,
            "tasks": counted,
            "below": below,
        }
    misses, cells = [], 0
    for key, scores in sorted(table.items()):
        host = _host(scores, 0.1)
        if key[3] != "niah_grid" or host is None or DENSE not in scores:
            continue
        dense = {_sample(r): r for r in scores[DENSE]["per_sample"]}
        for record in scores[host]["per_sample"]:
            if dense[_sample(record)]["score"] == 1.0:
                cells += 1
                if record["score"] < 1.0:
                    misses.append({"length": key[2], "depth": record["depths"][0]})
    grid = {"met": None if cells == 0 else not misses, "cells": cells, "missed": misses}
    result["grid_host_r0.1_finds_what_dense_finds"] = grid
    seconds = sum(row.get("seconds", 0.0) for row in rows)
    why = {"partial": partial} if partial is not None else {}
    why = {"pooled_runs": runs} if runs > 1 else why
    met = None if why else seconds < TIME_TARGET_S
    result["run_under_2h"] = {"met": met, "seconds": round(seconds, 1), **why}
    return result


def _sample(record: dict) -> tuple:
    """A sample's identity: its index, and its run's seed in a pooled report (:mod:`.pool`)."""
    return record.get("seed"), record["index"]


def _bytes(value: float | None) -> str:
    return "" if value is None else format_bytes(value)


def _system_key(name: str) -> tuple:
    """Dense first, then the alisa systems (by retention, SWA first, policy, r descending,
    bits), then the other HF caches."""
    config = System.of(name).config
    if config is None:
        return name != DENSE, True, ()
    order = (config.retention, config.policy != "swa", config.policy, -config.caching_ratio)
    return name != DENSE, False, (*order, config.kv_bits)


def _systems(table: dict) -> list[str]:
    # First seen first among equal keys (a set's order would change from run to run).
    seen = dict.fromkeys(system for scores in table.values() for system in scores)
    return sorted(seen, key=_system_key)


def markdown_scores(rows: list[dict]) -> str:
    """Score per family x length (rows) and system (columns), share of dense in parentheses;
    model and batch columns only when they vary."""
    table = score_table(rows)
    systems = _systems(table)
    shown = [i for i in (0, 1) if len({key[i] for key in table}) > 1] + [2, 3]
    names = [("model", "batch", "length", "family")[i] for i in shown]
    lines = []
    for key, scores in sorted(table.items()):
        cells = [str(key[i]) for i in shown]
        for system in systems:
            ratio = share(scores, system)
            if system not in scores:
                cells.append("")
            elif system == DENSE or ratio is None:
                cells.append(f"{scores[system]['score']:.2f}")
            else:
                cells.append(f"{scores[system]['score']:.2f} ({ratio:.2f})")
        lines.append(cells)
    return "\n".join(markdown_table(names + [System.of(system).label for system in systems], lines))


def cost_rows(rows: list[dict]) -> dict:
    """{(model, batch, length, system): cost}: KV bytes and decode speed from the ``ruler`` rows
    (per sequence, means over the families), peak memory and speed alone from ``ruler_cost``."""
    merged: dict = defaultdict(lambda: {"steps": [], "device": [], "host": []})
    for row in rows:
        if row["point"]["task"] != "ruler":
            continue
        metrics = row["metrics"]
        entry = merged[(*_key(row), metrics["system"])]
        if metrics.get("median_step_ms"):
            entry["steps"].append(metrics["median_step_ms"])
        entry["device"].append(metrics["kv_device_bytes"])
        entry["host"].append(metrics["kv_host_bytes"])
    for row in rows:
        if row["point"]["task"] != "ruler_cost":
            continue
        metrics = row["metrics"]
        entry = merged[(*_key(row), metrics["system"])]
        entry["alone"] = {**metrics, "command": row.get("command")}
        tiers = metrics.get("kv_tier_bytes")
        if not entry["device"] and tiers:  # no RULER rows at this length: the bytes alone
            entry["device"].append(tiers.get("device", 0))
            entry["host"].append(tiers.get("host", 0))
    return merged


def markdown_cost(rows: list[dict]) -> str:
    """Per system and length: KV bytes per tier (per sequence), the device share of dense's,
    peak memory and decode speed alone, the median over families of the median decode step
    within the RULER run, the command."""
    merged = cost_rows(rows)
    lines = []
    for key in sorted(merged, key=lambda k: (k[:3], _system_key(k[3]))):
        model, batch, length, system = key
        entry = merged[key]
        device = _mean(entry["device"])
        dense = _mean(merged.get((model, batch, length, DENSE), {}).get("device", []))
        alone = entry.get("alone", {})
        step = statistics.median(entry["steps"]) if entry["steps"] else None
        lines.append(
            [
                *(model, str(batch), str(length), System.of(system).label),
                *(_bytes(device), _bytes(_mean(entry["host"]))),
                f"{device / dense:.2f}" if device is not None and dense else "",
                _bytes(alone.get("peak_rss_bytes")),
                f"{alone['decode_tokens_per_s']:.1f}" if alone else "",
                f"{step:.0f} ms" if step else "",
                f"`{alone['command']}`" if alone.get("command") else "",
            ]
        )
    header = "model | batch | length | system | device KV | host KV | device KV / dense | "
    header += "peak RSS alone | decode tok/s alone | decode step, RULER run | command (alone)"
    return "\n".join(markdown_table(header.split(" | "), lines))


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def markdown_targets(result: dict) -> str:
    """The targets as a table: measured, met or not."""
    lines = []
    for name, outcome in result.items():
        met = {None: "not measured", True: "yes", False: "**no**"}[outcome["met"]]
        if "partial" in outcome:
            met = "not judged: partial run"
        if "pooled_runs" in outcome:
            met = "not judged: pooled runs"
        details = {k: v for k, v in outcome.items() if k != "met"}
        lines.append([name, str(details), met])
    return "\n".join(markdown_table(["target", "measured", "met"], lines))


def plot_grid(rows: list[dict], folder: Path) -> Path | None:
    """Heatmaps of the ``niah_grid`` rows: needle depth x length, one panel per system."""
    table = {k: v for k, v in score_table(rows).items() if k[3] == "niah_grid"}
    if not table:
        return None
    systems = _systems(table)
    lengths = sorted({key[2] for key in table})
    figure, axes = pyplot().subplots(
        1, len(systems), figsize=(3.2 * len(systems), 3.4), squeeze=False
    )
    for axis, system in zip(axes[0], systems, strict=True):
        cells: dict = defaultdict(list)  # pooled runs: several samples a cell, their mean
        for key, scores in table.items():
            for record in scores.get(system, {}).get("per_sample", []):
                cells[(round(record["depths"][0], 1), key[2])].append(record["score"])
        depths = sorted({depth for depth, _ in cells})
        grid = [
            [_mean(cells[(d, n)]) if (d, n) in cells else float("nan") for n in lengths]
            for d in depths
        ]
        axis.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto", origin="upper")
        axis.set_xticks(range(len(lengths)), [f"{n // 1024}K" if n >= 1024 else n for n in lengths])
        axis.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=7)
        axis.set_xlabel("length (tokens)")
        axis.set_title(System.of(system).label, fontsize=9)
    axes[0][0].set_ylabel("needle depth")
    return save_figure(figure, folder / "ruler_niah_grid.png")


def plot_vs_ratio(rows: list[dict], folder: Path) -> list[Path]:
    """Score vs r per family (one panel each), one figure per length: SWA host and drop lines,
    the other drop policies as points, dense as a dashed line."""
    table = {k: v for k, v in score_table(rows).items() if k[3] != "niah_grid"}
    paths = []
    for length in sorted({key[2] for key in table}):
        keys = sorted(key for key in table if key[2] == length)
        figure, axes = pyplot().subplots(
            1, len(keys), figsize=(2.6 * len(keys), 2.8), squeeze=False
        )
        for axis, key in zip(axes[0], keys, strict=True):
            _panel(axis, table[key], key[3])
        axes[0][0].set_ylabel("RULER score")
        axes[0][-1].legend(fontsize=6, loc="lower right")
        figure.suptitle(f"{keys[0][0]}, {length} tokens: score vs caching ratio r", fontsize=9)
        paths.append(save_figure(figure, folder / f"ruler_vs_ratio_{length}.png"))
    return paths


def _panel(axis, scores: dict, title: str) -> None:
    lines: dict = defaultdict(list)
    for name, metrics in scores.items():
        system = System.of(name)
        config = system.config
        if config is None or config.policy == "dense":
            continue
        bits = f" INT{config.kv_bits}" if config.kv_bits != 16 else ""
        # One line per setting, r along it: other settings make their own line.
        series = " ".join([f"{config.policy} {config.retention}{bits}", *system.others])
        lines[series].append((config.caching_ratio, metrics["score"]))
    for series, points in sorted(lines.items()):
        points.sort()
        style = "-o" if len(points) > 1 else "s"
        axis.plot([x for x, _ in points], [y for _, y in points], style, label=series, ms=4)
    if DENSE in scores:
        axis.axhline(scores[DENSE]["score"], color="black", linestyle="--", label="dense")
    axis.set_xscale("log")
    # Ticks at the ratios run, written plainly: over a narrow span (0.05-0.1) a log axis labels
    # its minor ticks in scientific notation, one over another.
    ratios = sorted({x for points in lines.values() for x, _ in points})
    if ratios:
        axis.set_xticks(ratios, [f"{ratio:g}" for ratio in ratios], fontsize=7)
        axis.xaxis.set_minor_formatter(bench_module("matplotlib.ticker").NullFormatter())
    axis.set_ylim(-0.05, 1.05)
    axis.set_xlabel("r", fontsize=8)
    axis.set_title(title, fontsize=9)


def summary(rows: list[dict], partial: str | None = None, runs: int = 1) -> dict:
    """What the report's JSON line carries: every score, the targets, the run's seconds."""
    scores = {
        f"{key[0]}|b{key[1]}|{key[2]}|{key[3]}": {
            System.of(s).label: round(m["score"], 4) for s, m in systems.items()
        }
        for key, systems in sorted(score_table(rows).items())
    }
    return {"benchmark": "ruler", "scores": scores, "targets": targets(rows, partial, runs)}


def section(
    rows: list[dict], folder: Path, partial: str | None = None, runs: int = 1
) -> tuple[str, dict]:
    """The markdown section of a run's RULER rows (figures written beside it) and its summary
    (``runs``: how many runs the rows were pooled from)."""
    parts = ["## RULER", "", "Score (RULER string match, 0-1; share of dense in parentheses):", ""]
    parts += [markdown_scores(rows), "", "Cost (per sequence):", "", markdown_cost(rows), ""]
    parts += ["Targets:", "", markdown_targets(targets(rows, partial, runs)), ""]
    figures = [plot_grid(rows, folder), *plot_vs_ratio(rows, folder)]
    parts += [f"![{path.stem}]({path.name})" for path in figures if path is not None]
    return "\n".join(parts) + "\n", summary(rows, partial, runs)
