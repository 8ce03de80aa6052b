"""A decode step's attention over a device region's slots on a CPU, by compiled kernels.

PyTorch's path (:func:`alisa.kv.attention.grouped_attention_parts`, the reference and CUDA's)
needs the region as float tensors: an INT8 region is dequantized whole each step and the layer's
full-precision ring written over it (``QuantizedStore.read``), about 1 ms per layer at B = 16 x
2,048 on SmolLM2-135M, then a product, a conversion, a scaling, a mask built from the slot
positions, a softmax and a second product, each paying its fixed cost. Here the logits (mask and
scaling included) are one compiled pass over the stored rows, INT8 codes dequantized in
registers as they are read (:func:`alisa.storage.kernels.slot_logits`), then PyTorch's softmax,
then one pass for the output (:func:`~alisa.storage.kernels.slot_output`). KIVI
(https://arxiv.org/abs/2402.02750) and QServe compute attention on quantized KV the same way,
dequantizing in the kernel; ALISA (https://arxiv.org/abs/2403.17312, §V) stores INT8 KV.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from alisa.kernel_threads import kernel_parts
from alisa.storage.kernels import HALVES, slot_logits, slot_output

# Stand-ins for the arrays a region without codes or ring never reads.
_NO_SCALES = np.zeros((0, 0), dtype=np.int16)
_NO_SLOTS = np.zeros((0, 0, 0), dtype=np.int64)
_NO_POSITIONS = np.zeros(0, dtype=np.int64)


class Scales(NamedTuple):
    """(B, H_kv, C) float16 scale and zero point of each coded row (one group per row)."""

    scale: torch.Tensor
    zero: torch.Tensor


class Ring(NamedTuple):
    """Full-precision copies of the last E tokens: (B, H_kv, E, D) keys and values, (B, Hs, E)
    slot of each entry (negative: none), (E,) position each entry was written for."""

    keys: torch.Tensor
    values: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor


def takes(query: torch.Tensor, stored: torch.Tensor) -> bool:
    """Whether :func:`attend_slots` serves a decode step with these (B, H, q, D) queries over
    a region stored as ``stored`` (float32 rows or uint8 codes): one query per sequence, float32,
    on a CPU."""
    return (
        query.shape[2] == 1
        and query.dtype == torch.float32
        and query.device.type == "cpu"
        and stored.dtype in (torch.float32, torch.uint8)
    )


def attend_slots(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    seen: int,
    window: int | None,
    scaling: float,
    *,
    scales: tuple[Scales, Scales] | None = None,
    ring: Ring | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain softmax attention of one query per sequence over the slots of a region.

    Parameters
    ----------
    query
        (B, H, 1, D) float32 queries; query head h reads KV head h // G, G = H / H_kv.
    keys, values
        (B, H_kv, C, D) float32 rows, or uint8 INT8 codes with ``scales``.
    positions
        (B, Hs, C) position held by each slot (negative: empty), Hs = 1 or H_kv.
    seen
        Tokens seen so far: the query's position is ``seen - 1``; later positions are hidden.
    window
        A sliding layer's window W (positions within W of the query are seen), or None.
    scaling
        Softmax scale.
    scales
        The keys' and the values' :class:`Scales` when they are codes.
    ring
        Full-precision rows read instead of a slot's codes while the slot holds their token.

    Returns
    -------
    tuple
        ((B, 1, H, D) output, (B, H_kv, G, 1, C) float32 probabilities): the shapes of
        :func:`alisa.kv.attention.grouped_attention_parts` for q = 1.
    """
    batch, heads, _, head_dim = query.shape
    kv_heads, capacity = keys.shape[1], keys.shape[2]
    rows, groups = batch * kv_heads, heads // kv_heads
    grouped = query.reshape(rows, groups, head_dim).contiguous()
    held = positions.numpy()
    if ring is None:
        ring_keys = ring_values = np.zeros((rows, 0, head_dim), dtype=np.float32)
        entries = (_NO_SLOTS, _NO_POSITIONS)
    else:
        ring_keys, ring_values = (
            t.reshape(rows, -1, head_dim).numpy() for t in (ring.keys, ring.values)
        )
        entries = (ring.slots.numpy(), ring.positions.numpy())
    key_scales = value_scales = (_NO_SCALES, _NO_SCALES)
    if scales is not None:
        key_scales, value_scales = (
            tuple(t.view(torch.int16).reshape(rows, capacity).numpy() for t in pair)
            for pair in scales
        )
    parts = kernel_parts(rows)
    logits = torch.empty(rows, groups, capacity, dtype=torch.float32)
    keys_stored = keys.reshape(rows, capacity, head_dim).numpy()
    slot_logits(
        grouped.numpy(),
        keys_stored,
        *key_scales,
        HALVES,
        held,
        ring_keys,
        *entries,
        seen - 1,
        window or 0,
        scaling,
        logits.numpy(),
        parts,
    )
    probabilities = logits.softmax(dim=-1)  # PyTorch's vectorised exponentials
    out = torch.empty_like(grouped)
    values_stored = values.reshape(rows, capacity, head_dim).numpy()
    slot_output(
        probabilities.numpy(),
        values_stored,
        *value_scales,
        HALVES,
        held,
        ring_values,
        *entries,
        out.numpy(),
        parts,
    )
    return (
        out.view(batch, 1, heads, head_dim),
        probabilities.view(batch, kv_heads, groups, 1, capacity),
    )
