"""TOVA: keep the tokens the current query attends to most."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from alisa.policies.base import KVPolicy


@dataclass(frozen=True, kw_only=True)
class TOVAPolicy(KVPolicy):
    """Each step drops the lowest-attention tokens of the current query (heads summed).

    Oren et al., Transformers are Multi-State RNNs, https://arxiv.org/abs/2401.06104.
    """

    name = "tova"
    needs_attention = True
    default_recent_fraction = 0.0

    def score_window(self, recent: np.ndarray) -> np.ndarray | None:
        return np.ones_like(recent)

    def score(self, positions, attention, first) -> torch.Tensor:
        return attention
