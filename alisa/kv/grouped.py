"""Grouped-query attention logits: H query heads over H_kv key heads, without ``repeat_kv``.

One helper for every place that scores queries against keys: decode attention, prefill score
seeding and sharded decode.
"""

from __future__ import annotations

import torch


def grouped_logits(query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """Scaled float32 logits of ``query`` against ``key``, query heads grouped by KV head.

    Parameters
    ----------
    query
        (B, H, q, D) queries; query head h uses KV head h // G with G = H / H_kv (as
        ``repeat_kv``).
    key
        (B, H_kv, S, D) keys.
    scaling
        Softmax scale.

    Returns
    -------
    torch.Tensor
        (B, H_kv, G, q, S) float32 logits (float64 for float64 inputs).
    """
    batch, heads, length, head_dim = query.shape
    kv_heads = key.shape[1]
    # (B, Hkv, G*q, D) @ (B, Hkv, D, S): one matmul per KV head instead of copying keys G times.
    grouped = query.reshape(batch, kv_heads, heads // kv_heads * length, head_dim)
    logits = torch.matmul(grouped, key.transpose(-1, -2))
    # float32 at least; a float64 model's own precision, which its float32 rounding (in an
    # order that follows the CPU's vector width and the slots' layout) would not be.
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) * scaling
    return logits.view(batch, kv_heads, heads // kv_heads, length, -1)
