"""The CUDA backend (``kernels="cuda"``): host retention's choice, placement and fetch in Triton.

**Choice and placement in one launch** (:func:`choose_and_place`). On CUDA a host step's choice
written as PyTorch operations is about forty kernel launches per layer and step (score, protect,
rank, pick the history's share, diff against the held slots, find free slots), each a few
microseconds of host time around a few of device time: at the Llama-3.1-8B shape, 16 x 8,192,
the step was bound by those launches, not by the GPU (``docs/gpu.md``). One program per
(sequence, KV head) row chooses the row's positions (protections, the history's picks, then the
best sketch logits by a radix select, equal values: the newer position first, as
:func:`alisa.ops.reference.select_rule`), then frees the slots of tokens not chosen and gives
each chosen token the device lacks a free slot, lowest first, as
:func:`alisa.ops.reference.place` does. Nothing comes back to the host.

**Host rows read by the device itself** (:func:`fetch_placed`). A selection's fetch list is
data-dependent: which chosen tokens the device lacks is known only on the device. Reading the
host region on the host costs a wait for the device each layer and step, then a gather and a
copy up: on an H100 at the Llama-3.1-8B shape this was over half of a host step while the GPU
sat idle (``docs/host-speed.md``). Page-locked host memory is addressable by kernels (unified
virtual addressing), so the device reads exactly the flagged rows across the bus (masked loads
touch no memory), dequantizes INT8 codes and writes them into their slots, in one kernel.
ShadowKV reads its offloaded values the same way (https://arxiv.org/abs/2410.21465).

Both equal the PyTorch reference exactly (``tests/test_placing.py`` and ``tests/test_mapped.py``
run them in Triton's interpreter on a CPU; ``tests/test_cuda.py`` compiled on a GPU). Triton is
imported on first use only (CPU builds of PyTorch do not ship it). ALISA,
https://arxiv.org/abs/2403.17312 (§IV); top-k by radix selection,
https://doi.org/10.1145/3458817.3476141.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from alisa.ops.reference import ChoiceInputs, Placement
from alisa.ops.transfer import upload

# A program's launch: positions per step of its loops over a row (the radix passes' too), the
# bits of a radix digit (a 256-bin histogram a pass: 2 passes for a level, 6 for a history key),
# and its warps. Measured on an H200 (docs/gpu.md, fifth run): at 4,096 positions and 16 warps 8
# rows of 32K take 0.22 ms, of 128K 0.85 ms, 16 x 8 rows of 8K 0.12 ms (four-bit digits, 256
# positions and 4 warps: 0.68, 3.2 and 0.20); no other setting tried was faster by more than
# the noise of single medians, or on more than one row.
BLOCK = 4096


DIGIT_BITS = 8


WARPS = 16


# Entries (sequence, KV head, chosen token) per Triton program.
BLOCK_ENTRIES = 16


def choose_and_place(
    inputs: ChoiceInputs, *, block: int = BLOCK, digit_bits: int = DIGIT_BITS
) -> Placement:
    """This step's choice (:func:`alisa.ops.reference.select_rule`), then the slots
    ``inputs.positions`` (rewritten in place) made exactly the chosen positions as
    :func:`alisa.ops.reference.place` makes them, in one kernel launch.

    Parameters
    ----------
    inputs
        The choice's inputs; ``positions`` (B, H_kv, S) int64, contiguous, on the device the
        kernel runs on (CUDA with Triton; a CPU only under ``TRITON_INTERPRET=1``).
    block, digit_bits
        The launch's positions per loop step and bits per radix digit (the defaults were the
        fastest measured; a test passes others to make rows span several blocks).

    Returns
    -------
    Placement
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
    _placing_kernel()[(rows,)](
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
        BLOCK=block,
        DIGIT_BITS=digit_bits,
        num_warps=WARPS,
    )
    return Placement(chosen, fetch, target)


def _unit_stride(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with consecutive elements along its last dimension (the kernel's rows)."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


@functools.cache
def _placing_kernel():
    """The Triton kernel, imported on first use (CPU builds of PyTorch do not ship Triton)."""
    from alisa.ops.triton_kernels import choose_and_place_rows

    return choose_and_place_rows


def fetch_placed(
    region: tuple[torch.Tensor, ...],
    chosen: torch.Tensor,
    fetch: torch.Tensor,
    target: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
) -> None:
    """:func:`alisa.ops.reference.fetch_placed` by the Triton kernel, one program per
    ``BLOCK_ENTRIES`` entries: the device reads the flagged rows of the page-locked host
    ``region`` itself and writes them into their slots of ``keys`` and ``values`` (same
    parameters)."""
    tensors = (*region, chosen, fetch, target, keys, values)
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("the mapped fetch reads and writes contiguous buffers only")
    batch, heads, entries = chosen.shape
    head_dim = keys.shape[-1]
    coded = len(region) == 3
    data = region[0]
    scale, zero = (region[1], region[2]) if coded else (data, data)  # unread when plain
    total = batch * heads * entries
    pointers = (chosen, fetch.view(torch.uint8), target, data, scale, zero, keys, values)
    sizes = (total, entries, data.shape[3], keys.shape[2], data[0].numel() // head_dim)
    _fetch_kernel()[(-(-total // BLOCK_ENTRIES),)](
        *pointers,
        *sizes,
        D=head_dim,
        BLOCK_D=triton_power_of_2(head_dim),
        BLOCK_E=BLOCK_ENTRIES,
        CODED=coded,
        # As quant.dequantize: a float16 result of float16 scales is computed in float16.
        FP16=coded and keys.dtype == torch.float16,
    )


def triton_power_of_2(value: int) -> int:
    """The least power of two at or above ``value`` (a Triton block size)."""
    return 1 << max(0, value - 1).bit_length()


@functools.cache
def _fetch_kernel():
    """The Triton kernel, compiled on first use (Triton is imported only then: CPU builds of
    PyTorch do not ship it)."""
    import triton
    import triton.language as tl

    # Sizes change from step to step: one compilation, not one per divisibility class.
    @triton.jit(do_not_specialize=["total", "entries", "host_capacity", "capacity", "half_rows"])
    def fetch_rows_mapped(  # pointers, then sizes (rows of one half: half_rows), then blocks
        chosen,
        fetch,
        target,
        data,
        scale,
        zero,
        keys,
        values,
        total,
        entries,
        host_capacity,
        capacity,
        half_rows,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_E: tl.constexpr,
        CODED: tl.constexpr,
        FP16: tl.constexpr,
    ):
        entry = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
        wanted = tl.load(fetch + entry, mask=entry < total, other=0) != 0
        row = (entry // entries).to(tl.int64)  # sequence * H_kv + head
        position = tl.load(chosen + entry, mask=wanted, other=0)
        slot = tl.load(target + entry, mask=wanted, other=0)
        source = row * host_capacity + position
        destination = row * capacity + slot
        channel = tl.arange(0, BLOCK_D)
        both = wanted[:, None] & (channel[None, :] < D)
        for half in tl.static_range(2):
            rows = source + half * half_rows
            read = tl.load(data + rows[:, None] * D + channel[None, :], mask=both, other=0)
            if CODED:
                step = tl.load(scale + rows, mask=wanted, other=0)
                offset = tl.load(zero + rows, mask=wanted, other=0)
                if FP16:  # as quant.dequantize: exact in float16 with float16 scales
                    read = (read.to(tl.float16) - offset[:, None]) * step[:, None]
                else:
                    read = (read.to(tl.float32) - offset[:, None].to(tl.float32)) * step[
                        :, None
                    ].to(tl.float32)
            place = destination[:, None] * D + channel[None, :]
            if half == 0:
                tl.store(keys + place, read.to(keys.dtype.element_ty), mask=both)
            else:
                tl.store(values + place, read.to(values.dtype.element_ty), mask=both)

    return fetch_rows_mapped
