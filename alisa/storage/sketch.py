"""Small per-token key codes on the device, to rank every stored token against each query.

With ``retention="host"`` every token's K/V is kept in the host region and each decode step
attends to the ``round(n*r)`` tokens that the current query is expected to attend to most. The
ranking needs a cheap view of *all* keys on the device: each key is coded to 4 bits per channel
against one running range per (sequence, KV head, channel), so ``q . k_hat`` is one matmul over
the codes plus a per-head offset (``q . lo + (q * step) . codes``), read at 1/8 of an fp32 key.

Page-granular Quest bounds (Tang et al., ICML'24, https://arxiv.org/abs/2406.10774) were tried
first and missed by far on SmolLM2 (+27 % perplexity at r = 0.2, see
``docs/retention-selection-study.md``); token-level q . k_hat with 2-4 bit keys is within about a
point of an oracle that knows the true attention (InfiniGen, OSDI'24, and ShadowKV score tokens
in the same spirit).

The range widens, with a margin, when a new key falls outside it; older codes are then re-coded
from their own values (a pass over the codes, allowed only in the first ``RECODE_TOKENS``
positions; later outliers are clamped to the range). Tokens that are always attended (sinks,
padding) are left out of the range, so one outlier key cannot coarsen the codes of all others.
"""

from __future__ import annotations

import torch

SKETCH_BITS = 4
LEVELS = 2**SKETCH_BITS - 1
# A widened range grows by this share of its new width on the side that overflowed, so the
# re-coding pass happens a few times per sequence rather than at every new extreme.
MARGIN = 0.25
# Re-coding reads every code: it is allowed while a sequence is short (ranges settle within the
# first few hundred tokens); later keys outside the range are clamped to it, which keeps their
# rank at the extreme where it belongs.
RECODE_TOKENS = 1024
# Scores are computed over chunks of about this many code values, in bfloat16 (codes 0..15 are
# exact in it, and the ranking tolerates rounded weights). The float copy of a chunk (4 MiB) is
# meant to stay in cache for the product that reads it: on the CPU measured, chunks of 12 MiB
# scored 4x slower per token than chunks of 6 MiB, and chunks far smaller pay per-call overhead.
SCORE_DTYPE = torch.bfloat16
CHUNK_VALUES = 1 << 21


class KeySketch:
    """4-bit per-channel codes of every key of one layer, on the model's device.

    Parameters
    ----------
    batch, heads, head_dim
        Sequences, KV heads and channels.
    capacity
        Token positions allocated (grows as needed).
    device
        The model's device.
    """

    def __init__(
        self, batch: int, heads: int, head_dim: int, capacity: int, device: torch.device
    ) -> None:
        self.codes = torch.zeros(batch, heads, capacity, head_dim, dtype=torch.uint8, device=device)
        self.low: torch.Tensor | None = None  # (B, H, 1, D) float32 bottom of the range
        self.step: torch.Tensor | None = None  # (B, H, 1, D) float32 width / LEVELS
        self.recodings = 0  # times older codes were re-coded after a range grew

    @property
    def capacity(self) -> int:
        return self.codes.shape[2]

    def nbytes(self) -> int:
        ranges = 0 if self.low is None else self.low.nbytes + self.step.nbytes
        return self.codes.nbytes + ranges

    def grow(self, capacity: int) -> None:
        """Room for ``capacity`` positions, plus an eighth so growth copies amortise."""
        if capacity <= self.capacity:
            return
        extra = capacity + max(16, capacity // 8) - self.capacity
        self.codes = torch.nn.functional.pad(self.codes, (0, 0, 0, extra))

    def widens(self, start: int) -> bool:
        """Whether keys written at ``start`` may still widen the range."""
        return self.low is None or start < RECODE_TOKENS

    def write(self, start: int, keys: torch.Tensor, counted: torch.Tensor | None) -> None:
        """Code keys (B, H, m, D) of positions [start, start + m).

        ``counted`` (B, m) bool says which of them may widen the range (not sinks or padding);
        the others are coded too, clamped to the range. ``None`` when :meth:`widens` is False.
        """
        keys = keys.float()
        if counted is not None and self.widens(start):
            self._widen(keys, counted)
        if self.low is None:  # nothing counted yet: codes are rewritten once a range exists
            return
        self.grow(start + keys.shape[2])
        self.codes[:, :, start : start + keys.shape[2]] = self._code(keys)

    def scores(self, query: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Estimated logit of positions [0, L), max over each KV head's queries, into ``out``.

        Parameters
        ----------
        query
            (B, H, G, D) this step's queries grouped by KV head (G query heads per KV head).
        out
            (B, H, L) float32, filled and returned; L at most the positions written.
        """
        query = query.float()
        length = out.shape[-1]
        if self.low is None:
            return out.zero_()
        weights = (query * self.step).to(SCORE_DTYPE)  # (B, H, G, D)
        base = (query * self.low).sum(-1, keepdim=True)  # (B, H, G, 1)
        batch, heads, _, dim = self.codes.shape
        chunk = max(1, CHUNK_VALUES // max(1, batch * heads * dim))
        for begin in range(0, length, chunk):
            end = min(begin + chunk, length)
            codes = self.codes[:, :, begin:end].to(SCORE_DTYPE)  # (B, H, c, D)
            # (G, D) @ (D, c): a wide product, several times faster than (c, D) @ (D, G).
            logits = torch.matmul(weights, codes.transpose(-1, -2))  # (B, H, G, c)
            torch.amax(logits.float().add_(base), dim=-2, out=out[:, :, begin:end])
        return out

    def select_batch(self, indices: torch.Tensor) -> None:
        self.codes = self.codes.index_select(0, indices)
        if self.low is not None:
            self.low = self.low.index_select(0, indices)
            self.step = self.step.index_select(0, indices)

    # ---- internals -----------------------------------------------------------------------

    def _code(self, keys: torch.Tensor) -> torch.Tensor:
        codes = torch.round((keys - self.low) / self.step)
        return codes.clamp_(0, LEVELS).to(torch.uint8)

    def _widen(self, keys: torch.Tensor, counted: torch.Tensor) -> None:
        """Grow the range to cover the counted keys, re-coding older codes when it moved."""
        mask = counted.to(keys.device).view(keys.shape[0], 1, -1, 1)
        if not bool(mask.any()):
            return
        new_low = keys.masked_fill(~mask, float("inf")).amin(2, keepdim=True)
        new_high = keys.masked_fill(~mask, float("-inf")).amax(2, keepdim=True)
        if self.low is None:
            width = (new_high - new_low).clamp(min=1e-3)
            low, high = new_low - MARGIN * width, new_high + MARGIN * width
            # A sequence with no counted key yet gets a unit range around zero until it has one.
            finite = torch.isfinite(low) & torch.isfinite(high)
            low = torch.where(finite, low, -1.0)
            high = torch.where(finite, high, 1.0)
            self.low, self.step = low, (high - low) / LEVELS
            return
        low, high = self.low, self.low + self.step * LEVELS
        below, above = new_low < low, new_high > high
        if not bool((below | above).any()):
            return
        wide_low, wide_high = torch.minimum(low, new_low), torch.maximum(high, new_high)
        width = wide_high - wide_low
        wide_low = torch.where(below, wide_low - MARGIN * width, wide_low)
        wide_high = torch.where(above, wide_high + MARGIN * width, wide_high)
        old = self.low + self.codes.float() * self.step  # what the codes stood for
        self.low, self.step = wide_low, (wide_high - wide_low) / LEVELS
        self.codes = self._code(old)
        self.recodings += 1
