"""Evaluation tasks for the experiment runner: name -> run(context, point, options) -> metrics,
a flat-ish dict of JSON-serialisable metrics. A task's module is imported when it first runs
(the config checker reads :data:`OPTIONS` without torch)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, fields
from functools import partial
from pathlib import Path

from alisa import AlisaConfig
from alisa.checks import check_optional_int
from experiments.tasks.ruler.options import RulerOptions


@dataclass
class Context:
    """What a task gets besides its options."""

    model: object
    tokenizer: object
    data_root: Path | None  # None: no task of the run reads the data directory
    config: AlisaConfig | None  # None for tasks whose systems build their own (ruler)
    progress: bool = False  # a task may show its own progress (long points)


def _task(where: str):
    """The function ``module:name`` of this package, imported at its first call."""
    module, _, name = where.partition(":")

    def run(*args):
        return getattr(importlib.import_module(f"{__name__}.{module}"), name)(*args)

    return run


TASKS = {
    name: _task(where)
    for name, where in {
        "perplexity": "perplexity:perplexity",
        "passkey": "accuracy:passkey",
        "niah": "accuracy:niah",
        "piqa": "accuracy:piqa",
        "copa": "accuracy:copa",
        "xsum": "accuracy:xsum",
        "attention_sparsity": "perplexity:attention_sparsity",
        "spearman": "perplexity:spearman",
        "throughput": "perplexity:throughput",
        "ruler": "ruler.shared:ruler",
        "ruler_cost": "ruler.shared:ruler_cost",
    }.items()
}
# Tasks whose points differing only in ``system`` run as one group: (context, points, options)
# -> one metrics dict per point (RULER: one prefill serves every system).
SHARED_PREFILL = {"ruler": _task("ruler.shared:ruler_points")}


def _share(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1:
        raise ValueError(f"{name}={value!r} must be a number in (0, 1)")


def _limit(name: str, value: object) -> None:
    check_optional_int(name, None if value == "none" else value, minimum=1)


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


_count = partial(check_optional_int, minimum=1)  # TOML has no null: never None
# The options each task reads (``[options.<task>]``) and the check of each: a key not listed
# would be ignored by the task, so it is an error (a typo must not run the defaults silently).
OPTIONS = {
    "perplexity": {"segment_tokens": _count, "prefill_share": _share, "protocol": _protocol},
    "passkey": {"max_prompt_tokens": _count, "new_tokens": _count},
    "niah": {"max_prompt_tokens": _count, "new_tokens": _count},
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
