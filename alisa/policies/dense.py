"""Keep every token: the reference every other policy is measured against."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from alisa.policies.base import KVPolicy, recency


@dataclass(frozen=True, kw_only=True)
class DensePolicy(KVPolicy):
    """No eviction; the ALISA cache then behaves exactly as HF's ``DynamicCache``."""

    name = "dense"

    def can_evict(self) -> bool:
        return False

    def budget(self, seen: np.ndarray) -> np.ndarray:
        return np.maximum(seen, 1)

    def score(self, positions, attention, first) -> torch.Tensor:
        return recency(positions)
