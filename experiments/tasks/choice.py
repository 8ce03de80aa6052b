"""Zero-shot multiple choice by log-likelihood (PIQA, COPA), as lm-evaluation-harness scores it.

The context is prefilled (the policy compresses it as usual) and each choice is then fed token
by token, so the policy is active at every scoring step. ``acc`` compares summed log-likelihoods,
``acc_norm`` divides by the choice length in bytes.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from alisa import AlisaCache, AlisaConfig


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


def multiple_choice(
    model,
    tokenizer,
    examples: list[dict],
    config: AlisaConfig,
    *,
    limit: int | None = None,
    progress: bool = True,
) -> dict:
    """``acc`` and ``acc_norm`` over (up to ``limit``) examples."""
    chosen = examples[:limit] if limit else examples
    correct = correct_norm = 0
    for example in tqdm(chosen, desc="choices", disable=not progress, leave=False):
        scores = choice_loglikelihoods(
            model, tokenizer, example["context"], example["choices"], config
        )
        lengths = [len(c.encode("utf-8")) for c in example["choices"]]
        correct += int(max(range(len(scores)), key=scores.__getitem__) == example["label"])
        normalised = [s / n for s, n in zip(scores, lengths, strict=True)]
        correct_norm += int(max(range(len(scores)), key=normalised.__getitem__) == example["label"])
    return {"acc": correct / len(chosen), "acc_norm": correct_norm / len(chosen), "n": len(chosen)}
