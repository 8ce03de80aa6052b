"""Fidelity of the scheduler's cost model on this machine: predicted vs measured decode steps.

    python -m experiments.bench_cost_model     # SmolLM2 bf16 and float32, batch 8, 1024 tokens
    python -m experiments.bench_cost_model --model shape:llama-3.2-1b --prompts random   # a GPU
    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=67108864 \
        python -m experiments.bench_cost_model --dtype float32 --threads 1

Per dtype: a hardware profile is measured (as ``alisa profile``, in a fresh process, calibrated at
the benchmark's batch and prompt length); then the tiered cache runs with all KV resident, about
half offloaded to the host pool and about half recomputed, then ``retention="host"`` at r = 0.2
(every token on the host, re-selecting every ``reselect_every`` steps as by default; its selection
cost is the profile's). The placement each run used is costed with ``scheduler.evaluate`` against
its median measured step (target: within 20 %, or `alisa plan` refuses the profile because its fits
miss their own steps by more: ``scheduler.hardware.calibration_error``), and the LP solved at the
half budget must pick the faster of host offload and recomputation as measured. Each configuration
runs in a fresh process (``experiments.worker``), as a user runs one: in one process, what ran
before decides whether glibc serves a step's temporaries from the heap or from fresh pages (the host
row took 197 and 242 ms a step there against 181 ms alone); the allocator thresholds above make
steps steadier, and the JSON line's environment reports them. Each configuration's process runs
``--repeats`` times, the configurations in turns, and its median is what the prediction is held
to: one process can run a third slower than the next on a shared machine (the bfloat16 resident
step: 523.5 ms in one process, 362.3 and 339.3 in the next two), and turns keep the machine's drift
out of the comparison between rows. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace

import torch
from tqdm.auto import tqdm

from alisa import AlisaConfig
from alisa.calibration.steps import SELECTION_CONFIG, half_offload_budget
from alisa.model.adapter import model_shape
from alisa.planning.spec import config_workload, model_spec
from experiments.bench_speed import worker_options
from experiments.shapes import load_benchmark_model
from experiments.systems import system_name
from experiments.timing import environment
from experiments.worker import PROFILE, add_prompts_argument, run_in_subprocess
from scheduler import HardwareProfile, Options, Workload, evaluate, solve
from scheduler.hardware import calibration_error

HOST_ROW = "host retention r=0.2"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--model", default="smollm2-135m", help="alisa.load_model spec, or shape:NAME")
    add("--dtype", default="bfloat16,float32", help="comma-separated dtypes, each benchmarked")
    add("--batch", type=int, default=8)
    add("--prompt-tokens", type=int, default=1024)
    add("--new-tokens", type=int, default=24)
    add("--threads", type=int, default=2)
    add("--data-dir", default=None)
    add("--repeats", type=int, default=3, help="worker processes per configuration, in turns")
    add_prompts_argument(parser)
    return parser.parse_args(argv)


def bench_dtype(args: argparse.Namespace, dtype: str) -> dict:
    """Profile, run the three placements and the LP choice in one dtype."""
    tokenizer = "bytes" if args.prompts == "random" else "smollm2"
    model, _ = load_benchmark_model(args.model, dtype=dtype, tokenizer=tokenizer)
    options = {**worker_options(args), "dtype": dtype}
    report = run_in_subprocess(PROFILE, options)  # a fresh process, as a user's `alisa profile`
    profile = HardwareProfile(**report["profile"])
    spec = model_spec(model, model_shape(model), name=args.model)
    half = half_offload_budget(spec, args.batch, args.prompt_tokens + args.new_tokens)
    configs = {
        "resident": AlisaConfig(),
        "half on host": AlisaConfig(gpu_memory=half, recompute="never"),
        "half recomputed": AlisaConfig(gpu_memory=half, recompute="always"),
    }
    workload = Workload(batch=args.batch, prompt_len=args.prompt_tokens, gen_len=args.new_tokens)
    workloads = dict.fromkeys(configs, workload)
    # retention="host" as `alisa profile` calibrates it (every token on the host, the budget,
    # the per-layer keep rules, on the device) but re-selecting at the default interval, as a
    # user runs it: the profile's per-selection cost is spread over the interval. Its workload
    # is the one `alisa plan` builds for that config (no window pinned to the device).
    host = replace(SELECTION_CONFIG, reselect_every=None)
    configs[HOST_ROW] = host
    workloads[HOST_ROW] = config_workload(
        host,
        spec.num_layers,
        batch=args.batch,
        prompt_len=args.prompt_tokens,
        gen_len=args.new_tokens,
        windows=spec.windows,
    )
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    turns = [name for _ in range(args.repeats) for name in configs]
    for name in tqdm(turns, desc=f"{dtype} configurations", unit="run"):
        # a fresh process each (docstring)
        runs[name].append(run_in_subprocess(system_name(configs[name]), options))
        print(f"{dtype} {name}: {runs[name][-1]['median_step_ms']:.1f} ms", file=sys.stderr)
    rows = []
    for name, processes in runs.items():
        steps = [run["median_step_ms"] for run in processes]
        measured = statistics.median(steps) / 1000
        used = processes[0]["placement"]
        plan = evaluate(profile, spec, workloads[name], used, buckets=1)
        predicted = plan.decode_s / args.new_tokens
        rows.append(
            {
                "config": name,
                "placement": used,
                "kernels": processes[0]["kernels"],  # the backend, the weights' product form
                "process_steps_ms": steps,
                "measured_step_ms": 1000 * measured,
                "predicted_step_ms": 1000 * predicted,
                "error": predicted / measured - 1,
            }
        )
    return {
        "dtype": dtype,
        "profile": profile.__dict__,
        "terms": report["terms"],
        "rows": rows,
        "lp_choice": lp_choice(profile, spec, workload, half, rows),
        # Why `alisa plan` would refuse this profile (its fits miss their own steps), or None.
        "plan_refused": calibration_error(profile),
    }


def lp_choice(profile, spec, workload: Workload, budget: int, rows: list[dict]) -> dict:
    """What the LP picks at the half budget (host offload or recomputation) vs the faster run."""
    plan = solve(
        replace(profile, device_bytes=budget),
        spec,
        workload,
        Options(static=True, allow_weight_offload=False),
    )
    host = sum(b.host_fraction * (b.stop - b.start) for b in plan.buckets)
    rebuilt = sum(b.recompute_fraction * (b.stop - b.start) for b in plan.buckets)
    measured = {r["config"]: r["measured_step_ms"] for r in rows}
    faster = "host" if measured["half on host"] <= measured["half recomputed"] else "recompute"
    picked = "host" if host >= rebuilt else "recompute"
    return {"picked": picked, "faster": faster, "match": picked == faster}


def print_table(results: list[dict]) -> None:
    print(
        "| dtype | configuration | device / host / recompute | measured ms (each process) "
        "| predicted ms | error |"
    )
    print("|---|---|---|---|---|---|")
    for result in results:
        for row in result["rows"]:
            p = row["placement"]
            print(
                f"| {result['dtype']} | {row['config']} | {p['g']:.2f} / {p['c']:.2f} / "
                f"{p['x']:.2f} | {row['measured_step_ms']:.1f} "
                f"({', '.join(f'{ms:.1f}' for ms in row['process_steps_ms'])}) "
                f"| {row['predicted_step_ms']:.1f} "
                f"| {100 * row['error']:+.1f} % |"
            )
        fit = result["profile"]
        verdict = "refused" if result["plan_refused"] else "planned"
        print(
            f"| {result['dtype']} | calibration's own steps | decode fit misses "
            f"{100 * fit['decode_miss']:.1f} %, selection {100 * fit['select_miss']:.1f} % | | | "
            f"plan {verdict} |"
        )
        choice = result["lp_choice"]
        print(
            f"| {result['dtype']} | LP choice at half budget | picked {choice['picked']}, "
            f"faster measured {choice['faster']} | | | {'match' if choice['match'] else 'MISS'} |"
        )


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    results = [bench_dtype(args, dtype.strip()) for dtype in args.dtype.split(",")]
    print_table(results)
    errors = [row["error"] for result in results for row in result["rows"]]
    report = {
        "benchmark": "cost_model_fidelity",
        "model": args.model,
        "batch": args.batch,
        "prompt_tokens": args.prompt_tokens,
        "repeats": args.repeats,
        "environment": environment(args.threads),
        "results": results,
        "target_within_20pct": all(abs(e) <= 0.2 for e in errors),
        # Issue 67: every row within 20 %, or the plan refused by the profile's own fit check.
        "within_20pct_or_refused": all(
            result["plan_refused"] or all(abs(row["error"]) <= 0.2 for row in result["rows"])
            for result in results
        ),
        "lp_picks_faster": all(result["lp_choice"]["match"] for result in results),
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
