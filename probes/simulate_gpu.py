"""SIMULATION: throughput of ALISA's plan vs FlexGen, vLLM and Accelerate on published GPU figures.

    python -m probes.simulate_gpu

Nothing here runs on a GPU: every figure comes from the scheduler's cost model with published
hardware figures (scheduler.PRESETS) and model shapes (scheduler.MODEL_PRESETS), on ALISA's
workloads (prompt 128, generation 512, batch 4-64). Systems:

- ALISA: SWA r = 0.2, INT8 KV, the LP's three-phase plan (offload + recompute), recent half on GPU.
- FlexGen-style: dense fp16 KV, one static split solved by the same LP (weights may offload),
  at the best of batch, batch/2, ... run in waves (FlexGen searches its batch size as well).
- vLLM-style block swapping: dense fp16 KV, all on GPU; sequences that do not fit wait and run in
  later waves (running requests are never offloaded).
- Accelerate-style: dense fp16 KV entirely offloaded and fetched every step.

Prints a table beside the paper's ratios (1.4-3.0x over FlexGen, up to 1.9x over vLLM), then one
JSON line.
"""

from __future__ import annotations

import json
import math
import sys

from scheduler import MODEL_PRESETS, PRESETS, Options, Workload, evaluate, solve
from scheduler.cost import activation_bytes

HARDWARE = ("v100-32gb", "a100-40gb", "h100-80gb")
MODELS = ("opt-6.7b", "opt-13b", "opt-30b", "llama-2-7b", "llama-2-13b")
BATCHES = (4, 16, 64)
PROMPT, GENERATE = 128, 512


def alisa(hardware, model, batch):
    workload = Workload(
        batch=batch,
        prompt_len=PROMPT,
        gen_len=GENERATE,
        caching_ratio=0.2,
        kv_bits=8,
        recent_fraction=0.5,
    )
    return solve(hardware, model, workload).tokens_per_s


def dense(batch):
    return Workload(batch=batch, prompt_len=PROMPT, gen_len=GENERATE, recent_fraction=0.0)


def flexgen(hardware, model, batch):
    """FlexGen searches its batch too: the best static-split plan over batch/2^k, run in waves."""
    best, size = None, batch
    while size >= 1:
        try:
            plan = solve(hardware, model, dense(size), Options(static=True, allow_recompute=False))
        except ValueError:
            plan = None
        if plan is not None:
            waves = math.ceil(batch / size)
            speed = batch * GENERATE / (waves * (plan.prefill_s + plan.decode_s))
            best = speed if best is None else max(best, speed)
        size //= 2
    return best


def vllm(hardware, model, batch):
    per_sequence = (PROMPT + GENERATE) * model.kv_bytes_per_token()
    free = hardware.device_bytes - model.total_weight_bytes - activation_bytes(model, batch)
    fitting = min(batch, math.floor(free / per_sequence)) if free > 0 else 0
    if fitting < 1:
        return None  # the weights alone do not fit: vLLM cannot run it on one GPU
    waves = math.ceil(batch / fitting)
    plan = evaluate(hardware, model, dense(fitting), {"g": 1.0, "c": 0.0, "x": 0.0, "w": 0.0})
    return batch * GENERATE / (waves * (plan.prefill_s + plan.decode_s))


def accelerate(hardware, model, batch):
    weights_fit = model.total_weight_bytes + activation_bytes(model, batch) < hardware.device_bytes
    offloaded = 0.0 if weights_fit else 1.0
    plan = evaluate(hardware, model, dense(batch), {"g": 0.0, "c": 1.0, "x": 0.0, "w": offloaded})
    return plan.tokens_per_s


def safe(function, *args):
    try:
        return function(*args)
    except ValueError:  # infeasible: does not fit even with offloading
        return None


def main() -> int:
    rows = []
    for hardware_name in HARDWARE:
        hardware = PRESETS[hardware_name]
        for model_name in MODELS:
            model = MODEL_PRESETS[model_name]
            for batch in BATCHES:
                row = {"hardware": hardware_name, "model": model_name, "batch": batch}
                for system, function in (
                    ("alisa", alisa),
                    ("flexgen", flexgen),
                    ("vllm", vllm),
                    ("accelerate", accelerate),
                ):
                    row[system] = safe(function, hardware, model, batch)
                for system in ("flexgen", "vllm", "accelerate"):
                    row[f"alisa_over_{system}"] = (
                        row["alisa"] / row[system] if row["alisa"] and row[system] else None
                    )
                rows.append(row)
    print("SIMULATION (published hardware figures, cost model only; not measured)")
    print(
        "| GPU | model | batch | ALISA tok/s | FlexGen | vLLM | Accelerate "
        "| ALISA/FlexGen | ALISA/vLLM |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:

        def cell(value, ratio=False):
            if value is None:
                return "n/a"
            return f"{value:.2f}x" if ratio else f"{value:.1f}"

        print(
            f"| {row['hardware']} | {row['model']} | {row['batch']} | {cell(row['alisa'])} | "
            f"{cell(row['flexgen'])} | {cell(row['vllm'])} | {cell(row['accelerate'])} | "
            f"{cell(row['alisa_over_flexgen'], True)} | {cell(row['alisa_over_vllm'], True)} |"
        )
    ratios = [r["alisa_over_flexgen"] for r in rows if r["alisa_over_flexgen"]]
    over_vllm = [r["alisa_over_vllm"] for r in rows if r["alisa_over_vllm"]]
    summary = {
        "alisa_over_flexgen_range": [min(ratios), max(ratios)] if ratios else None,
        "alisa_over_vllm_max": max(over_vllm) if over_vllm else None,
        "paper": {"alisa_over_flexgen": [1.4, 3.0], "alisa_over_vllm_max": 1.9},
    }
    print(
        f"ALISA/FlexGen {summary['alisa_over_flexgen_range']}, ALISA/vLLM max "
        f"{summary['alisa_over_vllm_max']} (paper: 1.4-3.0x, up to 1.9x)"
    )
    print(json.dumps({"benchmark": "gpu_simulation", "simulation": True, "rows": rows, **summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
