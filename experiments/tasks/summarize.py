"""Summarization ROUGE-1/2/L on H2O's 0-shot XSum prompts (``rouge-score`` package)."""

from __future__ import annotations

from rouge_score import rouge_scorer
from tqdm.auto import tqdm

from alisa import AlisaConfig, generate


def summarization_rouge(
    model,
    tokenizer,
    rows: list[dict],
    config: AlisaConfig,
    *,
    limit: int | None = None,
    max_new_tokens: int = 64,
    progress: bool = True,
) -> dict:
    """Mean ROUGE F-measures of greedy summaries (cut at the prompt format's ``###`` stop)."""
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    totals = {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0}
    chosen = rows[:limit] if limit else rows
    for row in tqdm(chosen, desc="xsum", disable=not progress, leave=False):
        text = generate(
            model, tokenizer, row["article"], config, max_new_tokens=max_new_tokens
        ).texts[0]
        summary = text.split("###")[0].strip().split("\n")[0]
        scores = scorer.score(row["summary_gt"], summary)
        for key in totals:
            totals[key] += scores[key].fmeasure
    return {key: value / len(chosen) for key, value in totals.items()} | {"n": len(chosen)}
