"""What is being generated: batch, lengths, and how the KV is kept and stored."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from scheduler.budget import KeepRule, mean_kept

# Share of the budget fetched from the host per selection and KV head with retention="host",
# selecting every step (tokens chosen now that the device did not hold), by the share of the
# selectable budget ranked by attention history: `python -m probes.bench_reselect --intervals
# 1 [--history-share 0]` (SmolLM2-135M float32, 4 WikiText-2 prompts of 1024 tokens, SWA r = 0.2,
# 32 steps) measured 0.174 with the key sketch alone and 0.124 with the default share of 0.5 (the
# history favours tokens already held). Linear in the share between the two, flat past 0.5. The
# paper bounds it by the whole budget.
FETCH_SHARES = ((0.0, 0.174), (0.5, 0.124))
FETCH_SHARE = FETCH_SHARES[-1][1]  # the default configuration's
# Tokens fetched per selection when selecting every s steps, relative to every step (s = 1), as
# (log2 s, growth): a selection after s steps moves what changed over s steps, but much of a
# step's change is the same tokens trading places again, so it levels off by s = 4. Measured:
# 26.2, 31.0, 33.1, 32.7 tokens per selection and (layer, sequence, KV head) at s = 1, 2, 4, 8
# (sum of keeper.fetched / sum of keeper.steps over cache.layers, prefill excluded), SmolLM2-135M
# float32, one thread, 64 greedy decode steps after 4 WikiText-2 prompts of 1024 tokens
# (experiments.worker.prompts_of_length), AlisaConfig(policy="swa", caching_ratio=0.2,
# retention="host", reselect_every=s); `python -m probes.bench_reselect --steps 64`
# reproduces it. (At s = 1 that is 0.124 of the budget with the default history share.) Linear in
# log2 s between the points, the last one past s = 8.
FETCH_GROWTH = ((0.0, 1.0), (1.0, 1.18), (2.0, 1.26), (3.0, 1.25))
RETENTIONS = ("drop", "host")


def fetch_share(history_share: float) -> float:
    """Share of the budget a selection at every step fetches, for a ``history_share`` in [0, 1]
    (:data:`FETCH_SHARES`)."""
    return _measured(FETCH_SHARES, history_share)


def fetch_growth(reselect_every: int) -> float:
    """Tokens fetched per selection every ``reselect_every`` steps over those of every step
    (:data:`FETCH_GROWTH`)."""
    return _measured(FETCH_GROWTH, float(np.log2(reselect_every)))


def _measured(points: tuple[tuple[float, float], ...], x: float) -> float:
    """A measured (x, y) table read at ``x``: linear between points, flat past the ends."""
    xs, ys = zip(*points, strict=True)
    return float(np.interp(x, xs, ys))


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
    retention
        ``drop``: tokens outside the budget are deleted. ``host``: every token stays in a host
        region (``host_bits``), the device holds the chosen budget plus a key sketch of every
        token, and each selection fetches ``fetch_share`` of the budget from the host (ALISA's
        theta^g term).
    host_bits, fetch_share
        Host-region precision and the share of the budget fetched per selection when selecting
        every step (retention host).
    reselect_every
        Decode steps per selection (retention host; ignored with ``drop``): the steps between
        attend to the last chosen set plus the new tokens, so the selection and its fetch are
        paid once per ``reselect_every`` steps.
    """

    batch: int
    prompt_len: int
    gen_len: int
    caching_ratio: float = 1.0
    recent_fraction: float = 0.5
    kv_bits: int = 16
    hidden_bits: int = 16
    keep: tuple[KeepRule, ...] = ()
    retention: str = "drop"
    host_bits: int = 8
    fetch_share: float = FETCH_SHARE
    reselect_every: int = 1

    def __post_init__(self) -> None:
        for name in ("batch", "prompt_len", "gen_len", "reselect_every"):
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

        if self.retention not in RETENTIONS:
            raise ValueError(f"retention={self.retention!r} must be one of {RETENTIONS}")
        if self.host_bits not in (4, 8, 16):
            raise ValueError(f"host_bits={self.host_bits!r} must be 4, 8 or 16")
        if not 0 <= self.fetch_share <= 1:
            raise ValueError(f"fetch_share={self.fetch_share!r} must be in [0, 1]")
        if not isinstance(self.keep, tuple) or not all(isinstance(r, KeepRule) for r in self.keep):
            raise ValueError(f"keep={self.keep!r} must be a tuple of KeepRule")

    def kept_tokens(self, step: int) -> int:
        """Tokens kept over the whole batch at decode step ``step`` (0-based), layers averaged."""
        return int(self.kept_per_step(step, step + 1)[0])

    def seen_per_step(self, start: int, stop: int) -> np.ndarray:
        """(stop - start,) tokens seen over the whole batch at decode steps [start, stop)."""
        return self.batch * (self.prompt_len + np.arange(start, stop, dtype=np.int64))

    def kept_per_step(self, start: int, stop: int) -> np.ndarray:
        """(stop - start,) :meth:`kept_tokens` of decode steps [start, stop), computed at once."""
        rules = self.keep or (KeepRule(caching_ratio=self.caching_ratio),)
        seen = self.prompt_len + np.arange(start, stop, dtype=np.int64)
        return self.batch * mean_kept(rules, seen)
