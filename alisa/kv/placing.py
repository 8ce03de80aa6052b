"""``retention="host"``'s choice and slot placement on CUDA in one Triton kernel per layer.

On CUDA a host step's choice written as PyTorch operations is about forty kernel launches per
layer and step (score, protect, rank, pick the history's share, diff against the held slots,
find free slots), each a few microseconds of host time around a few of device time: at the
Llama-3.1-8B shape, 16 x 8,192, the step was bound by those launches, not by the GPU
(``docs/gpu.md``). :func:`choose_and_place` does the same work in one launch: one program per
(sequence, KV head) row chooses the row's positions (protections, the history's picks, then the
best sketch logits by a radix select, equal values: the newer position first, as
:func:`alisa.kv.kernels.choose` on a CPU), then frees the slots of tokens not chosen and gives
each chosen token the device lacks a free slot, lowest first, as
:meth:`alisa.kv.slots.SlotMap.place` does. Nothing comes back to the host; the fetch itself
(:mod:`alisa.storage.mapped`) reads the flagged rows straight from the host region.

The result equals :func:`alisa.kv.choice.choose` followed by :meth:`SlotMap.place` exactly
(``tests/test_placing.py`` runs the kernel in Triton's interpreter on a CPU;
``tests/test_cuda.py`` compiled on a GPU). ALISA, https://arxiv.org/abs/2403.17312 (§IV);
top-k by radix selection, https://doi.org/10.1145/3458817.3476141.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from alisa.kv.choice import ChoiceInputs
from alisa.storage.transfer import upload

# A program's launch: positions per step of its loops over a row (the radix passes' too), the
# bits of a radix digit (a 256-bin histogram a pass: 2 passes for a level, 6 for a history key),
# and its warps. Measured on an H200 (docs/gpu.md, fifth run): at 4,096 positions and 16 warps 8
# rows of 32K take 0.22 ms, of 128K 0.85 ms, 16 x 8 rows of 8K 0.12 ms (four-bit digits, 256
# positions and 4 warps: 0.68, 3.2 and 0.20); no other setting tried was faster by more than
# the noise of single medians, or on more than one row.
BLOCK = 4096
DIGIT_BITS = 8
WARPS = 16


def choose_and_place(inputs: ChoiceInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This step's choice (:func:`alisa.kv.choice.choose`), then the slots ``inputs.positions``
    (rewritten in place) made exactly the chosen positions as
    :meth:`alisa.kv.slots.SlotMap.place` makes them, in one kernel launch.

    Parameters
    ----------
    inputs
        The choice's inputs; ``positions`` (B, H_kv, S) int64, contiguous, on the device the
        kernel runs on (CUDA with Triton, :func:`alisa.storage.mapped.mapped_reads`; a CPU only
        under ``TRITON_INTERPRET=1``).

    Returns
    -------
    tuple
        (chosen, fetch, target), each (B, H_kv, K) with K = ``budget.max()``: the positions,
        ascending (``seen`` past a row's count); whether each must be fetched; its slot (S
        where not fetched).
    """
    positions = inputs.positions
    if not positions.is_contiguous():
        raise ValueError("choose_and_place rewrites a contiguous slot map only")
    if inputs.seen >= 1 << 29:  # history keys: 31 bits of sum, then the position, in 60 bits
        raise ValueError(f"choose_and_place ranks below 2**29 positions; seen={inputs.seen}")
    batch, heads, capacity = positions.shape
    device = positions.device
    count = int(inputs.budget.max())
    seen = inputs.seen
    logits = _unit_stride(inputs.logits)
    columns = logits.shape[-1]
    # Per sequence, one upload: first position, budget, recent window, history share.
    table = np.stack([inputs.first, inputs.budget, inputs.recent, inputs.shares]).astype(np.int64)
    per_sequence = upload(table, device)
    picking = inputs.history is not None and int(inputs.shares.max()) > 0
    # Without picks the kernel reads no history: the logits stand in for the pointer.
    history_bits = (
        _unit_stride(inputs.history).view(torch.int32) if picking else logits.view(torch.int16)
    )
    rows = batch * heads
    chosen = torch.empty(batch, heads, count, dtype=torch.int64, device=device)
    fetch = torch.empty(batch, heads, count, dtype=torch.bool, device=device)
    target = torch.empty(batch, heads, count, dtype=torch.int64, device=device)
    levels = torch.empty(rows, seen, dtype=torch.int32, device=device)  # a row's scratch
    keys = torch.empty(rows, capacity if picking else 1, dtype=torch.int64, device=device)
    free = torch.empty(rows, capacity, dtype=torch.int32, device=device)
    _kernel()[(rows,)](
        logits.view(torch.int16),
        history_bits,
        per_sequence,
        positions,
        chosen,
        fetch.view(torch.uint8),
        target,
        levels,
        keys,
        free,
        heads,
        logits.shape[2],
        columns,
        logits.stride(0),
        logits.stride(1),
        logits.stride(2),
        history_bits.stride(0),
        history_bits.stride(1),
        batch,
        capacity,
        count,
        inputs.sinks,
        seen,
        max(seen, 1).bit_length(),
        PICKING=picking,
        BLOCK=BLOCK,
        DIGIT_BITS=DIGIT_BITS,
        num_warps=WARPS,
    )
    return chosen, fetch, target


def _unit_stride(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with consecutive elements along its last dimension (the kernel's rows)."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


@functools.cache
def _kernel():
    """The Triton kernel, imported on first use (CPU builds of PyTorch do not ship Triton)."""
    from alisa.kv.triton_kernels import choose_and_place_rows

    return choose_and_place_rows
