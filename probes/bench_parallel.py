"""2 ranks x 1 thread against 1 process on this machine: KV-Runahead prefill, and ``alisa batch``.

    python -m probes.bench_parallel prefill                 # SmolLM2, 4096-token prompt
    python -m probes.bench_parallel prefill --tokens 1024   # quick
    python -m probes.bench_parallel batch                   # 64 XSum prompts, SmolLM2 bf16
    python -m probes.bench_parallel batch --prompts 8 --new-tokens 4   # quick

``prefill``: time to first token of 1 process x 2 threads, and of 2 ranks x 1 thread with KVR-E
(even split), KVR-S (grid search on measured TTFT), KVR-P (a table searched at half the length,
interpolated) and TSP (even split, all-gather); CPU-seconds per rank, bytes sent and the fraction
of the bound TTFT(1)/2 * (1/p + 1/p^2). Targets: KVR-S >= 1.3x one process and >= 1.2x TSP. Also
how many greedy tokens sharded decode shares with one process (dense exact, SWA approximate).

``batch``: one ``alisa batch`` command line run twice in fresh processes with
``OMP_NUM_THREADS=1``, plain and under ``torchrun --standalone --nproc-per-node 2``, over XSum
articles (``--data-dir``) cut to lengths spread over [--min-tokens, --max-tokens]. Rows per
second divide the rows by the job's generation time from its summary line (the slowest rank's;
model loading left out); the command's wall time is reported too. Target: ratio >= 1.8.

Each prints a table, then one JSON line with :func:`experiments.timing.environment`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments.data import REPO_ROOT, data_dir

SUMMARY = re.compile(r"\[alisa batch\] (\d+) prompts done .* tokens in ([\d.]+) s")
REPEATS = 3
POLICIES = {"dense": 1.0, "swa": 0.2}  # sharded decode's policies and their caching ratios


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    prefill = modes.add_parser("prefill", help="KV-Runahead and TSP prefill vs one process")
    prefill.add_argument("--tokens", type=int, default=4096, help="prompt tokens")
    prefill.add_argument("--dtype", default="float32")
    batch = modes.add_parser("batch", help="alisa batch on 2 torchrun ranks vs one process")
    add = batch.add_argument
    add("--model", default="smollm2-135m")
    add("--dtype", default="bfloat16")
    add("--data-dir", default=None)
    add("--prompts", type=int, default=64)
    add("--min-tokens", type=int, default=96)
    add("--max-tokens", type=int, default=384)
    add("--new-tokens", type=int, default=64)
    add("--max-batch", type=int, default=8)
    add("--flags", default="", help="more `alisa batch` flags for both runs, e.g. '--policy swa'")
    return parser.parse_args(argv)


# --------------------------------------------------------------------------- prefill


def prompt_ids(tokenizer, tokens: int):
    """The first ``tokens`` tokens of WikiText-2, as a (1, tokens) tensor."""
    import torch

    from experiments.data import load_wikitext2

    return torch.tensor([tokenizer(load_wikitext2(data_dir()))["input_ids"][:tokens]])


def _rank(rank: int, world: int, tokens: int, dtype: str, table_path: str, queue) -> None:
    """One rank's prefills of every split (medians of ``REPEATS``) and sharded decodes."""
    import torch
    import torch.distributed as dist

    from alisa import AlisaConfig, load_model
    from alisa.parallel import ParallelConfig, PartitionTable, parallel_generate
    from alisa.parallel.generate import choose_bounds, prefill

    torch.set_num_threads(1)
    model, tokenizer = load_model("smollm2-135m", dtype=dtype)
    ids, config = prompt_ids(tokenizer, tokens), AlisaConfig()
    # KVR-P's table: a split searched at half this length (as a table built offline would be),
    # applied to this length by the table's interpolation (nearest entry beyond its range).
    search = ParallelConfig(mode="kvr", partition="search")
    searched = choose_bounds(model, prompt_ids(tokenizer, tokens // 2), search, config)
    if rank == 0:
        table = PartitionTable("bench")
        table.add(searched)
        table.save(table_path)
    dist.barrier()
    splits = {
        "KVR-E": ParallelConfig(mode="kvr"),
        "TSP": ParallelConfig(mode="tsp"),
        "KVR-S": search,
        "KVR-P": ParallelConfig(
            mode="kvr", partition="table", table_path=table_path, table_key="bench"
        ),
    }
    results = {}
    for name, parallel in splits.items():
        bounds = choose_bounds(model, ids, parallel, config)
        runs = [prefill(model, ids, bounds, parallel, config) for _ in range(REPEATS)]
        ttft = torch.tensor([statistics.median(r.ttft_s for r in runs)])
        dist.broadcast(ttft, src=world - 1)
        cpu = statistics.median(r.cpu_s for r in runs)
        mine = torch.tensor([cpu, runs[0].bytes_sent], dtype=torch.float64)
        every = [torch.zeros(2, dtype=mine.dtype) for _ in range(world)]
        dist.all_gather(every, mine)
        results[name] = {
            "ttft_s": float(ttft),
            "bounds": bounds,
            "cpu_s_per_rank": [float(cpu) for cpu, _ in every],
            "bytes_sent": sum(float(sent) for _, sent in every),
        }
    text = tokenizer.decode(ids[0, :1024])
    for policy, ratio in POLICIES.items():
        config = AlisaConfig(policy=policy, caching_ratio=ratio)
        sharded = ParallelConfig(decode="sharded")
        out = parallel_generate(model, tokenizer, text, config, sharded, max_new_tokens=32)
        results[f"sharded-{policy}"] = out.token_ids[0] if rank == world - 1 else None
    if rank == world - 1:
        queue.put(results)


def one_process(tokens: int, dtype: str) -> tuple[float, dict[str, list[int]]]:
    """Median TTFT of 1 process x 2 threads, and its greedy tokens under each policy."""
    import torch

    from alisa import AlisaCache, AlisaConfig, generate, load_model
    from experiments.timing import median_seconds

    torch.set_num_threads(2)
    model, tokenizer = load_model("smollm2-135m", dtype=dtype)
    ids = prompt_ids(tokenizer, tokens)

    @torch.inference_mode()
    def forward() -> None:
        model(input_ids=ids, past_key_values=AlisaCache(model), logits_to_keep=1)

    text = tokenizer.decode(ids[0, :1024])
    references = {}
    for policy, ratio in POLICIES.items():
        config = AlisaConfig(policy=policy, caching_ratio=ratio)
        output = generate(model, tokenizer, text, config, max_new_tokens=32, compile="off")
        references[policy] = output.token_ids[0]
    return median_seconds(forward, repeats=REPEATS), references


def run_prefill(args: argparse.Namespace) -> dict:
    """The prefill comparison: prints its table, returns its JSON fields."""
    import torch.multiprocessing as mp

    from alisa.parallel.dist import spawn

    single, references = one_process(args.tokens, args.dtype)
    table = str(Path(tempfile.mkdtemp(prefix="alisa-kvr-")) / "table.json")
    queue = mp.get_context("spawn").Queue()
    spawn(_rank, 2, args.tokens, args.dtype, table, queue, timeout_s=900)
    results = queue.get(timeout=30)
    bound = single / 2 * (1 / 2 + 1 / 4)
    rows = [{"system": "1 process x 2 threads", "ttft_s": single}]
    for name in ("KVR-E", "KVR-S", "KVR-P", "TSP"):
        ttft = results[name]["ttft_s"]
        rows.append(
            {
                "system": f"{name} (2 ranks x 1 thread)",
                **results[name],
                "speedup": single / ttft,
                "fraction_of_bound": bound / ttft,
            }
        )
    agreement = {
        policy: sum(a == b for a, b in zip(tokens, results[f"sharded-{policy}"], strict=False))
        / max(len(tokens), 1)
        for policy, tokens in references.items()
    }
    print(f"prompt {args.tokens} tokens, {args.dtype}; bound TTFT(1)/2*(1/p+1/p^2) = {bound:.2f} s")
    print("| system | TTFT s | speed-up | CPU-s per rank | bytes sent | split | of bound |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        cpu = "/".join(f"{c:.2f}" for c in row.get("cpu_s_per_rank", []))
        print(
            f"| {row['system']} | {row['ttft_s']:.2f} | {row.get('speedup', 1.0):.2f}x | {cpu} | "
            f"{row.get('bytes_sent', 0) / 2**20:.1f} MiB | {row.get('bounds', '')} | "
            f"{row.get('fraction_of_bound', 0):.0%} |"
        )
    print(
        f"sharded decode vs one process, greedy tokens equal: dense {agreement['dense']:.0%}, "
        f"SWA r=0.2 (approximation) {agreement['swa']:.0%}"
    )
    kvr_s, tsp = results["KVR-S"]["ttft_s"], results["TSP"]["ttft_s"]
    return {
        "benchmark": "parallel_prefill",
        "tokens": args.tokens,
        "rows": rows,
        "kvr_s_over_single": single / kvr_s,
        "kvr_s_over_tsp": tsp / kvr_s,
        "target_kvr_s_1.3x_single": single / kvr_s >= 1.3,
        "target_kvr_s_1.2x_tsp": tsp / kvr_s >= 1.2,
        "sharded_agreement": agreement,
    }


# --------------------------------------------------------------------------- batch


def run_job(launcher: list[str], source: Path, target: Path, args) -> dict:
    """One ``alisa batch`` run in fresh processes: rows, generation seconds, wall seconds."""
    command = [*launcher, "-m", "alisa", "batch", str(source), "-o", str(target), "--no-progress"]
    command += ["--model", args.model, "--dtype", args.dtype, "--max-new-tokens"]
    command += [str(args.new_tokens), "--max-batch", str(args.max_batch), *args.flags.split()]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    started = time.perf_counter()
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    match = SUMMARY.search(done.stderr)
    if done.returncode != 0 or match is None:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    rows = len(target.read_text().splitlines())
    seconds = max(float(match.group(2)), 0.05)  # the line rounds to 0.1 s (tiny runs: 0.0)
    return {"rows": rows, "seconds": seconds, "rows_per_s": rows / seconds, "wall_s": wall}


def run_batch(args: argparse.Namespace) -> dict:
    """The ``alisa batch`` comparison: prints its table, returns its JSON fields."""
    from transformers import AutoTokenizer

    from alisa.model.loading import resolve_model_path
    from experiments.data import build_prompts

    work = Path(tempfile.mkdtemp(prefix="alisa-bench-distributed-"))
    source = work / "prompts.jsonl"
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model))
    root = data_dir(args.data_dir)
    build_prompts(tokenizer, root, args.prompts, args.min_tokens, args.max_tokens, source)
    python = [sys.executable]
    torchrun = [*python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    one = {"run": "1 process x 1 thread", **run_job(python, source, work / "one.jsonl", args)}
    two = {"run": "2 ranks x 1 thread", **run_job(torchrun, source, work / "two.jsonl", args)}
    ratio = two["rows_per_s"] / one["rows_per_s"]
    print(f"{args.prompts} prompts, {args.new_tokens} new tokens, {args.model} {args.dtype}")
    print("| run | rows | generation s | rows/s | wall s |")
    print("|---|---|---|---|---|")
    for row in (one, two):
        print(
            f"| {row['run']} | {row['rows']} | {row['seconds']:.1f} | {row['rows_per_s']:.2f} | "
            f"{row['wall_s']:.1f} |"
        )
    print(f"2 ranks / 1 process: {ratio:.2f}x rows per second (target >= 1.8x)")
    return {
        "benchmark": "distributed_batch",
        "model": args.model,
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "one_process": one,
        "two_ranks": two,
        "ratio": ratio,
        "target_1_8x": ratio >= 1.8,
    }


def main(argv=None) -> int:
    args = parse_args(argv)

    try:
        report = (run_prefill if args.mode == "prefill" else run_batch)(args)
    except ValueError as error:  # missing data: one clear line
        print(f"bench_parallel {args.mode}: error: {error}", file=sys.stderr)
        return 1
    from experiments.timing import environment

    machine = environment(None)  # each row says its processes and threads
    print(json.dumps({**report, "dtype": args.dtype, "machine": machine}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
