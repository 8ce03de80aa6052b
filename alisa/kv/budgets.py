"""A decode step's budgets, computed once for every layer that runs an equal policy.

Each layer's keeper asks its policy, every decode step, how many tokens each sequence keeps
(:meth:`~alisa.policies.KVPolicy.budget`), how many of them are the newest
(:meth:`~alisa.policies.KVPolicy.recent`) and over how many steps attention is summed
(:meth:`~alisa.policies.KVPolicy.steps_scored`). They depend only on the policy and the
sequences' lengths, which every layer of a step shares, and each is a few small NumPy
operations: about 23 us for one layer alone on a 2-core EPYC, two to three times that inside a
model's step (the layer's weights have just passed through the caches), so at one sequence
computing them in each of SmolLM2's 30 layers cost about 2 % of the step. A cache's layers
share one :class:`BudgetBook`, which computes them once per distinct policy and lengths.
ALISA, https://arxiv.org/abs/2403.17312 (§III: the caching ratio's budget).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import NamedTuple, TypeVar, cast

import numpy as np

from alisa.policies import KVPolicy

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
