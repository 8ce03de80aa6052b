"""Experiment configs: TOML with ``--set`` overrides, validated key by key, expanded to points.

A config has ``name``, ``[sweep]`` (lists to take the cartesian product of: ``task``, ``model``,
``batch``, ``system``, ``protocol`` (perplexity only: ``streaming`` or ``prefill``), ``family``
(ruler only: a RULER task family), ``length`` (ruler and ruler_cost: tokens of prompt plus answer)
and any ``AlisaConfig`` field), ``[options.<task>]`` (task settings) and
``[runtime]`` (dtype, threads, data_dir, results_dir). Unknown keys are errors naming the key.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import shlex
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path

import tomllib

from alisa import AlisaConfig
from alisa.assignments import parse_field
from alisa.settings import IgnoredSettingWarning
from experiments.systems import point_overrides

TOP_KEYS = ("name", "sweep", "options", "runtime")
# threads None: alisa.threads picks (the CPUs this process may use, less the busy ones).
RUNTIME_DEFAULTS = {"dtype": "float32", "threads": None, "data_dir": None, "results_dir": "results"}
POINT_KEYS = ("task", "model", "batch", "system", "protocol", "family", "length")
# Tasks whose cache is ``sweep.system``'s, with the point's AlisaConfig fields applied over it
# (``alisa:policy=swa,retention=host`` with ``caching_ratio = [0.2, 0.1]`` is two systems).
SYSTEM_TASKS = ("ruler", "ruler_cost")
# Sweep keys only some tasks read: the others drop them, so they run once, not once per value
# (and a key no task of the sweep reads is refused).
TASK_KEYS = {
    "protocol": ("perplexity",),
    "family": ("ruler",),
    "length": ("ruler", "ruler_cost"),
    "system": (*SYSTEM_TASKS, "throughput"),  # throughput: the cache its batch job runs
}
REQUIRED_KEYS = {"ruler": ("family", "length"), "ruler_cost": ("length",)}
CONFIG_FIELDS = tuple(f.name for f in fields(AlisaConfig))
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class RunConfig:
    """A resolved, validated experiment configuration."""

    name: str
    sweep: dict
    options: dict
    runtime: dict
    # Where it came from, to print commands that reproduce a point (not part of its identity).
    path: str | None = field(default=None, compare=False)
    overrides: tuple[str, ...] = field(default=(), compare=False)

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "sweep": self.sweep,
            "options": self.options,
            "runtime": self.runtime,
        }

    def points(self) -> list[dict]:
        """Every combination of the sweep, dense policies collapsed to r = 1, no token budget
        and ``retention="drop"`` (one run), and an HF system of a :data:`SYSTEM_TASKS` task run
        once whatever AlisaConfig fields the sweep sets."""
        keys = list(self.sweep)
        seen, result = set(), []
        for values in itertools.product(*(self.sweep[k] for k in keys)):
            point = dict(zip(keys, values, strict=True))
            if keeps_every_token(point.get("policy")):  # a budget means nothing to it
                point["caching_ratio"] = 1.0
                if "budget_tokens" in point:
                    point["budget_tokens"] = None
                if point.get("retention") == "host":  # nothing is left out to keep on the host
                    point["retention"] = "drop"
            for name, tasks in TASK_KEYS.items():
                if point["task"] not in tasks:
                    point.pop(name, None)
            system = point.get("system", "alisa")
            if point["task"] in SYSTEM_TASKS and not system.startswith("alisa"):
                for name in CONFIG_FIELDS:  # an HF cache takes none: run it once
                    point.pop(name, None)
            key = point_key(point)
            if key not in seen:
                seen.add(key)
                result.append(point)
        return result

    def collapsed_budgets(self) -> dict:
        """The sweep's budget values (``caching_ratio`` other than 1, ``budget_tokens`` other
        than None) that the policies keeping every token (dense) do not take: they run once,
        at r = 1, while the evicting policies of the sweep take each value. Field -> values."""
        policies = self.sweep.get("policy", [])
        if not any(keeps_every_token(policy) for policy in policies):
            return {}
        dropped = {
            "caching_ratio": [v for v in self.sweep.get("caching_ratio", []) if v != 1.0],
            "budget_tokens": [v for v in self.sweep.get("budget_tokens", []) if v is not None],
            "retention": [v for v in self.sweep.get("retention", []) if v == "host"],
        }
        return {name: values for name, values in dropped.items() if values}

    def unread_keys(self) -> list[str]:
        """The sweep's keys that change no point, one line each: a task key no task of the sweep
        reads (``family`` on a perplexity run), an ``AlisaConfig`` field no point's policy or
        retention reads (``host_bits`` where every point drops; the first point's reason).
        Warned, not refused: ``--set`` can change a config's tasks but cannot remove a key."""
        tasks = self.sweep["task"]
        notes = {
            key: f"sweep.{key} has no effect: only {', '.join(readers)} read it, and "
            f"sweep.task is {tasks}"
            for key, readers in TASK_KEYS.items()
            if key in self.sweep and not set(readers) & set(tasks)
        }
        runs = [p for p in self.points() if p["task"] not in SYSTEM_TASKS]
        said = [(point, _notes(point)) for point in runs]  # each point's config built once
        for name in (k for k in self.sweep if k in CONFIG_FIELDS):
            ours = [
                next((n for n in each if n.startswith(f"{name}=")), None)
                for point, each in said
                if name in point
            ]
            if ours and all(ours):
                notes[name] = f"sweep.{name} has no effect in any point: {ours[0]}"
        return list(notes.values())

    def command(self, point: dict) -> str:
        """The command that runs ``point`` alone (its config, the run's overrides, then every
        key of the point as a one-value sweep)."""
        parts = ["python", "-m", "experiments.run", "--config", self.path or "CONFIG"]
        for item in (*self.overrides, *(_one_value(k, v) for k, v in point.items())):
            parts += ["--set", item]
        return shlex.join(parts)


def keeps_every_token(policy: str | None) -> bool:
    """Whether ``policy`` never evicts (dense), so that no budget applies to it."""
    from alisa.policies import POLICIES

    return policy in POLICIES and not POLICIES[policy].evicts


def _one_value(key: str, value) -> str:
    return f"sweep.{key}=" + ('["none"]' if value is None else json.dumps([value]))


def point_key(point: dict) -> str:
    """Stable identity of a data point (what resumption compares)."""
    return json.dumps(point, sort_keys=True)


def point_config(point: dict) -> AlisaConfig | None:
    """The point's ``AlisaConfig`` (None: a :data:`SYSTEM_TASKS` point, whose systems build their
    own, checked here).

    Raises
    ------
    ValueError
        A configuration or system the point could not run, named.
    """
    if point["task"] == "throughput":
        from experiments.tasks.perplexity import check_throughput_system

        check_throughput_system(point.get("system", "alisa"))
    if point["task"] not in SYSTEM_TASKS:
        return alisa_config(point)
    from experiments.tasks.ruler.shared import check_system

    check_system(point.get("system", "alisa"), point_overrides(point))
    return None


def _notes(point: dict) -> list[str]:
    """What ``AlisaConfig`` says of the point's fields that change nothing."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", IgnoredSettingWarning)
        AlisaConfig(**{k: v for k, v in point.items() if k in CONFIG_FIELDS})
    return [str(w.message) for w in caught if issubclass(w.category, IgnoredSettingWarning)]


def alisa_config(point: dict) -> AlisaConfig:
    """The point's ``AlisaConfig`` (fields not in the point keep their defaults)."""
    with warnings.catch_warnings():
        # A sweep crosses every policy with every value by design (smoke.toml gives dense the
        # others' min_budget_tokens): a setting a point's policy does not read is not a mistake.
        warnings.simplefilter("ignore", IgnoredSettingWarning)
        return AlisaConfig(**{k: v for k, v in point.items() if k in CONFIG_FIELDS})


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Read, override and validate a config file.

    Raises
    ------
    ValueError
        A missing or unparsable file, an unknown key (named), an empty sweep list, a bad value.
    """
    file = Path(path)
    try:
        raw = tomllib.loads(file.read_text(encoding="utf-8-sig"))  # TOML is UTF-8; a BOM is no key
    except OSError as error:
        raise ValueError(f"config {str(file)!r} cannot be read: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"config {str(file)!r} is not UTF-8 text: {error.reason}") from None
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"config {str(file)!r} is not valid TOML: {error}") from None
    for item in overrides or []:
        _apply(raw, item)
    config = _validate(raw, file)
    return RunConfig(
        name=config.name,
        sweep=config.sweep,
        options=config.options,
        runtime=config.runtime,
        path=str(file),
        overrides=tuple(overrides or ()),
    )


def _apply(raw: dict, item: str) -> None:
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise ValueError(f"--set {item!r} must be key=value")
    path = key.strip().split(".")
    if path[0] not in TOP_KEYS:
        raise ValueError(f"--set key {key!r} is unknown; top-level keys: {', '.join(TOP_KEYS)}")
    value = parse_value(text.strip())
    if path[0] == "sweep" and path[-1] in CONFIG_FIELDS and not isinstance(value, list):
        # An AlisaConfig field's values are typed by the field: gpu_memory=2GiB is a size.
        value = [parse_field(AlisaConfig, path[-1], part) for part in text.split(",")]
    elif path[0] == "sweep" and not isinstance(value, list):
        value = [parse_value(part.strip()) for part in text.split(",")]
    target = raw
    for part in path[:-1]:
        target = target.setdefault(part, {})
    target[path[-1]] = value


def parse_value(text: str):
    """A TOML literal (number, bool, string, list), or the text itself when it is none (keys that
    are not ``AlisaConfig`` fields: tasks, models, options, runtime)."""
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return text


def _validate(raw: dict, file: Path) -> RunConfig:
    unknown = sorted(set(raw) - set(TOP_KEYS))
    if unknown:
        raise ValueError(f"config {file}: unknown key(s) {unknown}; valid: {', '.join(TOP_KEYS)}")
    if "name" not in raw:
        held = f"holds only {', '.join(sorted(raw))}" if raw else "holds no settings"
        raise ValueError(f'config {file} {held}: it needs a name (name = "my_run")')
    name = raw["name"]
    # The name is a directory under results_dir: letters, digits, '_', '-', '.' and no leading
    # '.', so that neither '..' nor a path separator can place a run outside it.
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(
            f"config {file}: name={name!r} must be letters, digits, '_', '-' or '.', not "
            "starting with '.' (it names the run's directory under runtime.results_dir)"
        )
    sweep = raw.get("sweep") or {}
    if not sweep:
        raise ValueError(f"config {file}: the sweep is empty (add [sweep] with at least 'task')")
    for key, values in sweep.items():
        if key not in POINT_KEYS and key not in CONFIG_FIELDS:
            raise ValueError(
                f"config {file}: unknown sweep key {key!r}; "
                f"valid: {', '.join(POINT_KEYS + CONFIG_FIELDS)}"
            )
        if not isinstance(values, list):
            sweep[key] = values = [values]
        if not values:
            raise ValueError(f"config {file}: sweep.{key} is an empty list")
        # TOML has no null: "none" in a sweep list means the field's default of None.
        sweep[key] = [None if v == "none" else v for v in values]
    if "task" not in sweep:
        raise ValueError(f"config {file}: the sweep needs 'task'")
    # Tasks import torch: read here, not when the CLI's parser is built.
    from experiments.tasks.perplexity import PROTOCOLS

    for protocol in sweep.get("protocol", []):
        if protocol not in PROTOCOLS:
            raise ValueError(
                f"config {file}: sweep.protocol {protocol!r} is unknown; "
                f"valid: {', '.join(PROTOCOLS)}"
            )
    from experiments.tasks import TASKS, check_options

    for task in sweep["task"]:
        if task not in TASKS:
            raise ValueError(f"config {file}: unknown task {task!r}; valid: {', '.join(TASKS)}")
    _check_sweep_values(sweep, file)
    options = raw.get("options") or {}
    if "protocol" in sweep and "protocol" in (options.get("perplexity") or {}):
        raise ValueError(
            f"config {file}: sweep.protocol {sweep['protocol']} and options.perplexity.protocol "
            f"{options['perplexity']['protocol']!r} both set the protocol; give one"
        )
    for task in options:
        if task not in TASKS:
            raise ValueError(f"config {file}: options for unknown task {task!r}")
        try:
            check_options(task, options[task])
        except ValueError as error:
            raise ValueError(f"config {file}: {error}") from None
    runtime = dict(RUNTIME_DEFAULTS)
    for key, value in (raw.get("runtime") or {}).items():
        if key not in RUNTIME_DEFAULTS:
            raise ValueError(
                f"config {file}: unknown runtime key {key!r}; valid: {', '.join(RUNTIME_DEFAULTS)}"
            )
        runtime[key] = value
    _check_runtime(runtime, file)
    config = RunConfig(name=name, sweep=sweep, options=options, runtime=runtime)
    _check_budgets_apply(config, file)
    for point in config.points():  # every combination must be a valid configuration
        try:
            point_config(point)
        except ValueError as error:
            fields = {k: v for k, v in point.items() if k in CONFIG_FIELDS}
            raise ValueError(f"config {file}: sweep point {fields}: {error}") from None
    return config


def _check_budgets_apply(config: RunConfig, file: Path) -> None:
    """Refuse budget values that no policy of the sweep takes: with only policies that keep
    every token (dense), a ``caching_ratio`` or ``budget_tokens`` would be recorded as r = 1,
    accepted and ignored."""
    policies = config.sweep.get("policy", [])
    if not policies or not all(keeps_every_token(policy) for policy in policies):
        return
    for name, values in config.collapsed_budgets().items():
        shown = ", ".join(map(repr, policies))
        raise ValueError(
            f"config {file}: sweep.{name}={values} has no effect with sweep.policy [{shown}], "
            "which keeps every token (its points run once, at caching_ratio=1.0); drop "
            f"sweep.{name} or add an evicting policy (e.g. swa) to sweep.policy"
        )


def _check_sweep_values(sweep: dict, file: Path) -> None:
    """The sweep keys that are not ``AlisaConfig`` fields (those are checked as configs)."""
    for key in ("batch", "length"):
        for value in sweep.get(key, []):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"config {file}: sweep.{key}={value!r} must be an integer >= 1")
    for key in ("model", "system"):
        for value in sweep.get(key, []):
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"config {file}: sweep.{key}={value!r} must be a string")
    if sweep.get("family"):
        from experiments.tasks.ruler.families import FAMILIES

        for value in sweep["family"]:
            if value not in FAMILIES:
                valid = ", ".join(FAMILIES)
                raise ValueError(
                    f"config {file}: sweep.family {value!r} is unknown; valid: {valid}"
                )
    for task in sweep["task"]:
        missing = [key for key in REQUIRED_KEYS.get(task, ()) if key not in sweep]
        if missing:
            needs = " and ".join(f"sweep.{key}" for key in missing)
            raise ValueError(f"config {file}: task {task!r} needs {needs}")


def _check_runtime(runtime: dict, file: Path) -> None:
    """Types and ranges of the ``[runtime]`` values, each error naming ``runtime.KEY``."""
    from alisa.model.dtypes import DTYPES

    threads = runtime["threads"]
    wrong = isinstance(threads, bool) or not isinstance(threads, int) or threads < 1
    if threads is not None and wrong:
        raise ValueError(f"config {file}: runtime.threads={threads!r} must be an integer >= 1")
    if runtime["dtype"] not in DTYPES:
        raise ValueError(
            f"config {file}: runtime.dtype={runtime['dtype']!r} is unknown; "
            f"valid: {', '.join(DTYPES)}"
        )
    for key in ("data_dir", "results_dir"):
        value = runtime[key]
        if value is not None and not (isinstance(value, str) and value.strip()):
            raise ValueError(f"config {file}: runtime.{key}={value!r} must be a path string")
    if runtime["results_dir"] is None:
        raise ValueError(f"config {file}: runtime.results_dir must be a path string")


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """The runner's flags, shared by ``python -m experiments.run`` and ``alisa experiment``."""
    parser.add_argument("--config", required=True, help="TOML config (experiments/configs/*.toml)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override, e.g. sweep.policy=swa,h2o or runtime.threads=1",
    )
    parser.add_argument(
        "--data-dir", help="evaluation data (overrides runtime.data_dir, as --set does)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
