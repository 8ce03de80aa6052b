"""Where one RULER sample's answer is decided: each system's greedy answer with its leading
candidates and margin at every step, and where it departs from the reference system's.

    python -m probes.ruler_probe --model gemma3-270m --dtype float32 --family niah_single \\
        --length 16384 --sample 4 \\
        --systems 'hf-dynamic;alisa:kv_bits=8;alisa:policy=swa,caching_ratio=0.1,retention=host'

A sample a compressed cache gets wrong may be one the dense model itself barely gets right: if
dense chooses a digit by a few hundredths of a logit, any change to the keys or values (INT8
codes, a budget) can flip it, and the miss says little about what the cache retrieves. This
probe generates the sample exactly as the runner's ``ruler`` task does (same seed and options),
prefills it once for every system (:mod:`experiments.tasks.ruler.shared`), then decodes each
system greedily, recording per step its top ``--top`` tokens and margin (top-1 minus top-2
logit). For each system after the first (the reference, normally ``hf-dynamic``) it reports the
first step where its token differs from the reference's, with both margins there. RULER:
https://arxiv.org/abs/2404.06654. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from experiments.tasks.ruler.families import FAMILIES, Sample


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="alisa.load_model spec")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--family", default="niah_single", help=f"one of {sorted(FAMILIES)}")
    parser.add_argument("--length", type=int, default=4096, help="prompt + answer tokens")
    parser.add_argument("--sample", type=int, default=0, help="sample index (the runner's)")
    parser.add_argument("--seed", type=int, default=0, help="options.ruler.seed")
    parser.add_argument(
        "--samples",
        type=int,
        default=None,
        help="options.ruler.samples of the run probed (only niah_grid's depths depend on it); "
        "default: --sample + 1",
    )
    parser.add_argument(
        "--systems",
        default="hf-dynamic;alisa:policy=swa,caching_ratio=0.1,retention=host",
        help="';'-separated experiments.systems names; the first is the reference",
    )
    parser.add_argument("--steps", type=int, default=None, help="default: the family's budget")
    parser.add_argument("--top", type=int, default=3, help="candidates shown per step")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--data-dir", default=None, help="holds wikitext2/ (the haystack)")
    parser.add_argument("--haystack", default=None, help="a UTF-8 text file instead")
    args = parser.parse_args(argv)
    if args.family not in FAMILIES:
        parser.error(f"--family={args.family!r} is unknown; valid: {', '.join(sorted(FAMILIES))}")
    for name, low in (("length", 1), ("sample", 0), ("seed", 0), ("top", 2), ("threads", 1)):
        if getattr(args, name) < low:
            parser.error(f"--{name}={getattr(args, name)} must be at least {low}")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps={args.steps} must be at least 1")
    args.samples = args.sample + 1 if args.samples is None else args.samples
    if args.samples <= args.sample:
        parser.error(f"--samples={args.samples} must exceed --sample={args.sample}")
    args.systems = [name.strip() for name in args.systems.split(";") if name.strip()]
    if len(args.systems) < 2:
        parser.error(f"--systems={args.systems!r}: name a reference and at least one more")
    from experiments.tasks.ruler.shared import check_system

    for name in args.systems:
        try:
            check_system(name)
        except ValueError as error:
            parser.error(f"--systems: {error}")
    return args


def greedy_steps(
    model, tokenizer, input_ids: torch.Tensor, cache, logits: torch.Tensor, steps: int, top: int
) -> tuple[list[dict], str]:
    """Decode one prefilled prompt greedily as the runner does (its own decode call), recording
    each step's leaders.

    Parameters
    ----------
    input_ids
        (1, L) the prompt, already prefilled into ``cache``.
    logits
        (1, V) the prefill's last-position logits (the first step's).

    Returns
    -------
    tuple
        (per step, stopping after EOS: ``token`` (the id chosen), ``text``, ``candidates``
        ([text, logit] of the ``top`` highest) and ``margin`` (top-1 minus top-2 logit); the
        decoded answer).
    """
    from experiments.tasks.ruler.shared import decode_after_prefill

    leaders = []  # (values, ids) per step, read once decoding is over: no host reads in between
    result = decode_after_prefill(
        model,
        tokenizer,
        input_ids,
        None,
        cache,
        logits,
        max_new_tokens=steps,
        observe=lambda step_logits: leaders.append(step_logits[0].float().topk(top)),
    )
    records = []
    for token, (values, ids) in zip(result.token_ids[0], leaders, strict=True):
        values, ids = values.tolist(), ids.tolist()
        records.append(
            {
                "token": token,
                "text": tokenizer.decode([token]),
                "candidates": [
                    [tokenizer.decode([i]), round(v, 4)] for v, i in zip(values, ids, strict=True)
                ],
                "margin": round(values[0] - values[1], 4),
            }
        )
    return records, result.texts[0]


def departure(reference: list[dict], steps: list[dict]) -> dict | None:
    """The first step where ``steps`` chose another token than ``reference``: its index, both
    tokens and both margins; None where one is a prefix of the other."""
    for index, (ours, theirs) in enumerate(zip(steps, reference, strict=False)):
        if ours["token"] != theirs["token"]:
            return {
                "step": index,
                "reference": theirs["text"],
                "reference_margin": theirs["margin"],
                "chosen": ours["text"],
                "margin": ours["margin"],
            }
    return None


def probe(model, tokenizer, sample: Sample, systems: list[str], steps: int, top: int) -> list[dict]:
    """Prefill ``sample`` once for every system and decode each; one row per system.

    Returns
    -------
    list of dict
        ``system``, ``prediction``, ``score`` (RULER's string match), ``steps``
        (:func:`greedy_steps`) and ``departure`` (:func:`departure` from the first system's).
    """
    from experiments.tasks.ruler.families import string_match_all
    from experiments.tasks.ruler.shared import shared_prefill, system_cache

    ids = torch.tensor([sample.input_ids], device=next(model.parameters()).device)
    caches = [system_cache(name, model, max_new_tokens=steps) for name in systems]
    logits, _ = shared_prefill(model, ids, None, caches)
    rows = []
    for index, name in enumerate(systems):
        cache, caches[index] = caches[index], None  # freed once decoded
        records, text = greedy_steps(model, tokenizer, ids, cache, logits, steps, top)
        rows.append(
            {
                "system": name,
                "prediction": text,
                "score": string_match_all(text, sample.references),
                "steps": records,
                "departure": departure(rows[0]["steps"], records) if rows else None,
            }
        )
    return rows


def print_table(rows: list[dict], shown: int = 6) -> None:
    """Each system's answer and departure, then its first ``shown`` steps' leaders."""
    print("| system | score | prediction | departs at | reference (margin) | chosen (margin) |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        gone = row["departure"]
        where = (
            ["-", "-", "-"]
            if gone is None
            else [
                str(gone["step"]),
                f"{gone['reference']!r} ({gone['reference_margin']:.3f})",
                f"{gone['chosen']!r} ({gone['margin']:.3f})",
            ]
        )
        print(
            f"| {row['system']} | {row['score']:.2f} | {row['prediction'][:40]!r} | "
            + " | ".join(where)
            + " |"
        )
    for row in rows:
        print(f"\n{row['system']}")
        for index, step in enumerate(row["steps"][:shown]):
            leaders = ", ".join(f"{text!r} {logit:.3f}" for text, logit in step["candidates"])
            print(f"  step {index}: {leaders}  (margin {step['margin']:.3f})")


def main(argv=None) -> int:
    args = parse_args(argv)
    from experiments.data import data_dir, load_text
    from experiments.shapes import load_benchmark_model
    from experiments.tasks.ruler.families import Haystack, generate_samples
    from experiments.tasks.ruler.options import RulerOptions

    torch.set_num_threads(args.threads)
    try:
        root = None if args.haystack else data_dir(args.data_dir)
        text, source = load_text(root, args.haystack)
        model, tokenizer = load_benchmark_model(args.model, dtype=args.dtype)
        haystack = Haystack.from_text(text, tokenizer, source=source)
        options = RulerOptions(samples=args.samples, seed=args.seed)
        (sample,) = generate_samples(
            tokenizer, haystack, args.family, args.length, options, model, indices=[args.sample]
        )
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    steps = args.steps or sample.new_tokens
    rows = probe(model, tokenizer, sample, args.systems, steps, args.top)
    print(
        f"{args.family} at {args.length} tokens, sample {args.sample}: references "
        f"{list(sample.references)}, depths {[round(d, 3) for d in sample.depths]}, "
        f"{len(sample.input_ids)} prompt tokens\n"
    )
    print_table(rows)
    options = {
        key: getattr(args, key)
        for key in ("model", "dtype", "family", "length", "sample", "samples", "seed")
    }
    print(
        json.dumps(
            {
                "benchmark": "ruler_probe",
                **options,
                "references": list(sample.references),
                "rows": rows,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
