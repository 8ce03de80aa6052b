"""Perplexity in the decode regime: tokens fed one by one, the KV policy active at every step.

This is how ALISA measures accuracy (its sparse mask applies to every row); a one-shot prefill
over the whole text would hide the policy, since prefill attention is dense.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from alisa import AlisaCache, AlisaConfig


@dataclass(frozen=True, kw_only=True)
class PerplexityResult:
    """Mean negative log-likelihood over the scored tokens and its exponential."""

    nll: float
    tokens: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)


def text_segments(tokenizer, text: str, segment_tokens: int, segments: int) -> torch.Tensor:
    """(segments, segment_tokens) token ids: consecutive windows from the start of the text."""
    ids = tokenizer(text, return_tensors="pt")["input_ids"][0]
    needed = segment_tokens * segments
    if ids.numel() < needed:
        raise ValueError(
            f"text has {ids.numel()} tokens; {segments} segments of {segment_tokens} need {needed}"
        )
    return ids[:needed].view(segments, segment_tokens)


@torch.inference_mode()
def decode_perplexity(
    model, segments: torch.Tensor, config: AlisaConfig, *, progress: bool = True
) -> PerplexityResult:
    """Score every token after the first of each segment, feeding one token per step.

    Parameters
    ----------
    segments
        (B, L) token ids; the B segments run as one batch.
    config
        The KV policy, active from the first step (the budget is round(n * r) of the n seen).

    Returns
    -------
    PerplexityResult
        Mean NLL over B * (L - 1) predictions.
    """
    device = next(model.parameters()).device
    segments = segments.to(device)
    batch, length = segments.shape
    cache = AlisaCache(model, config)
    total = torch.zeros((), dtype=torch.float64, device=device)
    steps = tqdm(
        range(length - 1),
        desc=f"ppl {config.policy} r={config.caching_ratio:g}",
        disable=not progress,
        leave=False,
    )
    for step in steps:
        position = torch.full((batch, 1), step, device=device)
        logits = (
            model(
                input_ids=segments[:, step : step + 1],
                position_ids=position,
                past_key_values=cache,
                use_cache=True,
            )
            .logits[:, -1]
            .float()
        )
        nll = torch.nn.functional.cross_entropy(logits, segments[:, step + 1], reduction="sum")
        total += nll.double()
    count = batch * (length - 1)
    return PerplexityResult(nll=float(total) / count, tokens=count)
