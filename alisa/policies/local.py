"""Local window attention (Longformer-style): keep only the most recent tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from alisa.policies.base import KVPolicy, recency


@dataclass(frozen=True, kw_only=True)
class LocalPolicy(KVPolicy):
    """The whole budget is a sliding window of recent tokens.

    Beltagy et al., Longformer, https://arxiv.org/abs/2004.05150 (its local attention pattern,
    used by ALISA as the "local" baseline).
    """

    name = "local"
    default_recent_fraction = 1.0
    sinks_by_default = False  # with sinks it is StreamingLLM
    ranks_by_recency = True

    def score(self, positions, attention, first) -> torch.Tensor:
        return recency(positions)
