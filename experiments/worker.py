"""Time one KV-cache system in a fresh process (clean peak memory); prints one JSON line.

Run by :func:`run_in_subprocess` with one argument, the JSON of its options (``system`` and
``bench_speed``'s workload flags); by hand, ``python -m experiments.bench_speed --systems S``
runs one system this way. ``system`` :data:`PROFILE` measures the model's hardware profile
instead (as ``alisa profile``, a fresh process too) and prints it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

# What a worker reads that a caller may leave out (bench_speed's defaults).
DEFAULTS = {"data_dir": None, "prompts": "text", "text": None}
PROFILE = "profile"  # the system name that calibrates instead (:func:`calibrate`)


def add_prompts_argument(parser: argparse.ArgumentParser) -> None:
    """``--prompts text|random`` and ``--text FILE`` (the worker's, and every benchmark that
    passes them on)."""
    parser.add_argument(
        "--text", default=None, help="a UTF-8 text file for the prompts instead of WikiText-2"
    )
    parser.add_argument(
        "--prompts",
        choices=("text", "random"),
        default="text",
        help="text: WikiText-2 windows (or --text); random: seeded random letters, and a shape "
        "model takes the byte tokenizer (no data or tokenizer package needed)",
    )


def prompts_of_length(tokenizer, text: str, tokens: int, count: int) -> list[str]:
    """``count`` different windows of a text, each exactly ``tokens`` tokens long."""
    return windows_of_length(tokenizer, tokenizer(text)["input_ids"], tokens, count)


def windows_of_length(tokenizer, ids: list[int], tokens: int, count: int) -> list[str]:
    """:func:`prompts_of_length` of a text already tokenized (``ids``)."""
    stride = max(1, (len(ids) - tokens) // count)
    windows = [ids[i * stride : i * stride + tokens] for i in range(count)]
    # Decoding and re-encoding can merge a few tokens; trim again to the exact length.
    return [tokenizer.decode(tokenizer(tokenizer.decode(w))["input_ids"][:tokens]) for w in windows]


def load_workload(args: argparse.Namespace):
    """(model, tokenizer, prompts) of a run: ``args.batch`` prompts of ``args.prompt_tokens``."""
    import torch

    from experiments.data import data_dir, load_text, load_wikitext2
    from experiments.shapes import load_benchmark_model, random_prompts

    torch.set_num_threads(args.threads)
    random = args.prompts == "random"
    model, tokenizer = load_benchmark_model(
        args.model, dtype=args.dtype, tokenizer="bytes" if random else "smollm2"
    )
    if random:
        return model, tokenizer, random_prompts(args.prompt_tokens, args.batch)
    if args.text is not None:
        text, _ = load_text(None, args.text)
    else:
        text = load_wikitext2(data_dir(args.data_dir))
    return model, tokenizer, prompts_of_length(tokenizer, text, args.prompt_tokens, args.batch)


def measure(args: argparse.Namespace) -> dict:
    if args.system == PROFILE:
        return calibrate(args)
    model, tokenizer, prompts = load_workload(args)
    return measure_system(model, tokenizer, prompts, args.system, args.new_tokens)


def calibrate(args: argparse.Namespace) -> dict:
    """The hardware profile ``alisa profile`` measures for ``args.model`` in ``args.dtype``,
    calibrated at (``args.batch``, ``args.prompt_tokens``): ``{"profile": its fields,
    "terms": each measured term's spread}``, in a fresh process, as a
    user runs it (in a process that ran other work first, the calibration steps ran up to 28 %
    slower than the same steps alone: docs/results.md, stop 72)."""
    from dataclasses import asdict

    import torch

    from alisa.calibration.profile import measure_report
    from experiments.shapes import load_benchmark_model

    torch.set_num_threads(args.threads)
    tokenizer = "bytes" if args.prompts == "random" else "smollm2"
    model, _ = load_benchmark_model(args.model, dtype=args.dtype, tokenizer=tokenizer)
    report = measure_report(model, sizes=(args.batch, args.prompt_tokens))
    return {"profile": asdict(report.profile), "terms": [asdict(t) for t in report.terms]}


def measure_system(model, tokenizer, prompts: list[str], system: str, new_tokens: int) -> dict:
    """One system's row: a warm-up on short prompts, then ``prompts`` timed step by step."""
    from alisa import AlisaCache, generate
    from experiments.systems import compile_setting, make_cache

    def run(batch, new_tokens):
        width = tokenizer(batch, padding=True, return_tensors="pt")["input_ids"].shape[1]
        cache, config = make_cache(system, model, max_cache_len=width + new_tokens)
        if config is not None:  # as generate() would build it, kept to report its placement
            cache = AlisaCache(model, config, max_new_tokens=new_tokens)
        result = generate(
            model,
            tokenizer,
            batch,
            config,
            max_new_tokens=new_tokens,
            past_key_values=cache,
            stop_at_eos=False,
            compile=compile_setting(system),
        )
        return result, cache

    run([p[: max(1, len(p) // 8)] for p in prompts], 4)  # warm-up: kernels, allocator
    result, cache = run(prompts, new_tokens)
    return system_row(system, model, prompts, result, cache)


def system_row(system: str, model, prompts: list[str], result, cache) -> dict:
    """A benchmark row of one system's timed ``result`` (a ``GenerationOutput`` with its tier
    bytes and peak memory) on ``prompts``, with the ``cache`` it ran on."""
    from alisa import AlisaCache

    median = statistics.median(result.step_times_s)
    return {
        "system": system,
        # which backend ran and the weights' product form settled on (machine: environment())
        "kernels": result.kernels,
        "placement": placement(cache) if isinstance(cache, AlisaCache) else None,
        "batch": len(prompts),
        "decode_tokens_per_s": len(prompts) / median,
        "median_step_ms": median * 1000,
        "ttft_s": result.ttft_s,
        # the first compiled step's seconds (tracing, code generation); None when eager
        "compile_s": result.compile_s,
        "kv_bytes": result.kv_bytes,
        "peak_kv_bytes": result.peak_kv_bytes,
        "kv_tier_bytes": result.kv_tier_bytes,
        # what every token's K/V would take at float32 (the memory ratios divide by it)
        "dense_fp32_kv_bytes": dense_fp32_bytes(model, result),
        # resident memory on a CPU, CUDA's peak allocation on a GPU
        "peak_rss_bytes": result.peak_memory_bytes,
        "weight_bytes": sum(p.nbytes for p in model.parameters()),  # tied ones once
        "generated_tokens": result.generated_tokens,
        "token_ids": result.token_ids,
    }


def dense_fp32_bytes(model, result) -> int:
    """Bytes of float32 K and V for every token of the run, all layers and KV heads."""
    from alisa.model.adapter import model_shape

    shape = model_shape(model)
    tokens = sum(result.prompt_tokens) + result.generated_tokens - len(result.token_ids)
    return 2 * 4 * tokens * shape.num_layers * shape.num_kv_heads * shape.head_dim


def placement(cache) -> dict[str, float]:
    """Fractions of an ``AlisaCache``'s stored tokens per tier, as it really placed them (the
    scheduler's g / c / x / w)."""
    counts = cache.tier_tokens()
    total = max(1, sum(counts.values()))
    return {
        "g": counts["device"] / total,
        "c": counts["host"] / total,
        "x": counts["recompute"] / total,
        "w": 0.0,
    }


def run_in_subprocess(system: str, options: dict) -> dict:
    """Run the worker for one system in a child process with the same environment; ``options``:
    ``model``, ``dtype``, ``batch``, ``prompt_tokens``, ``new_tokens``, ``threads`` and those of
    :data:`DEFAULTS`."""
    import subprocess

    command = [
        sys.executable,
        "-m",
        "experiments.worker",
        json.dumps({**options, "system": system}),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"worker for {system!r} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(json.dumps(measure(argparse.Namespace(**{**DEFAULTS, **json.loads(sys.argv[1])}))))
