"""How much host retention's choice changes between decode steps, and what selecting less often
saves: fetched tokens per selection and mean step time for each ``reselect_every``.

    python -m probes.bench_reselect                       # SmolLM2 fp32, 4 x 1024, s = 1,2,4,8
    python -m probes.bench_reselect --batch 16 --prompt-tokens 2048 --intervals 1,4

``retention="host"`` chooses each KV head's tokens before every ``reselect_every``-th decode step
(https://arxiv.org/abs/2403.17312, §IV, phase II; Quest and InfiniGen select at every step).
Per interval s, in one process (the model loaded once; one warm-up run first), over ``--steps``
greedy decode steps after the prefill:

- fetched per selection: tokens a selection brought from the host, per layer, sequence and KV
  head (the prefill's own selection left out); over the budget it is the share of the choice that
  changed since the last selection (1 - overlap);
- fetched per step: the same spread over the s steps;
- mean step ms: the mean, not the median, since with s > 1 most steps do not select.

The accuracy side of the trade-off is ``python -m experiments.run --config
experiments/configs/fidelity.toml --set sweep.retention=host --set sweep.reselect_every=S``.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from experiments.flags import positive_ints

SYSTEM = "alisa:policy=swa,caching_ratio={ratio},retention=host,reselect_every={interval}"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="smollm2-135m", help="alisa.load_model spec or shape:NAME"
    )
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--ratio", type=float, default=0.2)
    parser.add_argument("--intervals", type=positive_ints, default=[1, 2, 4, 8])
    parser.add_argument(
        "--history-share",
        type=float,
        default=None,
        help="AlisaConfig.history_share (default: the config's, 0.5 for SWA)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args(argv)
    for name in ("batch", "prompt_tokens", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")
    return args


@torch.inference_mode()
def decode(model, batch, config, steps: int) -> tuple[list[float], list]:
    """Step seconds of ``steps`` greedy decode steps after the prefill, and the cache layers."""
    from alisa import AlisaCache
    from alisa.runtime.engine import DecodeState, Engine

    engine = Engine(model, stop_at_eos=False)
    cache = AlisaCache(model, config, max_new_tokens=steps + 1)
    state = DecodeState.start(batch["input_ids"], batch["attention_mask"])
    state.advance(engine.step(state, cache))  # the prefill (the cache attaches the model)
    before = [(layer.keeper.fetched, layer.keeper.steps) for layer in cache.layers]
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        state.advance(engine.step(state, cache))
        seconds.append(time.perf_counter() - start)
    return seconds, [(layer, *counts) for layer, counts in zip(cache.layers, before, strict=True)]


def fetch_figures(layers: list, steps: int) -> dict[str, float]:
    """Tokens fetched per selection and per step, per layer, sequence and KV head, and their
    share of the budget, from the keepers' counters (``layers``: (layer, fetched, selections)
    before the decode steps)."""
    per_selection, per_step, budgets = [], [], []
    for layer, fetched_before, selections_before in layers:
        keeper, slots = layer.keeper, layer.slots
        rows = slots.positions.shape[0] * slots.groups
        fetched = (keeper.fetched - fetched_before) / rows
        selections = keeper.steps - selections_before
        per_selection.append(fetched / max(1, selections))
        per_step.append(fetched / steps)
        budgets.append(float(keeper.budget(slots).mean()))
    budget = statistics.mean(budgets)
    selection = statistics.mean(per_selection)
    return {
        "fetched_per_selection": selection,
        "fetched_per_step": statistics.mean(per_step),
        "budget": budget,
        "changed_share": selection / budget,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    from experiments.data import data_dir, load_wikitext2
    from experiments.shapes import load_benchmark_model
    from experiments.systems import parse_alisa
    from experiments.worker import prompts_of_length

    torch.set_num_threads(args.threads)
    model, tokenizer = load_benchmark_model(args.model, dtype=args.dtype)
    text = load_wikitext2(data_dir(args.data_dir))
    prompts = prompts_of_length(tokenizer, text, args.prompt_tokens, args.batch)
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    warm = tokenizer([p[: max(1, len(p) // 8)] for p in prompts], return_tensors="pt", padding=True)
    rows = []
    for interval in args.intervals:
        name = SYSTEM.format(ratio=args.ratio, interval=interval)
        if args.history_share is not None:
            name += f",history_share={args.history_share}"
        config = parse_alisa(name)
        decode(model, warm, config, 4)  # warm-up: kernels, allocator
        seconds, layers = decode(model, batch, config, args.steps)
        rows.append(
            {
                "reselect_every": interval,
                "mean_step_ms": 1000 * statistics.mean(seconds),
                "median_step_ms": 1000 * statistics.median(seconds),
                **fetch_figures(layers, args.steps),
            }
        )
        print(f"reselect_every={interval}: {rows[-1]['mean_step_ms']:.0f} ms", file=sys.stderr)
    print_table(rows)
    options = {key: getattr(args, key) for key in ("model", "dtype", "batch", "prompt_tokens")}
    report = {"benchmark": "reselect", **options, "ratio": args.ratio, "rows": rows}
    print(json.dumps({**report, "history_share": args.history_share}))
    return 0


def print_table(rows: list[dict]) -> None:
    print(
        "| reselect_every | mean step ms | fetched / selection | fetched / step | budget | "
        "changed share |"
    )
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['reselect_every']} | {row['mean_step_ms']:.1f} | "
            f"{row['fetched_per_selection']:.1f} | {row['fetched_per_step']:.1f} | "
            f"{row['budget']:.0f} | {row['changed_share']:.3f} |"
        )


if __name__ == "__main__":
    sys.exit(main())
