"""Pool the RULER rows of several runs that differ only in their seed: more samples, one report.

A run's samples are generated from ``options.ruler.seed`` (sample i of a family at a length from
(seed, family, length, i)), so a second run with another seed adds new prompts to the same
points; running the first again with more samples would redo the ones it has. Pooled, a point's
score is the mean over every sample of every run, as if one run had drawn them all. Runs must
agree on everything else that shapes a prompt or a score (the haystack, the prompt format, the
token budget, the dtype); two runs with one seed are the same prompts and are refused.
RULER: https://arxiv.org/abs/2404.06654.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from experiments.tasks.ruler.options import RulerOptions


def _options(config: dict) -> RulerOptions:
    return RulerOptions.read(config.get("options", {}).get("ruler", {}))


def seed_of(config: dict) -> int:
    """The ``options.ruler.seed`` a run's resolved config ran with."""
    return _options(config).seed


def _alike(config: dict) -> dict:
    """What must be equal across pooled runs besides the sweep point (the seed and the sample
    count may differ: that is what pooling is for)."""
    options = _options(config)
    names = ("haystack", "chat", "new_tokens")
    same = {f"options.ruler.{name}": getattr(options, name) for name in names}
    return same | {"runtime.dtype": config.get("runtime", {}).get("dtype")}


def _check(runs: list[tuple[Path, dict]]) -> None:
    """Refuse runs whose prompts overlap or differ in anything but the seed and sample count."""
    first_path, reference = runs[0][0], _alike(runs[0][1])
    seeds: dict[int, Path] = {}
    for path, config in runs:
        seed = seed_of(config)
        if seed in seeds:
            raise ValueError(
                f"{str(seeds[seed])!r} and {str(path)!r} both ran options.ruler.seed={seed}: "
                "the same prompts; pool runs of different seeds"
            )
        seeds[seed] = path
        for name, mine in _alike(config).items():
            if mine != reference[name]:
                raise ValueError(
                    f"{name}={mine!r} in {str(path)!r} but {reference[name]!r} in "
                    f"{str(first_path)!r}: pooled runs must ask the same prompts of one model"
                )


def _merged(rows: list[dict]) -> dict:
    """One row for one point's rows of several runs (each ``per_sample`` record tagged with its
    run's seed already)."""
    metrics = [row["metrics"] for row in rows]
    records = [record for m in metrics for record in m["per_sample"]]
    counts = [m["samples"] for m in metrics]

    def weighted(name: str) -> float:
        return sum(m[name] * n for m, n in zip(metrics, counts, strict=True)) / sum(counts)

    decode_s = sum(m["decode_s"] for m in metrics)
    tokens = sum(m["decode_tokens_per_s"] * m["decode_s"] for m in metrics)
    steps = [m["median_step_ms"] for m in metrics if m.get("median_step_ms") is not None]
    pooled = {
        **metrics[0],
        "score": sum(record["score"] for record in records) / len(records),
        "samples": len(records),
        "kv_device_bytes": weighted("kv_device_bytes"),
        "kv_host_bytes": weighted("kv_host_bytes"),
        "peak_kv_bytes": max(m["peak_kv_bytes"] for m in metrics),
        "decode_tokens_per_s": tokens / decode_s if decode_s else 0.0,
        "decode_s": round(decode_s, 3),
        # Each run's steps are gone: the median of the runs' medians.
        "median_step_ms": statistics.median(steps) if steps else None,
        "load_average": max(m["load_average"] for m in metrics),
        "per_sample": records,
    }
    return {
        **rows[0],
        "metrics": pooled,
        "seconds": sum(row.get("seconds", 0.0) for row in rows),
        "command": " && ".join(row["command"] for row in rows if row.get("command")),
    }


def pool_runs(runs: list[tuple[Path, dict, list[dict]]]) -> list[dict]:
    """The rows of several runs, (folder, resolved ``config.json``, ``results.jsonl`` rows)
    each, as one run's: a ``ruler`` row per point any run measured (its ``per_sample`` records
    tagged with their run's ``seed``; score, samples, bytes and speeds pooled), then every other
    row as it was (``ruler_cost`` runs each system alone: the seed does not matter to it).

    Raises
    ------
    ValueError
        Two runs with one seed, or runs that differ in the haystack, prompt format, token
        budget or dtype (the folder names the run).
    """
    _check([(path, config) for path, config, _ in runs])
    points: dict[str, list[dict]] = {}
    others = []
    for _, config, rows in runs:
        seed = seed_of(config)
        for row in rows:
            if row["point"]["task"] != "ruler":
                others.append(row)
                continue
            tagged = [{**record, "seed": seed} for record in row["metrics"]["per_sample"]]
            row = {**row, "metrics": {**row["metrics"], "per_sample": tagged}}
            points.setdefault(json.dumps(row["point"], sort_keys=True), []).append(row)
    return [_merged(rows) for rows in points.values()] + others
