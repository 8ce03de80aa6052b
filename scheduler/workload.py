"""What is being generated: batch, lengths, and how the KV is kept and stored."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from scheduler.budget import KeepRule, mean_kept


@dataclass(frozen=True, kw_only=True)
class Workload:
    """One generation job as the scheduler sees it.

    Attributes
    ----------
    batch, prompt_len, gen_len
        Sequences, prompt tokens per sequence, tokens to generate.
    caching_ratio
        r: with no ``keep`` rules, every layer keeps round((prompt_len + j) * r) tokens per
        sequence at step j; with them, only reported.
    keep
        The budget rule of each layer (sinks, pyramid scales, dense layers: what the cache
        runs); empty = one uniform rule of ``caching_ratio``.
    recent_fraction
        Share of the kept tokens that are the recent window (stays on the device).
    kv_bits, hidden_bits
        Storage precision of KV and of hidden states kept for recomputation.
    """

    batch: int
    prompt_len: int
    gen_len: int
    caching_ratio: float = 1.0
    recent_fraction: float = 0.5
    kv_bits: int = 16
    hidden_bits: int = 16
    keep: tuple[KeepRule, ...] = ()

    def __post_init__(self) -> None:
        for name in ("batch", "prompt_len", "gen_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if not 0 < self.caching_ratio <= 1:
            raise ValueError(f"caching_ratio={self.caching_ratio!r} must be in (0, 1]")
        if not 0 <= self.recent_fraction <= 1:
            raise ValueError(f"recent_fraction={self.recent_fraction!r} must be in [0, 1]")
        for name in ("kv_bits", "hidden_bits"):
            if getattr(self, name) not in (4, 8, 16):
                raise ValueError(f"{name}={getattr(self, name)!r} must be 4, 8 or 16")

        if not isinstance(self.keep, tuple) or not all(isinstance(r, KeepRule) for r in self.keep):
            raise ValueError(f"keep={self.keep!r} must be a tuple of KeepRule")

    def kept_tokens(self, step: int) -> int:
        """Tokens kept over the whole batch at decode step ``step`` (0-based), layers averaged."""
        return int(self.kept_per_step(step, step + 1)[0])

    def kept_per_step(self, start: int, stop: int) -> np.ndarray:
        """(stop - start,) :meth:`kept_tokens` of decode steps [start, stop), computed at once."""
        rules = self.keep or (KeepRule(caching_ratio=self.caching_ratio),)
        seen = self.prompt_len + np.arange(start, stop, dtype=np.int64)
        return self.batch * mean_kept(rules, seen)
