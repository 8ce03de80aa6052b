"""The KV policies: how many tokens a sequence keeps, which are protected, how the rest rank.

One class per policy (:class:`KVPolicy` and its subclasses, each a few lines with its paper
link), the registry that names them (:data:`POLICIES`), and the :class:`BudgetBook` in which a
cache's layers share a decode step's numbers. A policy never touches tensors it does not own:
the cache layer asks it for budgets (host-side integers, so no device sync is needed per step)
and for a score per stored slot, then evicts the lowest-scoring unprotected slots itself.
Adding a policy is a class here, an entry in :data:`POLICIES` and a test-matrix entry.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, fields
from functools import cached_property
from typing import ClassVar, NamedTuple, TypeVar, cast

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
    policy built directly, e.g. by :func:`get_policy`, is refused as
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


# Keep every token: the reference every other policy is measured against.
@dataclass(frozen=True, kw_only=True)
class DensePolicy(KVPolicy):
    """No eviction; the ALISA cache then behaves exactly as HF's ``DynamicCache``."""

    name = "dense"
    evicts = False

    def score(self, positions, attention, first) -> torch.Tensor:
        return recency(positions)


# ALISA Sparse Window Attention: recent tokens plus tokens with the largest recent attention.
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


# H2O heavy hitters: attention accumulated over the whole history plus recent tokens.
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


# TOVA: keep the tokens the current query attends to most.
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


# StreamingLLM: attention sinks plus a window of recent tokens.
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


# Local window attention (Longformer-style): keep only the most recent tokens.
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


# Strided attention (Sparse-Transformer-style): recent tokens plus every stride-th older token.
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


POLICIES: dict[str, type[KVPolicy]] = {
    cls.name: cls
    for cls in (
        DensePolicy,
        SWAPolicy,
        H2OPolicy,
        TOVAPolicy,
        StreamingPolicy,
        LocalPolicy,
        StridedPolicy,
    )
}


def get_policy(name: str, **options) -> KVPolicy:
    """Build a policy by name; the error lists the valid names."""
    if name not in POLICIES:
        raise ValueError(f"policy={name!r} is unknown; valid: {', '.join(sorted(POLICIES))}")
    return POLICIES[name](**options)


# A decode step's budgets, computed once for every layer that runs an equal policy.
#
# Each layer's keeper asks its policy, every decode step, how many tokens each sequence keeps
# (:meth:`KVPolicy.budget`), how many of them are the newest
# (:meth:`KVPolicy.recent`) and over how many steps attention is summed
# (:meth:`KVPolicy.steps_scored`). They depend only on the policy and the
# sequences' lengths, which every layer of a step shares, and each is a few small NumPy
# operations: about 23 us for one layer alone on a 2-core EPYC, two to three times that inside a
# model's step (the layer's weights have just passed through the caches), so at one sequence
# computing them in each of SmolLM2's 30 layers cost about 2 % of the step. A cache's layers
# share one :class:`BudgetBook`, which computes them once per distinct policy and lengths.
# ALISA, https://arxiv.org/abs/2403.17312 (§III: the caching ratio's budget).

Derived = TypeVar("Derived")


class StepShares(NamedTuple):
    """A policy's numbers for the current lengths, (B,) int64 each; read, never written.

    Attributes
    ----------
    budget
        Tokens each sequence may hold per group (:meth:`KVPolicy.budget`).
    recent
        How many of them are the newest (:meth:`KVPolicy.recent`).
    window
        Decode steps whose attention is summed (:meth:`KVPolicy.steps_scored`); None: every
        step.
    """

    budget: np.ndarray
    recent: np.ndarray
    window: np.ndarray | None


class BudgetBook:
    """The :class:`StepShares` of each policy for the lengths last asked about.

    Policies are told apart by identity (comparing two frozen dataclasses field by field, and
    hashing one, cost more than the lookup): a cache gives layers with equal policies one
    policy object. Only one set of lengths is kept: a decode step's layers ask with the same
    lengths, and the next step's differ.
    """

    def __init__(self) -> None:
        self._lengths = b""
        # id(policy) -> (policy, its shares): the policy is held so that its id stays its own.
        self._shares: dict[int, tuple[KVPolicy, StepShares]] = {}
        self._derived: dict[tuple[int, Hashable], tuple[KVPolicy, object]] = {}

    def shares(self, policy: KVPolicy, lengths: np.ndarray) -> StepShares:
        """``policy``'s numbers for (B,) int64 real tokens seen per sequence.

        The arrays are this book's own, shared with every layer that asks for the same policy
        and lengths: copy one before changing it.
        """
        key = lengths.tobytes()
        if key != self._lengths:
            self._lengths = key
            self._shares = {}
            self._derived = {}
        entry = self._shares.get(id(policy))
        if entry is not None and entry[0] is policy:
            return entry[1]
        budget = policy.budget(lengths)
        shares = StepShares(budget, policy.recent(budget), policy.steps_scored(budget))
        for array in shares:
            if array is not None:
                array.flags.writeable = False  # shared: a caller writing to one is a bug
        self._shares[id(policy)] = (policy, shares)
        return shares

    def derived(
        self,
        policy: KVPolicy,
        lengths: np.ndarray,
        name: Hashable,
        make: Callable[[StepShares], Derived],
    ) -> Derived:
        """``make(shares)`` of ``policy``'s :meth:`shares`, computed once for the current lengths
        per ``name``: a keeper's own numbers of the step (host retention's history share, its
        recent window's least length...). ``name`` must stand for everything ``make`` reads
        besides the shares (the keeper's options), so that equal names give equal results.
        """
        shares = self.shares(policy, lengths)  # first: new lengths clear the derived numbers
        key = (id(policy), name)
        entry = self._derived.get(key)
        if entry is not None and entry[0] is policy:
            return cast(Derived, entry[1])
        found = make(shares)
        self._derived[key] = (policy, found)
        return found
