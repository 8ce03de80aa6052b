"""Strided attention (Sparse-Transformer-style): recent tokens plus every stride-th older token."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from alisa.checks import check_optional_int
from alisa.policies.base import KVPolicy, recency


@dataclass(frozen=True, kw_only=True)
class StridedPolicy(KVPolicy):
    """Half the budget is recent tokens; the other half are tokens at every ``stride``-th position.

    Child et al., Generating Long Sequences with Sparse Transformers,
    https://arxiv.org/abs/1904.10509 (the fixed strided pattern, used by ALISA as a baseline).
    The stride is fixed for the whole generation, so the strided set never needs a token that was
    already evicted; by default it is chosen so the strided half of a ratio budget is just filled:
    (n - n*r/2) / stride = n*r/2, i.e. stride = 2/r - 1.

    Parameters
    ----------
    stride
        Keep tokens whose position within the sequence is a multiple of this; ``None`` derives it.
    """

    name = "strided"
    config_fields = {"stride": "stride"}
    stride: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_optional_int("stride", self.stride, minimum=1)

    def effective_stride(self) -> int:
        """The stride in tokens (>= 1)."""
        if self.stride is not None:
            return self.stride
        return max(1, math.ceil(2.0 / self.caching_ratio - 1.0))

    def score(self, positions, attention, first) -> torch.Tensor:
        relative = positions - first.view(-1, 1, 1)
        on_stride = (relative % self.effective_stride()) == 0
        # On-stride tokens outrank every off-stride one; recency breaks ties within each group.
        return recency(positions) + on_stride.to(torch.float32) * 1e9
