"""Keep every token: the reference every other policy is measured against."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from alisa.policies.base import KVPolicy, recency


@dataclass(frozen=True, kw_only=True)
class DensePolicy(KVPolicy):
    """No eviction; the ALISA cache then behaves exactly as HF's ``DynamicCache``."""

    name = "dense"
    evicts = False

    def score(self, positions, attention, first) -> torch.Tensor:
        return recency(positions)
