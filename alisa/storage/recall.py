"""Recall pool (beyond the paper): evicted tokens wait in an INT8 host pool and can come back.

SWA's eviction is final in the paper: a token that left the kept set gets no attention, so its
score stays zero. Here evicted keys/values are quantized (``quant``, 8-bit) into a pool in host
memory; every ``recall_every`` decode steps the current query is scored against the pool, with the
kept tokens' softmax normaliser, and pool tokens that would get more attention than the weakest
unprotected kept tokens swap places with them (at most ``recall_tokens`` per sequence per layer).
"""

from __future__ import annotations

import torch

from alisa.grouped import grouped_logits
from quant import QuantizedTensor, dequantize, quantize


class RecallPool:
    """Evicted tokens of one layer: INT8 keys/values (B, H_kv, P, D) and positions (B, P)."""

    def __init__(self, host: torch.device) -> None:
        self.host = host
        self.keys: QuantizedTensor | None = None
        self.values: QuantizedTensor | None = None
        self.positions: torch.Tensor | None = None  # (B, P), -1 where empty

    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes + self.positions.nbytes

    def add(self, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions) -> None:
        """Add evicted tokens: rows (E,), keys/values (E, H_kv, D), positions (E,)."""
        batch = int(rows.max()) + 1 if self.positions is None else self.positions.shape[0]
        counts = torch.bincount(rows, minlength=batch)
        width = int(counts.max())
        # Lay the E tokens out as (B, width): each sequence's tokens in order, padded with -1.
        order = torch.argsort(rows, stable=True)
        rows, keys, values, positions = rows[order], keys[order], values[order], positions[order]
        starts = torch.cumsum(counts, 0) - counts
        column = torch.arange(rows.numel(), device=rows.device) - starts[rows]
        heads, dim = keys.shape[1], keys.shape[2]
        new_keys = keys.new_zeros(batch, width, heads, dim)
        new_values = values.new_zeros(batch, width, heads, dim)
        new_positions = torch.full((batch, width), -1, dtype=torch.long, device=rows.device)
        new_keys[rows, column], new_values[rows, column], new_positions[rows, column] = (
            keys,
            values,
            positions,
        )
        self._append(new_keys.transpose(1, 2), new_values.transpose(1, 2), new_positions)

    def _append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        keys_q = quantize(keys.to(self.host), 8)
        values_q = quantize(values.to(self.host), 8)
        positions = positions.to(self.host)
        if self.keys is None:
            self.keys, self.values, self.positions = keys_q, values_q, positions
            return
        self.keys = _concat(self.keys, keys_q)
        self.values = _concat(self.values, values_q)
        self.positions = torch.cat([self.positions, positions], dim=1)

    def read(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dequantized (B, H_kv, P, D) keys and values and (B, P) positions on ``device``."""
        return (
            dequantize(self.keys).to(device),
            dequantize(self.values).to(device),
            self.positions.to(device),
        )

    def remove(self, rows: torch.Tensor, columns: torch.Tensor) -> None:
        self.positions[rows.to(self.host), columns.to(self.host)] = -1

    def select_batch(self, indices: torch.Tensor) -> None:
        if self.keys is None:
            return
        host = indices.to(self.host)
        self.keys = _select(self.keys, host)
        self.values = _select(self.values, host)
        self.positions = self.positions.index_select(0, host)


def _concat(a: QuantizedTensor, b: QuantizedTensor) -> QuantizedTensor:
    scale_dtype = torch.promote_types(a.scale.dtype, b.scale.dtype)
    shape = (*a.shape[:2], a.shape[2] + b.shape[2], a.shape[3])
    return QuantizedTensor(
        data=torch.cat([a.data, b.data], dim=2),
        scale=torch.cat([a.scale.to(scale_dtype), b.scale.to(scale_dtype)], dim=2),
        zero_point=torch.cat([a.zero_point.to(scale_dtype), b.zero_point.to(scale_dtype)], dim=2),
        shape=shape,
        dtype=a.dtype,
        bits=a.bits,
        group_size=a.group_size,
    )


def _select(q: QuantizedTensor, rows: torch.Tensor) -> QuantizedTensor:
    return QuantizedTensor(
        data=q.data.index_select(0, rows),
        scale=q.scale.index_select(0, rows),
        zero_point=q.zero_point.index_select(0, rows),
        shape=(rows.numel(), *q.shape[1:]),
        dtype=q.dtype,
        bits=q.bits,
        group_size=q.group_size,
    )


def candidates(
    query: torch.Tensor,
    pool_keys: torch.Tensor,
    pool_positions: torch.Tensor,
    log_normaliser: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """(B, P) attention each pool token would get from the current query, heads summed.

    ``log_normaliser`` (B, H_kv, G, 1) is log-sum-exp of the current step's logits over the kept
    tokens, so pool scores are on the same scale as the kept tokens' probabilities.
    """
    logits = grouped_logits(query, pool_keys, scaling)[:, :, :, 0]  # (B, Hkv, G, P)
    weights = torch.exp(logits - log_normaliser)
    score = weights.sum(dim=(1, 2))
    return score.masked_fill(pool_positions < 0, -1.0)
