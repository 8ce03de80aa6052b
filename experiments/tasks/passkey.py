"""Passkey retrieval: does the model still find a number buried in filler after compression?"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tqdm.auto import tqdm

from alisa import AlisaConfig, generate


@dataclass(frozen=True, kw_only=True)
class PasskeyResult:
    """Accuracy over the prompts tried, and per-prompt outcomes."""

    correct: int
    total: int
    outcomes: tuple[tuple[str, int, bool], ...]  # (id, prompt tokens, correct)

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else 0.0


def first_integer(text: str) -> str | None:
    """The first run of digits in the text (the landmark-attention scoring rule)."""
    match = re.search(r"\d+", text)
    return match.group(0) if match else None


def passkey_accuracy(
    model,
    tokenizer,
    rows: list[dict],
    config: AlisaConfig,
    *,
    max_prompt_tokens: int | None = None,
    new_tokens: int = 10,
    progress: bool = True,
) -> PasskeyResult:
    """Greedy-generate after each prompt; correct when the first integer equals the answer.

    Parameters
    ----------
    rows
        Passkey rows with ``prompt``, ``answer`` and ``id``.
    max_prompt_tokens
        Skip prompts longer than this (CPU time); ``None`` keeps all.
    """
    outcomes = []
    for row in tqdm(rows, desc=f"passkey {config.policy}", disable=not progress, leave=False):
        length = len(tokenizer(row["prompt"])["input_ids"])
        if max_prompt_tokens is not None and length > max_prompt_tokens:
            continue
        result = generate(model, tokenizer, row["prompt"], config, max_new_tokens=new_tokens)
        outcomes.append(
            (row.get("id", ""), length, first_integer(result.texts[0]) == str(row["answer"]))
        )
    correct = sum(ok for _, _, ok in outcomes)
    return PasskeyResult(correct=correct, total=len(outcomes), outcomes=tuple(outcomes))
