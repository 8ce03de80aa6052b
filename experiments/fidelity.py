"""Fidelity of KV policies on SmolLM2: decode-regime WikiText-2 perplexity and passkey accuracy.

    python -m experiments.fidelity             # both protocols (about 50 min on 2 cores)
    python -m experiments.fidelity --segments 2 --segment-tokens 256 --ratios 0.2  # quick
    python -m experiments.fidelity --protocols streaming --preset paper   # ALISA's protocol, v0.1

Perplexity rows are named by protocol: ``streaming`` (compress from the first token) or
``prefill`` (the first half of each segment prefilled densely, compressed, the rest scored).

Prints a table and, as the last line, one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

from alisa import AlisaConfig, load_model
from alisa.assignments import parse_assignments
from alisa.logs import log_to_stderr
from experiments.data import data_dir, load_niah, load_passkey, load_wikitext2
from experiments.tasks.passkey import passkey_accuracy
from experiments.tasks.perplexity import (
    PROTOCOLS,
    decode_perplexity,
    protocol_prefill,
    text_segments,
)
from experiments.tasks.retrieval import retrieval_accuracy

POLICIES = ("dense", "swa", "h2o", "tova", "streaming", "local", "strided")
TASKS = ("perplexity", "passkey", "niah")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--ratios", default="1.0,0.5,0.2")
    parser.add_argument("--segment-tokens", type=int, default=1024)
    parser.add_argument("--segments", type=int, default=4, help="run as one batch")
    parser.add_argument(
        "--protocols",
        default="streaming,prefill",
        help="comma list of perplexity protocols: streaming (compress from the first token), "
        "prefill (prefill part of each segment densely, compress, score the rest)",
    )
    parser.add_argument(
        "--prefill-share",
        type=float,
        default=0.5,
        help="prefill protocol: share of each segment prefilled before compression",
    )
    parser.add_argument(
        "--preset",
        default="default",
        choices=("default", "paper"),
        help="default: alisa's defaults (floor, sinks, per-head, observation window); paper: "
        "each paper's own setting",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="set an AlisaConfig field of every sparse row, typed by the field, e.g. "
        "per_head=false or gpu_memory=2GiB",
    )
    parser.add_argument("--passkey-ratio", type=float, default=0.2)
    parser.add_argument("--passkey-max-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--sink-tokens", type=int, default=None, help="override the policies' attention sinks"
    )
    parser.add_argument(
        "--retention",
        default="drop",
        choices=("drop", "host"),
        help="drop: evicted tokens are gone (the paper); host: every token kept on the host, "
        "each step attends to the best r*n per KV head",
    )
    parser.add_argument(
        "--host-bits", type=int, default=8, help="precision of the host region (retention host)"
    )
    parser.add_argument(
        "--tasks",
        default="perplexity,passkey",
        help="comma list of perplexity, passkey, niah (RULER single needle, same ratio and "
        "length limit as passkey)",
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.tasks.split(",")) - set(TASKS))
    if unknown:
        parser.error(f"--tasks: unknown {unknown}; valid: {', '.join(TASKS)}")
    unknown = sorted(set(args.protocols.split(",")) - set(PROTOCOLS))
    if unknown:
        parser.error(f"--protocols: unknown {unknown}; valid: {', '.join(PROTOCOLS)}")
    try:
        args.overrides = parse_assignments(AlisaConfig, args.set)
        make_config(args, "swa", 0.5)
    except ValueError as error:
        parser.error(f"--set: {error}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    log_to_stderr()
    torch.set_num_threads(args.threads)
    root = data_dir(args.data_dir)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    ratios = [float(r) for r in args.ratios.split(",")]
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    tasks = args.tasks.split(",")
    segments = text_segments(tokenizer, load_wikitext2(root), args.segment_tokens, args.segments)
    started = time.perf_counter()
    perplexity: dict[str, dict[str, float]] = {}
    niah = {}
    for protocol in args.protocols.split(",") if "perplexity" in tasks else ():
        prefill = protocol_prefill(protocol, segments.shape[1], args.prefill_share)
        rows = perplexity.setdefault(protocol, {})
        for policy in policies:
            for ratio in [1.0] if policy == "dense" else ratios:
                config = make_config(args, policy, ratio)
                result = decode_perplexity(model, segments, config, prefill_tokens=prefill)
                rows[f"{policy}@{ratio:g}"] = result.perplexity
                print(
                    f"ppl {protocol} {policy:9s} r={ratio:<4g} {result.perplexity:8.3f}",
                    file=sys.stderr,
                )
    passkey = {}
    rows = load_passkey(root)
    for policy in policies if "passkey" in tasks else ():
        ratio = 1.0 if policy == "dense" else args.passkey_ratio
        config = make_config(args, policy, ratio)
        result = passkey_accuracy(
            model, tokenizer, rows, config, max_prompt_tokens=args.passkey_max_tokens
        )
        passkey[f"{policy}@{ratio:g}"] = {"accuracy": result.accuracy, "n": result.total}
        print(
            f"passkey {policy:9s} r={ratio:<4g} {result.accuracy:.3f} ({result.total})",
            file=sys.stderr,
        )
    for policy in policies if "niah" in tasks else ():
        ratio = 1.0 if policy == "dense" else args.passkey_ratio
        result = retrieval_accuracy(
            model,
            tokenizer,
            load_niah(root),
            make_config(args, policy, ratio),
            kind="niah",
            max_prompt_tokens=args.passkey_max_tokens,
        )
        niah[f"{policy}@{ratio:g}"] = {"accuracy": result["accuracy"], "n": result["n"]}
        print(f"niah {policy:9s} r={ratio:<4g} {result['accuracy']:.3f}", file=sys.stderr)
    report = {
        "benchmark": "fidelity",
        "model": args.model,
        "dtype": args.dtype,
        "segments": args.segments,
        "segment_tokens": args.segment_tokens,
        "perplexity": perplexity,
        "prefill_share": args.prefill_share,
        "preset": args.preset,
        "overrides": args.overrides,
        "passkey": passkey,
        "niah": niah,
        "passkey_max_tokens": args.passkey_max_tokens,
        "sink_tokens": args.sink_tokens,
        "retention": args.retention,
        "host_bits": args.host_bits if args.retention == "host" else None,
        "targets": targets(perplexity, ratios),
        "seconds": round(time.perf_counter() - started, 1),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "threads": args.threads,
    }
    for protocol, rows in perplexity.items():
        print(f"protocol: {protocol}")
        print_table(rows, passkey, policies, ratios)
    print(json.dumps(report))
    return 0


def make_config(args, policy: str, ratio: float) -> AlisaConfig:
    """The configuration of one row: policy, r, and the run's sinks, retention, preset and
    ``--set`` fields (sparse rows only: dense keeps everything anyway)."""
    config = AlisaConfig(
        policy=policy,
        caching_ratio=ratio,
        # The --sink-tokens override is for sparse policies (dense keeps everything anyway).
        sink_tokens=None if policy == "dense" else args.sink_tokens,
        retention="drop" if policy == "dense" else args.retention,  # nothing to keep on the host
        host_bits=args.host_bits,
        preset=args.preset,
    )
    return config if policy == "dense" else config.with_overrides(**args.overrides)


def targets(perplexity: dict, ratios: list[float]) -> dict:
    """The issues' targets, per protocol, on what was measured (None when not measured).

    ``swa_best_or_tied``: SWA's perplexity within 1 % of the best evicting policy at every r.
    """
    result = {}
    for protocol, rows in perplexity.items():
        dense, swa = rows.get("dense@1"), rows.get("swa@0.2")
        within = None if dense is None or swa is None else swa <= 1.05 * dense
        best = []
        for ratio in ratios:
            scores = {
                key.split("@")[0]: value
                for key, value in rows.items()
                if key.endswith(f"@{ratio:g}") and not key.startswith("dense@")
            }
            if "swa" in scores and len(scores) > 1:
                best.append(scores["swa"] <= 1.01 * min(scores.values()))
        result[protocol] = {
            "swa_r0.2_within_5pct_of_dense": within,
            "swa_best_or_tied": all(best) if best else None,
        }
    return result


def print_table(perplexity: dict, passkey: dict, policies: list[str], ratios: list[float]) -> None:
    header = "| policy | " + " | ".join(f"ppl r={r:g}" for r in ratios) + " | passkey |"
    print(header)
    print("|" + "---|" * (len(ratios) + 2))
    for policy in policies:
        cells = []
        for ratio in ratios:
            value = perplexity.get(f"{policy}@{ratio:g}", perplexity.get(f"{policy}@1"))
            cells.append(f"{value:.3f}" if value is not None else "")
        key = next((k for k in passkey if k.startswith(f"{policy}@")), None)
        accuracy = f"{passkey[key]['accuracy']:.2f} ({key.split('@')[1]})" if key else ""
        print(f"| {policy} | " + " | ".join(cells) + f" | {accuracy} |")


if __name__ == "__main__":
    sys.exit(main())
