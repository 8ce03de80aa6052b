"""Attention statistics behind ALISA's motivation figures (Fig. 3 sparsity, Fig. 4 Spearman).

Both need full attention matrices of a prompt, so the model runs once with HF's eager attention
and ``output_attentions`` (then switches back): fine for the short analysis segments used here.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.stats import spearmanr


@torch.inference_mode()
def attention_maps(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """(H, L, L) float32 attention probabilities of each layer for one (1, L) prompt."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        out = model(input_ids=ids.to(next(model.parameters()).device), output_attentions=True)
    finally:
        model.set_attn_implementation(previous)
    return [a[0].float().cpu() for a in out.attentions]


def attention_sparsity(maps: list[torch.Tensor], threshold: float = 0.01) -> list[float]:
    """Per layer: share of causal attention weights below ``threshold`` x their row's maximum."""
    result = []
    for attention in maps:
        length = attention.shape[-1]
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        row_max = attention.amax(dim=-1, keepdim=True)
        small = (attention < threshold * row_max) & causal
        result.append(float(small.sum() / (causal.sum() * attention.shape[0])))
    return result


def importance_spearman(
    maps: list[torch.Tensor], ratio: float = 0.2, rows: int = 32, stride: int | None = None
) -> dict:
    """Spearman rho of predicted vs actual token importance, averaged over layers and rows.

    Actual importance of the tokens before step n is row n of the (heads-summed) attention.
    Predictions: ``local`` ranks by recency, ``strided`` puts every stride-th token first,
    ``swa`` sums the attention rows of the last k = round(n r / 2) steps (ALISA's local sum).
    """
    stride = stride or max(1, round(2 / ratio - 1))
    scores = {"local": [], "strided": [], "swa": []}
    for attention in maps:
        summed = attention.sum(dim=0).numpy()  # (L, L)
        length = summed.shape[0]
        for n in range(length - rows, length):
            actual = summed[n, :n]
            window = max(1, round(n * ratio / 2))
            predictions = {
                "local": np.arange(n, dtype=float),
                "strided": (np.arange(n) % stride == 0) * 1e6 + np.arange(n),
                "swa": summed[max(0, n - window) : n, :n].sum(axis=0),
            }
            for name, predicted in predictions.items():
                rho = spearmanr(predicted, actual).statistic
                if np.isfinite(rho):
                    scores[name].append(rho)
    return {name: float(np.mean(values)) for name, values in scores.items()}
