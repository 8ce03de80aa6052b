"""Needle retrieval accuracy (passkey, RULER NIAH) broken down by prompt length and depth."""

from __future__ import annotations

from collections import defaultdict

from tqdm.auto import tqdm

from alisa import AlisaConfig, generate
from experiments.tasks.passkey import first_integer
from experiments.tasks.ruler.scoring import string_match_part


def retrieval_accuracy(
    model,
    tokenizer,
    rows: list[dict],
    config: AlisaConfig,
    *,
    kind: str,
    max_prompt_tokens: int | None = None,
    progress: bool = True,
) -> dict:
    """Accuracy overall, per depth and per length bucket (tokens rounded to 512).

    ``kind`` is ``passkey`` (first integer equals the key) or ``niah`` (the magic number appears
    in the continuation of ``input + answer_prefix``, RULER's string match).
    """
    by_depth, by_length, correct, total = defaultdict(list), defaultdict(list), 0, 0
    for row in tqdm(rows, desc=kind, disable=not progress, leave=False):
        prompt = row["prompt"] if kind == "passkey" else row["input"] + row["answer_prefix"]
        length = len(tokenizer(prompt)["input_ids"])
        if max_prompt_tokens is not None and length > max_prompt_tokens:
            continue
        text = generate(model, tokenizer, prompt, config, max_new_tokens=12).texts[0]
        if kind == "passkey":
            ok = first_integer(text) == str(row["answer"])
        else:
            ok = string_match_part(text, row["outputs"]) == 1.0  # RULER's own rule
        correct, total = correct + ok, total + 1
        by_depth[f"{row['depth']:.1f}"].append(ok)
        by_length[str(512 * (1 + length // 512))].append(ok)
    return {
        "accuracy": correct / total if total else 0.0,
        "n": total,
        "by_depth": {k: sum(v) / len(v) for k, v in sorted(by_depth.items())},
        "by_length": {
            k: sum(v) / len(v) for k, v in sorted(by_length.items(), key=lambda kv: int(kv[0]))
        },
    }
