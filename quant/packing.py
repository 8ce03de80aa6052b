"""Two 4-bit codes per byte along the last dimension."""

from __future__ import annotations

import torch


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """(..., n) uint8 codes in [0, 15], n even -> (..., n / 2) bytes: even index low, odd high."""
    if codes.shape[-1] % 2:
        raise ValueError(f"4-bit packing needs an even last dimension, got {codes.shape[-1]}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: (..., n / 2) bytes -> (..., n) uint8 codes."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)
