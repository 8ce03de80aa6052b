"""Slot storage of one layer's keys and values: preallocated, written in place, grown in chunks.

The cache layer decides which slot holds which token; a store only holds the bytes. Every store
keeps the layout (B, H_kv, S, D) of HF caches and answers ``read(width)`` with dense tensors
over the first ``width`` slots, which is what attention consumes.
"""

from __future__ import annotations

import torch


def expand_slot_index(index: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """(B, Hs, n) slot index -> (B, H_kv, n, D) for gather/scatter on (B, H_kv, S, D) tensors."""
    batch, groups, count = index.shape
    return index.view(batch, groups, count, 1).expand(batch, heads, count, head_dim)


class DenseStore:
    """Keys and values in the model's dtype, in preallocated (B, H_kv, capacity, D) buffers."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        batch, heads, length, head_dim = keys.shape
        # Zeroed, not empty: masked slots still enter p @ V, and 0 * NaN garbage would be NaN.
        self.keys = keys.new_zeros(batch, heads, capacity, head_dim)
        self.values = values.new_zeros(batch, heads, capacity, values.shape[-1])
        self.keys[:, :, :length] = keys
        self.values[:, :, :length] = values

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def nbytes(self) -> int:
        """Bytes held by the buffers, spare capacity included."""
        return self.keys.nbytes + self.values.nbytes

    def bytes_per_slot(self) -> int:
        """Bytes one slot (one token, all KV heads of a sequence, K and V) costs."""
        return self.nbytes() // max(1, self.capacity * self.keys.shape[0])

    def read(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense (B, H_kv, width, D) views of the first ``width`` slots."""
        return self.keys[:, :, :width], self.values[:, :, :width]

    def write_range(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write (B, H_kv, q, D) tensors into slots [start, start + q)."""
        end = start + keys.shape[2]
        self.keys[:, :, start:end] = keys
        self.values[:, :, start:end] = values

    def write_slots(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write one token per (sequence, group): slots (B, Hs, 1), keys/values (B, H_kv, 1, D)."""
        index = expand_slot_index(slots, self.keys.shape[1], self.keys.shape[-1])
        self.keys.scatter_(2, index, keys)
        self.values.scatter_(2, index, values)

    def reindex(self, index: torch.Tensor, capacity: int) -> None:
        """New slot j holds old slot index[b, g, j]; then grow to ``capacity`` slots."""
        expanded = expand_slot_index(index, self.keys.shape[1], self.keys.shape[-1])
        self.keys = _with_capacity(self.keys.gather(2, expanded), capacity)
        self.values = _with_capacity(self.values.gather(2, expanded), capacity)

    def grow(self, capacity: int) -> None:
        """Extend to ``capacity`` slots (one copy, amortised by growing in chunks)."""
        self.keys = _with_capacity(self.keys, capacity)
        self.values = _with_capacity(self.values, capacity)

    def select_batch(self, indices: torch.Tensor) -> None:
        """Keep (and reorder) sequences: finished ones dropped, beams reordered."""
        self.keys = self.keys.index_select(0, indices)
        self.values = self.values.index_select(0, indices)


def _with_capacity(tensor: torch.Tensor, capacity: int) -> torch.Tensor:
    batch, heads, length, head_dim = tensor.shape
    if length == capacity:
        return tensor.contiguous()
    out = tensor.new_zeros(batch, heads, capacity, head_dim)
    kept = min(length, capacity)
    out[:, :, :kept] = tensor[:, :, :kept]
    return out
