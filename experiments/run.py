"""Run an experiment sweep: ``python -m experiments.run --config experiments/configs/NAME.toml``.

Results go to ``results/NAME/<timestamp>/``: ``config.json`` (resolved), ``env.json`` (versions,
CPU/GPU, threads, git commit) and ``results.jsonl``, one row per data point appended atomically.
Running the same config again resumes the newest run with that exact configuration: finished
points are skipped, and a run killed with ``kill -9`` loses and duplicates nothing. Under
``torchrun --nproc-per-node N -m experiments.run ...`` the points are spread over the ranks and
merged into the one ``results.jsonl`` at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm.auto import tqdm

from alisa.jobs.distributed import (
    RankError,
    RankProgress,
    Ranks,
    finish_parts,
    from_rank0,
    launched,
    new_parts,
    process_group,
)
from alisa.jobs.io import OutputLog
from alisa.jobs.lock import locked
from alisa.jobs.parts import merge_parts, part_path, parts_dir, share
from alisa.logs import log_to_stderr
from alisa.threads import use_threads
from experiments.data import data_dir
from experiments.runconfig import (
    CONFIG_FIELDS,
    SYSTEM_TASKS,
    RunConfig,
    add_run_options,
    load_config,
    point_config,
    point_key,
)
from experiments.timing import environment

PROG = "experiments.run"  # how its messages start when run as a module


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    add_run_options(parser)
    return parser.parse_args(argv)


@contextmanager
def run_directory(config: RunConfig) -> Iterator[tuple[Path, bool]]:
    """(folder, created): the newest run with exactly this configuration, or a new one, locked
    for the ``with`` block (one run writes a folder at a time).

    Raises
    ------
    ValueError
        Another run is writing that folder, or the results directory cannot be written.
    """
    root = Path(config.runtime["results_dir"]) / config.name
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(
            f"results directory {str(root)!r} cannot be created: {error.strerror}"
        ) from None
    with ExitStack() as held:
        # One run at a time finds or starts its folder (a moment): a second run of this
        # config then finds the first one's folder, locked, and is refused.
        with locked(root):
            folder, created = _find_or_start(config, root, held)
        yield folder, created


def _find_or_start(config: RunConfig, root: Path, held: ExitStack) -> tuple[Path, bool]:
    """The run folder, its lock entered into ``held``; whether it was made now."""
    resolved = config.as_dict()
    for previous in sorted(root.iterdir(), reverse=True):
        saved = previous / "config.json"
        if saved.is_file() and json.loads(saved.read_text()) == resolved:
            held.enter_context(locked(previous, _busy(previous)))
            return previous, False
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    folder = root / stamp
    suffix = 1
    while folder.exists():  # never overwrite a run started in the same second
        folder, suffix = root / f"{stamp}-{suffix}", suffix + 1
    try:
        folder.mkdir()
        held.enter_context(locked(folder, _busy(folder)))
        (folder / "config.json").write_text(json.dumps(resolved, indent=2) + "\n")
        (folder / "env.json").write_text(
            json.dumps(environment(torch.get_num_threads()), indent=2) + "\n"
        )
    except OSError as error:
        raise ValueError(
            f"results directory {str(folder)!r} is not writable: {error.strerror}"
        ) from None
    return folder, True


def _busy(folder: Path) -> str:
    return (
        f"another experiment run is writing {str(folder)!r} (the same configuration); wait for "
        "it to finish or stop it, or change the config (nothing was changed)"
    )


RESULT_KEYS = ("id", "point")  # what every row of results.jsonl has


def run(config: RunConfig, progress: bool = True, *, prog: str = PROG) -> Path:
    """Run every pending point of ``config``; returns the run directory. Its warnings start
    with ``prog`` (the command the user typed).

    Under torchrun every rank runs the points it owns (a stable hash of the point's key) into
    ``results.jsonl.parts/rank-K.jsonl``; rank 0 merges them into ``results.jsonl`` at the end.
    """
    for task in sorted(set(config.options) - set(config.sweep["task"])):
        print(
            f"{prog}: warning: options.{task} has no effect: task {task!r} is not in "
            f"sweep.task ({', '.join(config.sweep['task'])})",
            file=sys.stderr,
        )
    for name, values in config.collapsed_budgets().items():
        print(
            f"{prog}: note: sweep.{name} {values} applies to the evicting policies; "
            "a policy that keeps every token (dense) runs once, recorded at caching_ratio=1.0 "
            "and retention='drop'",
            file=sys.stderr,
        )
    for line in config.unread_keys():
        print(f"{prog}: warning: {line}", file=sys.stderr)
    root = _data_root(config)  # before any directory is made
    warning = use_threads(config.runtime["threads"], warn=False).warning()  # said in its words
    if warning is not None:
        print(f"{prog}: {warning}", file=sys.stderr)
    if launched():
        with process_group() as ranks:
            return _run_ranks(config, progress, root, ranks)
    with run_directory(config) as (folder, created):
        log = _open_results(folder, created)
        pending = [p for p in config.points() if point_key(p) not in log.done]
        bar = tqdm(total=len(pending), desc=config.name, unit="point", disable=not progress)
        try:
            _run_points(config, pending, log, root, bar, progress)
        finally:
            log.close()
            bar.close()
            _remove_if_empty(folder, created)
    return folder


def _data_root(config: RunConfig) -> Path | None:
    """The data directory, checked before any work; None when no point reads it (every task a
    RULER one with its own ``haystack`` file, and no ``runtime.data_dir`` given)."""
    needed = any(
        task not in SYSTEM_TASKS or not config.options.get(task, {}).get("haystack")
        for task in config.sweep["task"]
    )
    if needed or config.runtime["data_dir"] is not None:
        return data_dir(config.runtime["data_dir"])
    return None


def _open_results(folder: Path, created: bool) -> OutputLog:
    """The reopened ``results.jsonl``, with the parts a killed multi-process run left merged."""
    try:
        log = OutputLog(folder / "results.jsonl", keys=RESULT_KEYS)
    except ValueError:
        _remove_if_empty(folder, created)
        raise
    try:
        merge_parts(log)
    except ValueError:
        log.close()
        raise
    return log


def _run_ranks(config: RunConfig, progress: bool, root: Path | None, ranks: Ranks) -> Path:
    """This rank's share of the pending points; rank 0 merges every rank's results (holding
    the run folder's lock from finding it to the merge)."""
    with ExitStack() as held:

        def prepare() -> tuple[str, bool, list]:
            folder, created = held.enter_context(run_directory(config))
            log = _open_results(folder, created)
            log.close()
            return str(folder), created, list(log.done)

        name, created, done = from_rank0(ranks, prepare)
        folder = Path(name)
        results = folder / "results.jsonl"
        token = new_parts(ranks, results)
        pending = [p for p in config.points() if point_key(p) not in set(done)]
        mine = share(pending, ranks.world, ranks.rank, key=point_key)
        bar = RankProgress(ranks, token, len(pending), progress, config.name)
        log = OutputLog(part_path(results, ranks.rank), keys=RESULT_KEYS)
        try:
            _run_points(config, mine, log, root, bar, progress and ranks.rank == 0)
        finally:
            log.close()
        finish_parts(ranks, bar, lambda: _merge_results(folder, created))
    return folder


def _merge_results(folder: Path, created: bool) -> None:
    _open_results(folder, created).close()
    _remove_if_empty(folder, created)


def _run_points(
    config: RunConfig,
    points: list[dict],
    log: OutputLog,
    root: Path | None,
    bar,
    progress: bool,
) -> None:
    """Run ``points`` in order, one result row each; ``bar`` is updated per point.

    Points of a task in :data:`~experiments.tasks.SHARED_PREFILL` that differ only in their
    ``system`` run as one group (one prefill serves every system); each still gets its own row.
    """
    from transformers.utils import logging as hf_logging

    from alisa import load_model
    from experiments.tasks import SHARED_PREFILL, TASKS, Context

    models: dict = {}
    for group in _groups(points):
        first = group[0]
        spec = first.get("model", "smollm2-135m")
        if spec not in models:
            models.clear()  # one model in memory at a time
            if not progress:  # --no-progress: transformers' loading bars too, as alisa batch
                hf_logging.disable_progress_bar()
            models[spec] = load_model(spec, dtype=config.runtime["dtype"])
        model, tokenizer = models[spec]
        started = time.perf_counter()
        context = Context(
            model=model,
            tokenizer=tokenizer,
            data_root=root,
            config=point_config(first),
            progress=progress,
        )
        task, options = first["task"], config.options.get(first["task"], {})
        if task in SHARED_PREFILL:
            results = SHARED_PREFILL[task](context, group, options)
        else:
            results = [TASKS[task](context, first, options)]
        seconds = (time.perf_counter() - started) / len(group)  # a group's time, shared evenly
        for point, metrics in zip(group, results, strict=True):
            log.append(
                {
                    "id": point_key(point),
                    "point": point,
                    "metrics": metrics,
                    "seconds": round(seconds, 3),
                    "command": config.command(point),
                }
            )
            bar.update(1)


def _groups(points: list[dict]) -> list[list[dict]]:
    """``points`` in order, those of a shared-prefill task that differ only in ``system`` (and
    the AlisaConfig fields that make it) together, at the place of the first of them."""
    from experiments.tasks import SHARED_PREFILL

    groups: dict[str, list[dict]] = {}
    for point in points:
        if point["task"] in SHARED_PREFILL:
            rest = {k: v for k, v in point.items() if k != "system" and k not in CONFIG_FIELDS}
            # The same prompts for every system: group by the rest of the point.
            key = point_key(rest)
        else:
            key = point_key(point)
        groups.setdefault(key, []).append(point)
    return list(groups.values())


def _remove_if_empty(folder: Path, created: bool) -> None:
    """A run this call started that recorded nothing leaves no directory behind."""
    results = folder / "results.jsonl"
    if parts_dir(results).exists():  # ranks of this run recorded points not merged yet
        return
    if created and (not results.exists() or results.stat().st_size == 0):
        for name in ("results.jsonl", "config.json", "env.json"):
            (folder / name).unlink(missing_ok=True)
        folder.rmdir()
        # Under the lock a starting run takes to find its folder: never under its feet.
        with locked(folder.parent):
            if not any(folder.parent.iterdir()):
                folder.parent.rmdir()


def main(argv=None) -> int:
    log_to_stderr()
    return run_from_args(parse_args(argv))


def run_from_args(args: argparse.Namespace, *, prog: str = PROG) -> int:
    """Run the sweep the flags of :func:`add_run_options` describe; the exit code. Messages
    start with ``prog``: ``alisa experiment`` runs it too."""
    overrides = list(args.set)
    if args.data_dir is not None:
        overrides.append(f"runtime.data_dir={json.dumps(args.data_dir)}")
    try:
        config = load_config(args.config, overrides)
        folder = run(config, progress=not args.no_progress, prog=prog)
    except (ValueError, RankError) as error:
        print(f"{prog}: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 1
    if not launched() or os.environ["RANK"] == "0":
        print(f"results in {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
