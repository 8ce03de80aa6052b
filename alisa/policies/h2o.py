"""H2O heavy hitters: attention accumulated over the whole history plus recent tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from alisa.policies.base import KVPolicy


@dataclass(frozen=True, kw_only=True)
class H2OPolicy(KVPolicy):
    """Half the budget is recent tokens, half the tokens with the largest attention ever received.

    Zhang et al., H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs,
    https://arxiv.org/abs/2306.14048. Scores start from the column sums of the whole prompt's
    attention, as the reference implementation does.
    """

    name = "h2o"
    needs_attention = True
    per_head_by_default = True

    def score(self, positions, attention, first) -> torch.Tensor:
        return attention
