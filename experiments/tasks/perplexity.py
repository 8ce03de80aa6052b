"""Perplexity in the decode regime: tokens fed one by one, the KV policy active at every step.

Two protocols (:data:`PROTOCOLS`): ``streaming`` compresses from the first token, as ALISA
measures accuracy (its sparse mask applies to every row); ``prefill`` feeds the first part of
each segment densely, compresses it to the budget, then scores the rest token by token, as H2O's
lm-eval simulation and kvpress's benchmarks do. A one-shot prefill over the whole text would hide
the policy, since prefill attention is dense.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from alisa import AlisaCache, AlisaConfig
from alisa.model.adapter import model_shape
from alisa.settings import evicts_nothing_note


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


PROTOCOLS = ("streaming", "prefill")


def protocol_prefill(protocol: str, length: int, prefill_share: float = 0.5) -> int:
    """Tokens of a segment fed as the first (dense) call under ``protocol``.

    ``streaming``: 1, the policy compresses from the first token (ALISA's decode-regime
    measurement). ``prefill``: the first ``prefill_share`` of the segment, compressed to r after
    its dense prefill, then the rest is scored token by token (H2O's and kvpress's protocol).
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol={protocol!r} is unknown; valid: {', '.join(PROTOCOLS)}")
    if protocol == "streaming":
        return 1
    if not 0.0 < prefill_share < 1.0:
        raise ValueError(f"prefill_share={prefill_share!r} must be in (0, 1)")
    return min(max(1, round(length * prefill_share)), length - 1)


@torch.inference_mode()
def decode_perplexity(
    model,
    segments: torch.Tensor,
    config: AlisaConfig,
    *,
    prefill_tokens: int = 1,
    progress: bool = True,
) -> PerplexityResult:
    """Score the tokens after the first ``prefill_tokens`` of each segment, one token per step.

    Parameters
    ----------
    segments
        (B, L) token ids; the B segments run as one batch.
    config
        The KV policy, active from the first call (the budget is round(n * r) of the n seen).
    prefill_tokens
        P, tokens fed in the first call (dense attention, then compressed to the budget); 1 is
        the streaming protocol (see :func:`protocol_prefill`).

    Returns
    -------
    PerplexityResult
        Mean NLL over the B * (L - P) predictions of tokens P .. L-1 (the first from the
        prefill's last logits).
    """
    device = next(model.parameters()).device
    segments = segments.to(device)
    batch, length = segments.shape
    if not 1 <= prefill_tokens < length:
        raise ValueError(f"prefill_tokens={prefill_tokens!r} must be in [1, {length - 1}]")
    note = evicts_nothing_note(config, model_shape(model).num_layers, length)
    if note is not None:  # a result equal to dense must not pass for the policy's
        print(f"experiments: warning: {note}", file=sys.stderr)
    cache = AlisaCache(model, config)
    total = torch.zeros((), dtype=torch.float64, device=device)
    starts = [0, *range(prefill_tokens, length - 1)]
    steps = tqdm(
        starts,
        desc=f"ppl {config.policy} r={config.caching_ratio:g}",
        disable=not progress,
        leave=False,
    )
    for start in steps:
        stop = prefill_tokens if start == 0 else start + 1
        position = torch.arange(start, stop, device=device).expand(batch, -1)
        logits = (
            model(
                input_ids=segments[:, start:stop],
                position_ids=position,
                past_key_values=cache,
                use_cache=True,
            )
            .logits[:, -1]
            .float()
        )
        nll = torch.nn.functional.cross_entropy(logits, segments[:, stop], reduction="sum")
        total += nll.double()
    count = batch * (length - prefill_tokens)
    return PerplexityResult(nll=float(total) / count, tokens=count)
