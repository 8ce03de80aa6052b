"""StreamingLLM: attention sinks plus a window of recent tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from alisa.policies.base import KVPolicy, recency


@dataclass(frozen=True, kw_only=True)
class StreamingPolicy(KVPolicy):
    """The first ``sink_tokens`` (default 4) and the most recent tokens fill the budget.

    Xiao et al., Efficient Streaming Language Models with Attention Sinks,
    https://arxiv.org/abs/2309.17453. Positions are not re-indexed: kept keys keep their RoPE.
    """

    name = "streaming"
    default_recent_fraction = 1.0
    default_sink_tokens = 4
    ranks_by_recency = True

    def score(self, positions, attention, first) -> torch.Tensor:
        return recency(positions)
