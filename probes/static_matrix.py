"""The static step over the architecture matrix (docs/compile.md, stop 88, issue 65).

For every exact family of ``tests.architectures`` and each mode (dense, SWA r = 0.3 over
16-bit, INT8 and INT4 KV), the tokens of ``--steps`` greedy decode steps three ways: the
growing cache, the static cache's eager step, and its step traced by dynamo in one graph
(``fullgraph=True``, a recompile an error; the eager backend, so no code generation):

    python -m probes.static_matrix            # or --families opt bert --steps 24
    python -m probes.static_matrix --products # the traced step's products by the row kernel

``--products`` traces the step with the weights' products forced onto alisa's row kernel
(:func:`alisa.ops.products.route_linears` over the traced graph, as a compiled step whose
products measured faster runs it; docs/compile.md, stop 90). Prints one line per family and a
summary line; a family whose forward dynamo cannot trace in one graph is named with the error
(``compile="auto"`` runs such a model eager with a warning).
"""

from __future__ import annotations

import argparse
import json
import warnings

import torch
from torch._dynamo.utils import counters

from alisa import AlisaCache, AlisaConfig
from alisa.ops.products import route_linears
from alisa.runtime.compiled import CompiledDecode, last_logits
from tests.architectures import EXACT, FAMILIES, build, prompts

MODES = {
    "dense": {"caching_ratio": 1.0},
    "swa16": {"policy": "swa", "caching_ratio": 0.3},
    "int8": {"policy": "swa", "caching_ratio": 0.3, "kv_bits": 8, "residual_tokens": 4},
    "int4": {"policy": "swa", "caching_ratio": 0.3, "kv_bits": 4, "residual_tokens": 4},
}


def greedy(model, cache, ids, mask, steps: int, forward=None) -> torch.Tensor:
    """(B, steps + 1) greedy tokens: the prefill through the model's hooks, then ``steps``
    decode steps through the model, or through ``forward`` (a traced twin) after the cache's
    host half, over a mask padded to the static length."""
    batch = ids.shape[0]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        tokens = [last_logits(model, ids, positions, mask, cache).argmax(-1)]
        for step in range(steps):
            mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)
            position = positions[:, -1:] + step + 1
            feed = tokens[-1][:, None]
            if forward is None:
                logits = last_logits(model, feed, position, mask, cache)
            else:
                cache.begin_forward(batch, 1, mask, model=model)
                padded = torch.nn.functional.pad(mask, (0, cache.get_max_length() - mask.shape[1]))
                logits = last_logits(forward, feed, position, padded, cache)
            tokens.append(logits.argmax(-1))
    return torch.stack(tokens, dim=1)


def check(model, fields: dict, steps: int, products: bool = False) -> str:
    """``ok``, or how the three runs of one mode differ, or the error; ``products``: the
    traced step's weight products by the row kernel."""
    ids, mask = prompts()
    longest = ids.shape[1] + steps + 1
    try:
        growing = greedy(model, AlisaCache(model, AlisaConfig(**fields)), ids, mask, steps)
        static = AlisaCache(model, AlisaConfig(**fields), max_cache_len=longest)
        eager = greedy(model, static, ids, mask, steps)
        decode = CompiledDecode(model, "default", backend="eager")
        traced = decode.forward(route_linears if products else None)
        torch._dynamo.reset()
        counters.clear()
        with torch._dynamo.config.patch(error_on_recompile=True):
            again = AlisaCache(model, AlisaConfig(**fields), max_cache_len=longest)
            tokens = greedy(model, again, ids, mask, steps, traced)
    except Exception as error:  # the row's outcome, whatever the model raised
        return f"{type(error).__name__}: {' '.join(str(error).split())[:160]}"
    graphs = counters["stats"]["unique_graphs"]
    if torch.equal(tokens, eager) and torch.equal(eager, growing) and graphs == 1:
        return "ok"
    return (
        f"differs (traced = eager {torch.equal(tokens, eager)}, eager = growing "
        f"{torch.equal(eager, growing)}, {graphs} graphs)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", help="rows to run (default: every exact one)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument(
        "--products", action="store_true", help="the traced step's products by the row kernel"
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    names = args.families or [name for name, row in FAMILIES.items() if row.expected == EXACT]
    outcomes = {}
    for name in names:
        model = build(FAMILIES[name])
        outcomes[name] = {
            mode: check(model, fields, args.steps, args.products) for mode, fields in MODES.items()
        }
        row = " ".join(f"{mode}: {what}" for mode, what in outcomes[name].items())
        print(name, row, flush=True)
    exact = [name for name, row in outcomes.items() if set(row.values()) == {"ok"}]
    print(json.dumps({"families": len(outcomes), "every_mode_identical": len(exact)}))


if __name__ == "__main__":
    main()
