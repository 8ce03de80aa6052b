"""The policy interface: how many tokens a sequence keeps, which are protected, how the rest rank.

A policy never touches tensors it does not own: the cache layer asks it for budgets (host-side
integers, so no device sync is needed per step) and for a score per stored slot, then evicts the
lowest-scoring unprotected slots itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from functools import cached_property
from typing import ClassVar

import numpy as np
import torch

from alisa.checks import check_field_types, check_number, check_optional_int, check_share
from alisa.ops.reference import combine_queries
from scheduler.budget import KeepRule


@dataclass(frozen=True, kw_only=True)
class KVPolicy:
    """Base class of every KV policy.

    Subclasses set the class attributes below and implement :meth:`score`. Budgets are counted in
    tokens per sequence (per KV head when selecting per head) by the one rule of
    :class:`scheduler.budget.KeepRule`, which batch sizing and the planner use too.

    A policy with options of its own declares them as dataclass fields and maps the settings
    that fill them in :attr:`config_fields` (setting name -> field name), e.g. SWA's
    ``{"score_window": "window"}``; it checks their values itself (``__post_init__``, after
    this class's, which checks the shared fields by the rules ``AlisaConfig`` applies, so a
    policy built directly, e.g. by :func:`~alisa.policies.registry.get_policy`, is refused as
    the config would be).

    Parameters
    ----------
    caching_ratio
        r in (0, 1]: keep round(n * r) of the n tokens seen.
    budget_tokens
        Fixed budget instead of a ratio; ``None`` uses the ratio.
    recent_fraction
        Share of the budget protected as the most recent tokens.
    sink_tokens
        First tokens of every sequence that are always kept.
    budget_scale
        Per-layer multiplier on the budget (pyramid schedules); 1.0 = uniform.
    min_budget_tokens
        Least tokens kept per sequence (the budget's floor).
    observation_window
        Prompt queries whose attention, summed and pooled, seeds the scores at prefill (SnapKV,
        https://arxiv.org/abs/2404.14469); 0 seeds with :meth:`score_window` rows instead.
    head_max
        At decode steps, score a KV head's tokens by the largest attention among its query heads,
        not their sum: a token one query head needs is kept even when the group's other heads
        ignore it. The observation window's vote sums them (SnapKV).
    score_decay
        With a :meth:`score_window` w: fade the sums by 1 - 1/w per step (a soft window whose
        weights sum to w) instead of summing exactly the last w steps.
    """

    name: ClassVar[str] = "base"
    needs_attention: ClassVar[bool] = False  # True: score() reads accumulated attention
    default_recent_fraction: ClassVar[float] = 0.5
    default_sink_tokens: ClassVar[int] = 0
    # The "default" preset adds attention sinks (StreamingLLM): deleting token 0 breaks the model
    # whatever ranks the rest. False for a policy defined as having none (local's window).
    sinks_by_default: ClassVar[bool] = True
    # The "default" preset selects per KV head (better for SWA and H2O, docs/drop-quality.md).
    per_head_by_default: ClassVar[bool] = False
    # The "default" preset scores by the query-head max and fades the sums of a score window
    # (SWA, docs/drop-quality.md).
    head_max_by_default: ClassVar[bool] = False
    decays_by_default: ClassVar[bool] = False
    # True: score_window() spans several decode steps, so score_decay (fading them) changes what
    # is kept. Without one (H2O sums every step) or with a one-step window (TOVA reads the last
    # step alone), a faded sum is the exact sum: the setting has no effect.
    windowed_scores: ClassVar[bool] = False
    evicts: ClassVar[bool] = True  # False: keeps every token whatever its budget options
    # True: score() is recency alone, so the budget past the recent share goes to the next most
    # recent tokens: recent_fraction changes nothing (StreamingLLM's and the local window's).
    ranks_by_recency: ClassVar[bool] = False
    config_fields: ClassVar[Mapping[str, str]] = {}

    caching_ratio: float = 1.0
    budget_tokens: int | None = None
    recent_fraction: float = 0.5
    sink_tokens: int = 0
    budget_scale: float = 1.0
    min_budget_tokens: int = 0
    observation_window: int = 0
    head_max: bool = False
    score_decay: bool = False

    def __post_init__(self) -> None:
        check_field_types(self)
        check_share("caching_ratio", self.caching_ratio)
        check_optional_int("budget_tokens", self.budget_tokens, minimum=1)
        check_share("recent_fraction", self.recent_fraction, zero=True)
        check_optional_int("sink_tokens", self.sink_tokens, minimum=0)
        check_number("budget_scale", self.budget_scale)
        if self.budget_scale <= 0:
            raise ValueError(f"budget_scale={self.budget_scale!r} must be > 0")
        check_optional_int("min_budget_tokens", self.min_budget_tokens, minimum=0)
        check_optional_int("observation_window", self.observation_window, minimum=0)

    @classmethod
    def own_options(cls, settings: Mapping[str, object]) -> dict[str, object]:
        """This policy's own fields, filled from ``settings`` named as :attr:`config_fields` says.

        Raises
        ------
        TypeError
            :attr:`config_fields` names a field the policy does not have (a wrong declaration).
        """
        own = {item.name for item in fields(cls)}
        wrong = sorted(set(cls.config_fields.values()) - own)
        if wrong:
            raise TypeError(f"{cls.__name__}.config_fields maps to unknown field(s) {wrong}")
        return {field: settings[name] for name, field in cls.config_fields.items()}

    @cached_property
    def keep_rule(self) -> KeepRule:
        """The budget rule of this policy (every token for one that never evicts)."""
        if not self.evicts:
            return KeepRule()
        return KeepRule(
            caching_ratio=self.caching_ratio,
            budget_tokens=self.budget_tokens,
            sink_tokens=self.sink_tokens,
            scale=self.budget_scale,
            floor=self.min_budget_tokens,
        )

    def can_evict(self) -> bool:
        """False when the budget always covers every token seen (r = 1 with no smaller scale)."""
        return not self.keep_rule.keeps_everything

    def budget(self, seen: np.ndarray) -> np.ndarray:
        """Tokens to keep per sequence, given the real tokens seen so far (int64 array [B])."""
        return self.keep_rule.kept(seen)

    def recent(self, budget: np.ndarray) -> np.ndarray:
        """How many of the budget go to the most recent tokens (never crowding out the sinks)."""
        recent = np.rint(budget * self.recent_fraction).astype(np.int64)
        return np.minimum(recent, np.maximum(budget - self.sink_tokens, 0))

    def score_window(self, recent: np.ndarray) -> np.ndarray | None:
        """Decode steps whose attention is summed per sequence; ``None`` sums the whole history."""
        return None

    def steps_scored(self, budget: np.ndarray) -> np.ndarray | None:
        """(B,) decode steps whose attention is summed, given the budgets; None: every step."""
        return self.score_window(self.recent(budget))

    def combine_heads(
        self, probabilities: torch.Tensor, groups: int, *, vote: bool = False
    ) -> torch.Tensor:
        """(B, Hs, q, S') score rows from attention (B, H_kv, G, q, S').

        The G query heads of a KV group are summed in head order (or, at decode steps, their
        max: :attr:`head_max`; :func:`alisa.ops.reference.combine_queries`), then every KV head
        is summed when the layer keeps one index set (``groups`` = 1). An observation ``vote``
        always sums its query heads, as SnapKV does.
        """
        rows = combine_queries(probabilities, self.head_max and not vote)
        return rows.sum(dim=1, keepdim=True) if groups == 1 else rows

    def score(
        self, positions: torch.Tensor, attention: torch.Tensor | None, first: torch.Tensor
    ) -> torch.Tensor:
        """Rank stored tokens: higher is kept first.

        Parameters
        ----------
        positions
            (B, Hs, S) original position of each slot's token in the padded sequence; negative
            for empty or padding slots (the caller masks those).
        attention
            (B, Hs, S) attention summed over the policy's window, or None when
            ``needs_attention`` is False.
        first
            (B,) position of each sequence's first real (non-padding) token.

        Returns
        -------
        torch.Tensor
            (B, Hs, S) float scores.
        """
        raise NotImplementedError


def recency(positions: torch.Tensor) -> torch.Tensor:
    """Scores that keep the newest tokens first."""
    return positions.to(torch.float32)
