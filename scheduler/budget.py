"""How many tokens one layer keeps per sequence: the one budget rule.

The ALISA cache evicts down to it every step (through its KV policies), batch sizing counts
memory with it and the planner places the KV it predicts, so the three always agree.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, kw_only=True)
class KeepRule:
    """One layer's budget: a ratio (or a fixed count) of the tokens seen, scaled, sinks covered.

    Parameters
    ----------
    caching_ratio
        r in (0, 1]: keep round(n * r) of the n tokens seen (half to even, as ``numpy.rint``).
    budget_tokens
        A fixed count instead of the ratio; ``None`` uses the ratio.
    sink_tokens
        First tokens that are never evicted: the budget always covers them plus the newest token.
    scale
        Per-layer multiplier (pyramid schedules); 1.0 = uniform.
    floor
        Least tokens kept (while fewer were seen, all of them): small budgets early in a sequence
        lose what later steps need (a floor of 32-64 tokens brings ``retention="host"`` from
        +33 % to +4 % perplexity at r = 0.1, ``docs/retention-selection-study.md``).
    """

    caching_ratio: float = 1.0
    budget_tokens: int | None = None
    sink_tokens: int = 0
    scale: float = 1.0
    floor: int = 0

    @property
    def keeps_everything(self) -> bool:
        """True when the budget covers every token ever seen (r = 1, no count, no smaller scale)."""
        return self.budget_tokens is None and self.caching_ratio >= 1.0 and self.scale >= 1.0

    @property
    def least(self) -> int:
        """Tokens kept at least, once that many were seen, whatever the budget: the sinks plus
        the newest token, or the floor."""
        return max(self.sink_tokens + 1, self.floor, 1)

    def kept(self, seen: np.ndarray) -> np.ndarray:
        """Tokens kept per sequence after ``seen`` real tokens (int64 array, any shape)."""
        seen = np.asarray(seen, dtype=np.int64)
        if self.budget_tokens is not None:
            wanted = np.full_like(seen, self.budget_tokens)
        else:
            wanted = np.rint(seen * self.caching_ratio).astype(np.int64)
        wanted = np.rint(wanted * self.scale).astype(np.int64)
        # Sinks are never evicted (once gone they cannot return): the budget always covers them
        # plus the newest token, even while a ratio budget is still smaller than that.
        wanted = np.maximum(wanted, self.least)
        # minimum/maximum, not clip: NumPy's clip costs several times as much on small arrays,
        # and this runs for every layer at every decode step.
        return np.minimum(wanted, np.maximum(seen, 1))


def layers_kept(rules: Sequence[KeepRule], seen: np.ndarray) -> np.ndarray:
    """(len(rules), *seen.shape) tokens each layer keeps per sequence (equal rules share work)."""
    seen = np.asarray(seen, dtype=np.int64)
    distinct = {rule: rule.kept(seen) for rule in dict.fromkeys(rules)}
    return np.stack([distinct[rule] for rule in rules])


def mean_kept(rules: Sequence[KeepRule], seen: np.ndarray) -> np.ndarray:
    """Tokens kept per sequence averaged over layers, rounded up (int64, shape of ``seen``).

    Byte counts over all layers are this times the bytes of one token in every layer; rounding
    up never under-counts.
    """
    seen = np.asarray(seen, dtype=np.int64)
    total = sum(count * rule.kept(seen) for rule, count in Counter(rules).items())
    return -(-total // len(rules))  # ceiling division, exact on integers
