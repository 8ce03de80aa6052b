"""``alisa batch`` over 2 torchrun ranks x 1 thread vs 1 process x 1 thread: rows per second.

    python -m experiments.bench_distributed_batch               # 64 XSum prompts, SmolLM2
    python -m experiments.bench_distributed_batch --prompts 8 --new-tokens 4    # quick look

The prompt file is 64 XSum articles (``xsum/h2o_xsum_0shot.jsonl`` under ``--data-dir``,
``$ALISA_DATA_DIR`` or ``../shared/data``; a clear error when absent) cut to lengths spread over
[--min-tokens, --max-tokens] with the model's tokenizer. Both runs are the same ``alisa batch``
command line with the same flags, each in fresh processes with ``OMP_NUM_THREADS=1``; the 2-rank
run is ``torchrun --standalone --nproc-per-node 2 -m alisa batch ...``. Rows per second divide
the rows by the job's generation time from its summary line (the slowest rank's, so waiting for
it counts; model loading does not); the command's wall time is reported too. Prints a table,
then one JSON line (target: ratio >= 1.8).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments.bench_batch import build_prompts
from experiments.data import REPO_ROOT, data_dir

SUMMARY = re.compile(r"\[alisa batch\] (\d+) prompts done .* tokens in ([\d.]+) s")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--min-tokens", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument(
        "--flags", default="", help="more `alisa batch` flags for both runs, e.g. '--policy swa'"
    )
    return parser.parse_args(argv)


def run_job(launcher: list[str], source: Path, target: Path, args) -> dict:
    """One ``alisa batch`` run in fresh processes: rows, generation seconds, wall seconds."""
    command = launcher + ["-m", "alisa", "batch", str(source), "-o", str(target)]
    command += ["--model", args.model, "--dtype", args.dtype, "--no-progress"]
    command += ["--max-new-tokens", str(args.new_tokens), "--max-batch", str(args.max_batch)]
    command += args.flags.split()
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


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from alisa.model.loading import resolve_model_path

    work = Path(tempfile.mkdtemp(prefix="alisa-bench-distributed-"))
    source = work / "prompts.jsonl"
    try:  # missing data: one clear line before any work
        root = data_dir(args.data_dir)
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model))
        build_prompts(tokenizer, root, args.prompts, args.min_tokens, args.max_tokens, source)
    except ValueError as error:
        print(f"bench_distributed_batch: error: {error}", file=sys.stderr)
        return 1
    python = [sys.executable]
    torchrun = python + ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    runs = {
        "1 process x 1 thread": run_job(python, source, work / "one.jsonl", args),
        "2 ranks x 1 thread": run_job(torchrun, source, work / "two.jsonl", args),
    }
    one, two = runs.values()
    ratio = two["rows_per_s"] / one["rows_per_s"]
    print(f"{args.prompts} prompts, {args.new_tokens} new tokens, {args.model} {args.dtype}")
    print("| run | rows | generation s | rows/s | wall s |")
    print("|---|---|---|---|---|")
    for name, row in runs.items():
        print(
            f"| {name} | {row['rows']} | {row['seconds']:.1f} | {row['rows_per_s']:.2f} | "
            f"{row['wall_s']:.1f} |"
        )
    print(f"2 ranks / 1 process: {ratio:.2f}x rows per second (target >= 1.8x)")
    print(
        json.dumps(
            {
                "benchmark": "distributed_batch",
                "model": args.model,
                "dtype": args.dtype,
                "prompts": args.prompts,
                "new_tokens": args.new_tokens,
                "one_process": one,
                "two_ranks": two,
                "ratio": ratio,
                "target_1_8x": ratio >= 1.8,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
