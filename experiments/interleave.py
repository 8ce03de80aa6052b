"""Decode steps of several KV-cache systems taken in turns in one process (``bench_speed
--interleave``).

On a small shared CPU a system's step time moves by 20-50 % between processes run minutes apart
(docs/host-speed.md), more than the ratios issue 26 asks about (host retention / dropping at
most 1.25, ...). Here every system is prefilled once on the same model and prompts, then the
systems decode in turns of a few steps each, round after round, so a slow spell of the machine
falls on every system alike. A row's step time is the median of all its timed steps; its
speed-up is the median over turns of the baseline's median step in that turn over the
system's (a paired ratio). What one process cannot give is a per-system peak of memory (every
cache is alive at once): rows carry ``peak_rss_bytes = None``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from alisa import AlisaCache
from alisa.kv.attention import attached
from alisa.ops.products import SETTLING
from alisa.runtime.compiled import ASKED_ON
from alisa.runtime.engine import DecodeState, Engine, cache_kv_bytes, cache_tier_bytes


@dataclass
class Turns:
    """One system's state between turns: its cache, decode state and what was measured."""

    system: str
    engine: Engine
    cache: object
    state: DecodeState
    prompt_tokens: list[int]
    ttft_s: float
    generated: list[torch.Tensor] = field(default_factory=list)  # (B,) per step
    step_s: list[list[float]] = field(default_factory=list)  # seconds per step, per turn
    peak_kv: int = 0


def interleaved_rows(
    model,
    tokenizer,
    prompts: list[str],
    systems: list[str],
    new_tokens: int,
    turn: int,
    baseline: str,
) -> list[dict]:
    """One row per system (``experiments.worker.measure_system``'s fields) from decode steps
    taken in turns of ``turn`` steps, after a warm-up on short prompts.

    Parameters
    ----------
    model, tokenizer, prompts
        The workload, shared by every system.
    systems
        System names (``experiments.systems``); each keeps its cache for the whole run.
    new_tokens
        Tokens per sequence: the first comes from the prefill, the other ``new_tokens - 1``
        are timed decode steps, ``turn`` at a time per system.
    turn
        Decode steps a system takes before the next system's turn.
    baseline
        The system each row's paired speed-up divides (``speedup_vs_baseline``), if listed.

    Raises
    ------
    ValueError
        ``turn`` < 1 or ``new_tokens`` < 2 (no decode step to time).
    """
    from experiments.systems import compile_setting
    from experiments.worker import system_row

    if turn < 1:
        raise ValueError(f"interleave={turn!r} must be at least 1 step per turn")
    if new_tokens < 2:
        raise ValueError(f"new_tokens={new_tokens!r} must be at least 2 to time decode steps")
    engines = {
        system: Engine(
            model,
            tokenizer,
            stop_at_eos=False,
            compile=ASKED_ON if compile_setting(system) == "on" else None,
        )
        for system in systems
    }
    # A StaticCache of the timed run's capacity in the warm-up too: a compiled system compiles
    # its one graph there (its compile_s), and the timed steps replay it.
    width = tokenizer(prompts, return_tensors="pt", padding=True)["input_ids"].shape[1]
    with torch.inference_mode(), attached(model):
        short = [prompt[: max(1, len(prompt) // 8)] for prompt in prompts]
        warm = [
            _start(engines[system], tokenizer, short, system, 3 + SETTLING, width + new_tokens)
            for system in systems
        ]
        for _ in range(2):  # kernels compiled, allocator warm, for each system
            for run in warm:
                _turn(run, 1)
        for run in warm:  # the weights' product form settled for this batch size
            run.engine.settle(len(prompts), lambda run=run: _turn(run, 1))
        del warm
        runs = [
            _start(engines[system], tokenizer, prompts, system, new_tokens, width + new_tokens)
            for system in tqdm(systems, desc="prefill", unit="system")
        ]
        total = len(systems) * (new_tokens - 1)
        with tqdm(total=total, desc="decode in turns", unit="step") as bar:
            left = new_tokens - 1
            while left > 0:
                steps = min(turn, left)
                for run in runs:
                    run.step_s.append([])
                    _turn(run, steps)
                    bar.update(steps)
                left -= steps
    rows = []
    for run in runs:
        result = run.engine.output(
            torch.stack(run.generated, dim=1),
            run.prompt_tokens,
            run.ttft_s,
            [t for turn_s in run.step_s for t in turn_s],
            cache_kv_bytes(run.cache),
            run.peak_kv,
        )
        result.kv_tier_bytes = cache_tier_bytes(run.cache, run.engine.device)
        result.kernels = run.engine.kernels(run.cache)
        compiled = run.engine.compiled
        result.compile_s = compiled.compile_s if compiled is not None else None
        row = system_row(run.system, model, prompts, result, run.cache)
        row["peak_rss_bytes"] = None  # every system's cache is alive at once
        row["turn_step_ms"] = [1000 * statistics.median(s) for s in run.step_s]
        rows.append(row)
    _pair(rows, baseline)
    return rows


def _start(
    engine: Engine, tokenizer, prompts: list[str], system: str, new_tokens: int, capacity: int
) -> Turns:
    """A system's cache (sized for ``new_tokens``, as ``generate`` sizes it; a StaticCache for
    ``capacity`` tokens), prefilled on ``prompts``, its first token chosen."""
    from experiments.systems import make_cache

    model = engine.model
    cache, config = make_cache(system, model, max_cache_len=capacity)
    if config is not None:
        cache = AlisaCache(model, config, max_new_tokens=new_tokens)
    batch = tokenizer(prompts, return_tensors="pt", padding=True).to(engine.device)
    state = DecodeState.start(batch["input_ids"], batch["attention_mask"])
    run = Turns(system, engine, cache, state, state.prompt_tokens(), 0.0)
    start = engine.clock()
    tokens = engine.step(state, cache)
    run.ttft_s = engine.clock() - start
    run.generated.append(tokens)
    state.advance(tokens)
    return run


def _turn(run: Turns, steps: int) -> None:
    """``steps`` timed decode steps of one system (as :meth:`Engine.run` times them)."""
    engine = run.engine
    for _ in range(steps):
        start = engine.clock()
        tokens = engine.step(run.state, run.cache)
        if run.step_s:
            run.step_s[-1].append(engine.clock() - start)
        run.generated.append(tokens)
        run.state.advance(tokens)
        run.peak_kv = max(run.peak_kv, cache_kv_bytes(run.cache))


def _pair(rows: list[dict], baseline: str) -> None:
    """Each row's speed-up: the median over turns of the baseline's median step over its own."""
    base = next((row for row in rows if row["system"] == baseline), None)
    if base is None:
        return
    for row in rows:
        ratios = [b / s for b, s in zip(base["turn_step_ms"], row["turn_step_ms"], strict=True)]
        row["speedup_vs_baseline"] = statistics.median(ratios)
        row["turn_speedups"] = ratios
