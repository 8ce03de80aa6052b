"""What a decode step would save riding inside a prefill forward: a forward's fixed cost.

    python -m probes.bench_packing                       # SmolLM2 fp32, 1 thread
    python -m probes.bench_packing --prompt-tokens 256,512 --rows 16,32 --context 600

Continuous batching (:mod:`alisa.runtime.continuous`) runs, for each admitted request, a prefill
forward of its prompt, (1, T), and a decode step of the running rows, (B, 1). A mixed forward
(Sarathi-Serve's piggybacking, https://arxiv.org/abs/2403.02310; vLLM's chunked prefill) packs
both into one (1, T + B) forward. The rows' attention over their caches stays as it is; what the
packing can save is what a forward costs beyond its tokens' own work (reading every weight once,
per-layer dispatch). This measures it before anyone builds it. Per prompt length T and row count
B, the median of ``--repeats`` forwards after a warm-up, in milliseconds:

- prefill: a (1, T) forward, no cache;
- packed: a (1, T + B) forward, no cache (the mixed forward less the rows' cached attention);
- tokens: a (1, B) forward, no cache (a decode step's own token work);
- step: a decode step of B rows over ``--context`` cached tokens each (random keys and values in
  a ``DynamicCache``: the cost does not depend on what they hold);
- saved = tokens - (packed - prefill), what one mixed forward would save, and its share of step.

Random token ids: a forward's cost does not depend on the text. Prints a table, then one JSON
line.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from functools import partial

import torch

from experiments.flags import positive_ints
from experiments.timing import median_seconds


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="smollm2-135m", help="alisa.load_model spec or shape:NAME"
    )
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-tokens", type=positive_ints, default=[256, 512])
    parser.add_argument("--rows", type=positive_ints, default=[16, 32])
    parser.add_argument("--context", type=int, default=600, help="cached tokens per decode row")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    for name in ("context", "repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)} must be at least 1")
    return args


def milliseconds(run: Callable[[], None], repeats: int, device: torch.device) -> float:
    """Median ms of ``run`` over ``repeats`` calls after one warm-up call."""
    return 1000 * median_seconds(run, repeats=repeats, warm_up=1, device=device)


def forward_costs(
    model, prompt_tokens: int, rows: int, context: int, repeats: int
) -> dict[str, float]:
    """The four timings and the saving of one (T, B) point, in ms (see the module docstring).

    Parameters
    ----------
    model
        An HF causal LM; its device and dtype are used.
    prompt_tokens, rows, context
        T, B and the cached tokens per decode row.
    """
    from transformers import DynamicCache

    from alisa.model.adapter import ModelAdapter

    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    ms = partial(milliseconds, repeats=repeats, device=device)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)

    def ids(batch: int, length: int) -> torch.Tensor:
        return torch.randint(0, vocab, (batch, length), generator=generator).to(device)

    def alone(feed: torch.Tensor) -> Callable[[], None]:
        return lambda: model(input_ids=feed, use_cache=False, logits_to_keep=1)

    shape = ModelAdapter.of(model).shape
    cache = DynamicCache()
    kv = (rows, shape.num_kv_heads, context, shape.head_dim)
    for layer in range(shape.num_layers):
        keys = torch.randn(kv, generator=generator).to(device, dtype)
        cache.update(keys, torch.randn(kv, generator=generator).to(device, dtype), layer)
    step_ids = ids(rows, 1)
    positions = torch.full((rows, 1), context, device=device)

    def step() -> None:
        model(
            input_ids=step_ids,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        cache.crop(-1)  # drop the step's token: every repeat attends over the same context

    figures = {
        "prefill_ms": ms(alone(ids(1, prompt_tokens))),
        "packed_ms": ms(alone(ids(1, prompt_tokens + rows))),
        "tokens_ms": ms(alone(ids(1, rows))),
        "step_ms": ms(step),
    }
    saved = figures["tokens_ms"] - (figures["packed_ms"] - figures["prefill_ms"])
    return {**figures, "saved_ms": saved, "saved_share_of_step": saved / figures["step_ms"]}


def main(argv=None) -> int:
    args = parse_args(argv)
    from experiments.shapes import load_benchmark_model

    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        model, _ = load_benchmark_model(args.model, dtype=args.dtype)
        model.eval()
        rows = []
        with torch.inference_mode():
            for prompt_tokens in args.prompt_tokens:
                for batch in args.rows:
                    point = forward_costs(model, prompt_tokens, batch, args.context, args.repeats)
                    rows.append({"prompt_tokens": prompt_tokens, "rows": batch, **point})
                    saved = point["saved_ms"]
                    print(f"T={prompt_tokens} B={batch}: saved {saved:.0f} ms", file=sys.stderr)
    finally:
        torch.set_num_threads(threads)
    print_table(rows)
    options = {key: getattr(args, key) for key in ("model", "dtype", "context", "threads")}
    report = {"benchmark": "packing", **options, "torch": torch.__version__, "rows": rows}
    print(json.dumps(report))
    return 0


def print_table(rows: list[dict]) -> None:
    print("| T | B | prefill ms | packed ms | tokens ms | step ms | saved ms | saved / step |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['prompt_tokens']} | {row['rows']} | {row['prefill_ms']:.0f} | "
            f"{row['packed_ms']:.0f} | {row['tokens_ms']:.0f} | {row['step_ms']:.0f} | "
            f"{row['saved_ms']:.0f} | {row['saved_share_of_step']:.2f} |"
        )


if __name__ == "__main__":
    sys.exit(main())
