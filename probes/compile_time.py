"""Seconds of a cold compile of one decode step (docs/compile.md, stop 73).

Run each system in a fresh process with an empty inductor cache, or the kernels of an earlier
run are reused:

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python -m probes.compile_time swa    # or dense, hf, int8

(``--kernels reference`` or ``cpu`` for the alisa systems' backend.)

SmolLM2-135M float32, one random prompt of 256 tokens, 4 new tokens, 2 threads (int8: SWA
dropping over INT8 KV). Prints the first compiled step's seconds (tracing and code generation
included) and inductor's largest phases.
"""

import argparse

import torch
from torch._dynamo.utils import compile_times
from transformers import StaticCache

from alisa import AlisaConfig, generate
from experiments.shapes import load_benchmark_model, random_prompts

PHASES = ("bytecode_tracing", "Scheduler.__init__", "GraphLowering.codegen", "compile_file")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("system", choices=("swa", "dense", "hf", "int8"))
    parser.add_argument("--kernels", default="auto", help="an alisa system's kernels")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, tokenizer = load_benchmark_model("smollm2-135m", dtype="float32", tokenizer="bytes")
    prompts = random_prompts(256, 1)
    run = dict(max_new_tokens=4, stop_at_eos=False, compile="on")
    if args.system == "hf":
        width = tokenizer(prompts, return_tensors="pt")["input_ids"].shape[1]
        run["past_key_values"] = StaticCache(config=model.config, max_cache_len=width + 4)
    elif args.system == "dense":
        run["config"] = AlisaConfig(caching_ratio=1.0, kernels=args.kernels)
    else:
        run["config"] = AlisaConfig(
            policy="swa",
            caching_ratio=0.2,
            min_budget_tokens=0,
            kernels=args.kernels,
            kv_bits=8 if args.system == "int8" else 16,
        )
    result = generate(model, tokenizer, prompts, **run)
    phases = {}  # a phase's line lists each graph's seconds (a region's graphs too): summed
    for line in compile_times(repr="str").splitlines()[2:]:
        name, *seconds = line.split(", ")
        phases[name] = sum(map(float, seconds))
    print(
        f"{args.system}: first compiled step {result.compile_s:.1f} s;",
        ", ".join(f"{name} {float(phases.get(name, 0)):.1f} s" for name in PHASES),
    )


if __name__ == "__main__":
    main()
