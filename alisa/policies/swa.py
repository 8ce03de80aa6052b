"""ALISA Sparse Window Attention: recent tokens plus tokens with the largest recent attention."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from alisa.checks import check_optional_int
from alisa.policies.base import KVPolicy

# A decayed window's time constant in units of k (best of 2, 4, 8, 16 on the ablation in
# docs/drop-quality.md): k steps forget a token's attention before it is likely needed again.
DECAY_WINDOW_SCALE = 4


@dataclass(frozen=True, kw_only=True)
class SWAPolicy(KVPolicy):
    """ALISA's SWA: k = round(n*r/2) locally static (recent) plus k globally dynamic tokens.

    Zhao et al., ALISA: Accelerating Large Language Model Inference via Sparsity-Aware KV Caching,
    ISCA'24, https://arxiv.org/abs/2403.17312, Alg. 1. The globally dynamic tokens are the top-k of
    the attention summed over the last w decode steps (the "local attention sum"), heads summed
    within each KV group; by default w = k, as in Alg. 1. The budget is round(n*r) split in half,
    so r = 1 keeps every token even when n is odd.

    The ``default`` preset makes the window soft (``score_decay``: each step's attention fades by
    1 - 1/w per step, with w = 4k, twice the budget, unless set) and scores each step by the
    largest attention among a KV group's query heads (``head_max``); docs/drop-quality.md has the
    ablation.

    Parameters
    ----------
    window
        w, the number of most recent steps whose attention is summed (the time constant when
        decayed); ``None`` = k, or ``DECAY_WINDOW_SCALE`` * k when decayed.
    """

    name = "swa"
    needs_attention = True
    per_head_by_default = True
    head_max_by_default = True
    decays_by_default = True
    windowed_scores = True
    config_fields = {"score_window": "window"}
    window: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_optional_int("window", self.window, minimum=1)

    def score_window(self, recent: np.ndarray) -> np.ndarray | None:
        if self.window is not None:
            return np.full_like(recent, self.window)
        scale = DECAY_WINDOW_SCALE if self.score_decay else 1
        return np.maximum(recent * scale, 1)

    def score(self, positions, attention, first) -> torch.Tensor:
        return attention
