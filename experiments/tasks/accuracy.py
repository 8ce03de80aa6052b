"""Accuracy tasks: needle retrieval (passkey, RULER NIAH), multiple choice (PIQA, COPA),
summarization (XSum), each a runner task ``(context, point, options) -> metrics``.

Multiple choice is scored by log-likelihood, as lm-evaluation-harness scores it: the context is
prefilled (the policy compresses it as usual) and each choice is then fed token by token, so the
policy is active at every scoring step; ``acc`` compares summed log-likelihoods, ``acc_norm``
divides them by the choice's length in bytes.
"""

from __future__ import annotations

import re
from collections import defaultdict

import torch

from alisa import AlisaCache, AlisaConfig, generate
from experiments import data
from experiments.extras import bench_module
from experiments.tasks.ruler.families import string_match_part


def _retrieval(kind: str, load):
    """Accuracy overall, per depth and per prompt-length bucket (tokens rounded up to 512) of
    ``kind``: ``passkey`` (the first integer of the answer equals the key, the
    landmark-attention rule) or ``niah`` (the magic number appears in the continuation of
    ``input + answer_prefix``, RULER's string match), in the first ``new_tokens`` greedy tokens;
    prompts over ``max_prompt_tokens`` are skipped."""

    def run(context, point: dict, options: dict) -> dict:
        limit, new_tokens = options.get("max_prompt_tokens", 2048), options.get("new_tokens", 12)
        by_depth, by_length = defaultdict(list), defaultdict(list)
        for row in load(context.data_root):
            prompt = row["prompt"] if kind == "passkey" else row["input"] + row["answer_prefix"]
            length = len(context.tokenizer(prompt)["input_ids"])
            if length > limit:
                continue
            text = generate(
                context.model,
                context.tokenizer,
                prompt,
                context.config,
                max_new_tokens=new_tokens,
                compile="off",  # a new length every row: compiling each would cost more
            ).texts[0]
            if kind == "passkey":  # the first integer
                ok = re.findall(r"\d+", text)[:1] == [str(row["answer"])]
            else:
                ok = string_match_part(text, row["outputs"]) == 1.0  # RULER's own rule
            by_depth[f"{row['depth']:.1f}"].append(ok)
            by_length[str(512 * (1 + length // 512))].append(ok)
        outcomes = [ok for oks in by_depth.values() for ok in oks]
        return {
            "accuracy": sum(outcomes) / len(outcomes) if outcomes else 0.0,
            "n": len(outcomes),
            "by_depth": {k: sum(v) / len(v) for k, v in sorted(by_depth.items())},
            "by_length": {
                k: sum(v) / len(v) for k, v in sorted(by_length.items(), key=lambda kv: int(kv[0]))
            },
        }

    return run


passkey = _retrieval("passkey", data.load_passkey)
niah = _retrieval("niah", data.load_niah)


@torch.inference_mode()
def choice_loglikelihoods(
    model, tokenizer, context: str, choices: list[str], config: AlisaConfig
) -> list[float]:
    """Sum of log p(choice tokens | context) for each choice, decode regime."""
    device = next(model.parameters()).device
    context_ids = tokenizer(context)["input_ids"]
    choice_ids = [
        tokenizer(context + choice)["input_ids"][len(context_ids) :] for choice in choices
    ]
    batch = len(choices)
    cache = AlisaCache(model, config)
    prompt = torch.tensor([context_ids] * batch, device=device)
    logits = model(
        input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1
    ).logits[:, -1]
    width = max(len(ids) for ids in choice_ids)
    totals = torch.zeros(batch, dtype=torch.float64, device=device)
    for step in range(width):
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        tokens = torch.tensor(
            [ids[step] if step < len(ids) else 0 for ids in choice_ids], device=device
        )
        live = torch.tensor([step < len(ids) for ids in choice_ids], device=device)
        totals += torch.where(live, log_probs.gather(1, tokens[:, None])[:, 0], 0.0).double()
        if step + 1 < width:
            position = torch.full((batch, 1), len(context_ids) + step, device=device)
            logits = model(
                input_ids=tokens[:, None],
                position_ids=position,
                past_key_values=cache,
                use_cache=True,
            ).logits[:, -1]
    return totals.tolist()


def _first(rows: list[dict], limit) -> list[dict]:
    return rows[:limit] if limit and limit != "none" else rows


def _choice(load):
    """``acc`` and ``acc_norm`` over the first ``limit`` examples (all: none)."""

    def run(context, point: dict, options: dict) -> dict:
        chosen = _first(load(context.data_root), options.get("limit"))
        correct = correct_norm = 0
        for example in chosen:
            scores = choice_loglikelihoods(
                context.model,
                context.tokenizer,
                example["context"],
                example["choices"],
                context.config,
            )
            lengths = [len(c.encode("utf-8")) for c in example["choices"]]
            normalised = [s / n for s, n in zip(scores, lengths, strict=True)]
            correct += int(max(range(len(scores)), key=scores.__getitem__) == example["label"])
            correct_norm += int(
                max(range(len(scores)), key=normalised.__getitem__) == example["label"]
            )
        n = len(chosen)
        return {"acc": correct / n, "acc_norm": correct_norm / n, "n": n}

    return run


piqa = _choice(data.load_piqa)
copa = _choice(data.load_copa)


def xsum(context, point: dict, options: dict) -> dict:
    """Mean ROUGE-1/2/L F-measures (``rouge-score``) of greedy summaries of H2O's 0-shot XSum
    prompts, cut at the prompt format's ``###`` stop, over the first ``limit``."""
    rouge = bench_module("rouge_score.rouge_scorer")
    scorer = rouge.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    totals = {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0}
    chosen = _first(data.load_xsum(context.data_root), options.get("limit", 20))
    for row in chosen:
        text = generate(
            context.model,
            context.tokenizer,
            row["article"],
            context.config,
            max_new_tokens=options.get("max_new_tokens", 64),
            compile="off",  # a new length every article
        ).texts[0]
        scores = scorer.score(row["summary_gt"], text.split("###")[0].strip().split("\n")[0])
        for key in totals:
            totals[key] += scores[key].fmeasure
    return {key: value / len(chosen) for key, value in totals.items()} | {"n": len(chosen)}
