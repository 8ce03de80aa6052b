"""Host rows read by the device itself: ``retention="host"``'s fetch without a host round trip.

A selection's fetch list is data-dependent: which chosen tokens the device lacks is known only on
the device, after the layer's query is scored. Reading the host region on the host therefore
costs a wait for the device each layer and step (the list comes down), then a gather on the host
and a copy up: on an H100 at the Llama-3.1-8B shape this was over half of a host step while the
GPU sat idle (``docs/host-speed.md``). On CUDA, page-locked host memory is addressable by
kernels (unified virtual addressing), so the device can read the rows itself: given the
(B, H_kv, K) placement of :meth:`alisa.kv.slots.SlotMap.place` (the chosen positions, whether
each must be fetched, its target slot), :func:`fetch_into` reads exactly the flagged rows
across the bus (masked loads touch no memory), dequantizes INT8 codes and writes them into
their slots, in one kernel, with nothing coming back to the host. ShadowKV reads its offloaded
values the same way (https://arxiv.org/abs/2410.21465); ALISA's phase II is the fetch itself
(https://arxiv.org/abs/2403.17312, §IV).

The kernel is Triton's (it ships with PyTorch's CUDA builds); ``fetch_into(..., kernel=False)``
is the same result in PyTorch ops, which the tests compare it with (and which lets a CPU run the
round-trip-free step, at the cost of reading every chosen row).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

# Entries (sequence, KV head, chosen token) per Triton program.
BLOCK_ENTRIES = 16


def mapped_reads(device: torch.device) -> bool:
    """Whether kernels on ``device`` can read page-locked host memory here (CUDA with Triton)."""
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


def fetch_into(
    region: tuple[torch.Tensor, ...],
    chosen: torch.Tensor,
    fetch: torch.Tensor,
    target: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    kernel: bool | None = None,
) -> None:
    """Write the flagged chosen tokens' rows of a host region into their device slots.

    Parameters
    ----------
    region
        The host region, page-locked: plain (2, B, H_kv, N, D) keys/values in the model dtype,
        or INT8 (codes (2, B, H_kv, N, D) uint8, scale and zero point (2, B, H_kv, N, 1)
        float16), as :class:`~alisa.storage.pages.HostPages` holds them.
    chosen, fetch, target
        (B, H_kv, K) on the device: positions, whether to fetch each, the slot it goes to.
    keys, values
        (B, H_kv, capacity, D) device buffers, written in place.
    kernel
        Run the Triton kernel (the device reads the host rows); False: PyTorch ops, which read
        every chosen row on the host and write the flagged ones (the reference: no round trip
        on a CPU, one to list the rows on CUDA). None: the kernel where it can run
        (:func:`mapped_reads`).
    """
    if kernel is None:
        kernel = mapped_reads(keys.device)
    if kernel:
        _fetch_by_kernel(region, chosen, fetch, target, keys, values)
        return
    batch, heads, entries = chosen.shape
    head_dim = keys.shape[-1]
    capacity = region[0].shape[3]
    rows = torch.arange(batch * heads, device=chosen.device).view(batch, heads, 1)
    source = (rows * capacity + chosen.clamp(0, capacity - 1)).view(-1).cpu()
    picked = [t.view(2, -1, t.shape[-1]).index_select(1, source) for t in region]
    if len(region) == 3:
        data, scale, zero = picked
        compute = torch.float16 if keys.dtype == torch.float16 else torch.float32
        rows_out = (data.to(compute) - zero.to(compute)) * scale.to(compute)
    else:
        rows_out = picked[0]
    rows_out = rows_out.to(keys.device, keys.dtype).view(2, batch, heads, entries, head_dim)
    # Entries not fetched write to one spare slot past the buffer (no data-dependent shape).
    spare = keys.shape[2]
    slots = torch.where(fetch, target, spare).unsqueeze(-1).expand(-1, -1, -1, head_dim)
    for buffer, rows_half in zip((keys, values), rows_out, strict=True):
        padded = torch.nn.functional.pad(buffer, (0, 0, 0, 1))
        buffer.copy_(padded.scatter_(2, slots, rows_half)[:, :, :spare])


def _fetch_by_kernel(region, chosen, fetch, target, keys, values) -> None:
    """:func:`fetch_into` by the Triton kernel (one program per ``BLOCK_ENTRIES`` entries)."""
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
    _kernel()[(-(-total // BLOCK_ENTRIES),)](
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
def _kernel():
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
