"""Evaluation tasks for the experiment runner: name -> run(context, point, options) -> metrics.

``context`` gives the loaded model and tokenizer, the data directory and the point's
``AlisaConfig``; every task returns a flat-ish dict of JSON-serialisable metrics.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, fields
from pathlib import Path

from alisa import AlisaConfig
from experiments import data
from experiments.tasks.ruler.options import RulerOptions


@dataclass
class Context:
    """What a task gets besides its options."""

    model: object
    tokenizer: object
    data_root: Path | None  # None: no task of the run reads the data directory
    config: AlisaConfig | None  # None for tasks whose systems build their own (ruler)
    progress: bool = False  # a task may show its own progress (long points)


def perplexity(context: Context, point: dict, options: dict) -> dict:
    """WikiText-2 perplexity under the point's ``protocol`` (a sweep key; else the option, else
    ``streaming``); options ``prefill_share`` and ``segment_tokens``. The protocol is named in
    the row's metrics."""
    from experiments.tasks.perplexity import decode_perplexity, protocol_prefill, text_segments

    segments = text_segments(
        context.tokenizer,
        data.load_wikitext2(context.data_root),
        options.get("segment_tokens", 512),
        point.get("batch", 2),
    )
    protocol = point.get("protocol", options.get("protocol", "streaming"))
    prefill = protocol_prefill(protocol, segments.shape[1], options.get("prefill_share", 0.5))
    result = decode_perplexity(
        context.model, segments, context.config, prefill_tokens=prefill, progress=False
    )
    return {
        "perplexity": result.perplexity,
        "nll": result.nll,
        "tokens": result.tokens,
        "protocol": protocol,
        "prefill_tokens": prefill,
    }


def _retrieval(loader, kind: str):
    def run(context: Context, point: dict, options: dict) -> dict:
        from experiments.tasks.retrieval import retrieval_accuracy

        return retrieval_accuracy(
            context.model,
            context.tokenizer,
            loader(context.data_root),
            context.config,
            kind=kind,
            max_prompt_tokens=options.get("max_prompt_tokens", 2048),
            progress=False,
        )

    return run


def _choice(loader):
    def run(context: Context, point: dict, options: dict) -> dict:
        from experiments.tasks.choice import multiple_choice

        return multiple_choice(
            context.model,
            context.tokenizer,
            loader(context.data_root),
            context.config,
            limit=options.get("limit"),
            progress=False,
        )

    return run


def xsum(context: Context, point: dict, options: dict) -> dict:
    from experiments.tasks.summarize import summarization_rouge

    return summarization_rouge(
        context.model,
        context.tokenizer,
        data.load_xsum(context.data_root),
        context.config,
        limit=options.get("limit", 20),
        max_new_tokens=options.get("max_new_tokens", 64),
        progress=False,
    )


def _analysis_maps(context: Context, options: dict):
    from experiments.tasks.analysis import attention_maps
    from experiments.tasks.perplexity import text_segments

    ids = text_segments(
        context.tokenizer,
        data.load_wikitext2(context.data_root),
        options.get("segment_tokens", 512),
        1,
    )
    return attention_maps(context.model, ids)


def attention_sparsity(context: Context, point: dict, options: dict) -> dict:
    from experiments.tasks.analysis import attention_sparsity as sparsity

    per_layer = sparsity(_analysis_maps(context, options), options.get("threshold", 0.01))
    return {"per_layer": per_layer, "mean": sum(per_layer) / len(per_layer)}


def spearman(context: Context, point: dict, options: dict) -> dict:
    from experiments.tasks.analysis import importance_spearman

    return importance_spearman(
        _analysis_maps(context, options),
        ratio=options.get("ratio", 0.2),
        rows=options.get("rows", 32),
    )


def throughput(context: Context, point: dict, options: dict) -> dict:
    """Generated tokens/s of `alisa batch` under a fixed KV byte budget (``system``: the cache)."""
    from transformers import DynamicCache, QuantizedCache

    from alisa import BatchJob, run_batch
    from alisa.sizes import parse_bytes
    from experiments.worker import prompts_of_length

    batch = point.get("batch", 8)
    prompts = prompts_of_length(
        context.tokenizer,
        data.load_wikitext2(context.data_root),
        options.get("prompt_tokens", 128),
        batch * options.get("waves", 2),
    )
    kv_budget = parse_bytes(options.get("kv_budget", "128MiB"))
    system = point.get("system", "alisa")
    factories = {
        "alisa": None,
        "hf-dynamic": DynamicCache,
        "hf-quantized": lambda: QuantizedCache(
            backend="quanto", config=context.model.config, nbits=4
        ),
    }
    if system not in factories:
        raise ValueError(f"system={system!r} is unknown; valid: {', '.join(factories)}")
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "in.jsonl"
        source.write_text("".join(_row(i, p) for i, p in enumerate(prompts)))
        job = BatchJob(
            input=str(source),
            output=str(Path(folder) / "out.jsonl"),
            config=context.config,
            kv_memory=kv_budget,
            max_new_tokens=options.get("new_tokens", 64),
            max_batch=batch,
            stop_at_eos=False,
            progress=False,
        )
        summary = run_batch(context.model, context.tokenizer, job, cache_factory=factories[system])
    return {
        "tokens_per_s": summary.tokens_per_s,
        "largest_batch": max(summary.batches, default=0),
        "batches": len(summary.batches),
        "ttft_s": summary.mean_ttft_s,
        "peak_kv_bytes": summary.peak_kv_bytes,
        "peak_memory_bytes": summary.peak_memory_bytes,
        "kv_budget_bytes": kv_budget,
    }


def ruler(context: Context, point: dict, options: dict) -> dict:
    """One RULER point alone (the runner groups a point's systems: :data:`SHARED_PREFILL`)."""
    from experiments.tasks.ruler.evaluate import ruler_points

    return ruler_points(context, [point], options)[0]


def ruler_cost(context: Context, point: dict, options: dict) -> dict:
    from experiments.tasks.ruler.evaluate import ruler_cost as cost

    return cost(context, point, options)


def _ruler_points(context: Context, points: list[dict], options: dict) -> list[dict]:
    from experiments.tasks.ruler.evaluate import ruler_points

    return ruler_points(context, points, options)


def _row(index: int, prompt: str) -> str:
    import json

    return json.dumps({"id": index, "prompt": prompt}) + "\n"


def _count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be an integer >= 1")


def _share(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1:
        raise ValueError(f"{name}={value!r} must be a number in (0, 1)")


def _limit(name: str, value: object) -> None:
    if value is not None and value != "none":
        _count(name, value)


def _protocol(name: str, value: object) -> None:
    from experiments.tasks.perplexity import PROTOCOLS

    if value not in PROTOCOLS:
        raise ValueError(f"{name}={value!r} is unknown; valid: {', '.join(PROTOCOLS)}")


def _path(name: str, value: object) -> None:
    if value is not None and value != "none" and not (isinstance(value, str) and value.strip()):
        raise ValueError(f"{name}={value!r} must be a file path")


def _ruler(name: str, value: object) -> None:
    RulerOptions.read({name.rpartition(".")[2]: value})  # its own checks, naming the option


def _size(name: str, value: object) -> None:
    from alisa.sizes import parse_bytes

    parse_bytes(value, field=name)


# The options each task reads (``[options.<task>]``) and the check of each: a key not listed
# would be ignored by the task, so it is an error (a typo must not run the defaults silently).
OPTIONS = {
    "perplexity": {"segment_tokens": _count, "prefill_share": _share, "protocol": _protocol},
    "passkey": {"max_prompt_tokens": _count},
    "niah": {"max_prompt_tokens": _count},
    "piqa": {"limit": _limit},
    "copa": {"limit": _limit},
    "xsum": {"limit": _count, "max_new_tokens": _count},
    "attention_sparsity": {"segment_tokens": _count, "threshold": _share},
    "spearman": {"segment_tokens": _count, "ratio": _share, "rows": _count},
    "throughput": {
        "prompt_tokens": _count,
        "waves": _count,
        "kv_budget": _size,
        "new_tokens": _count,
    },
    "ruler": dict.fromkeys((f.name for f in fields(RulerOptions)), _ruler),
    "ruler_cost": {"new_tokens": _count, "haystack": _path},
}


def check_options(task: str, options: object) -> None:
    """Refuse an ``[options.<task>]`` table with a key the task does not read or a bad value.

    Raises
    ------
    ValueError
        Naming ``options.<task>.<key>`` and the value (or the valid keys).
    """
    if not isinstance(options, dict):
        raise ValueError(f"options.{task}={options!r} must be a table of task options")
    known = OPTIONS[task]
    for key, value in options.items():
        if key not in known:
            valid = ", ".join(known) or "none"
            raise ValueError(f"options.{task}.{key} is unknown to task {task!r}; valid: {valid}")
        known[key](f"options.{task}.{key}", value)


TASKS = {
    "perplexity": perplexity,
    "passkey": _retrieval(data.load_passkey, "passkey"),
    "niah": _retrieval(data.load_niah, "niah"),
    "piqa": _choice(data.load_piqa),
    "copa": _choice(data.load_copa),
    "xsum": xsum,
    "attention_sparsity": attention_sparsity,
    "spearman": spearman,
    "throughput": throughput,
    "ruler": ruler,
    "ruler_cost": ruler_cost,
}
# Tasks whose points differing only in ``system`` run as one group: (context, points, options)
# -> one metrics dict per point (RULER: one prefill serves every system).
SHARED_PREFILL = {"ruler": _ruler_points}
