"""Slot storage with INT8/INT4 keys and values (ALISA §V) and a full-precision recent window.

Each written token is quantized once, per token per KV head over groups of head_dim, and never
re-quantized. Attention reads ``read(positions)``: the slots dequantized to the model dtype, with
the most recent ``residual_tokens`` tokens taken from a small full-precision ring instead (as KIVI
and HF's ``QuantizedLayer`` keep a residual), when they still hold the token they were written for.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from alisa.ops.cpu import Ring, Scales, attend_slots, code_rows, code_token, takes
from alisa.ops.reference import fetch_codes_static
from alisa.storage.store import (
    DeviceResident,
    HostRows,
    TokenInputs,
    flat_rows,
    page_locked,
    range_rows,
    slot_indices,
    with_capacity,
)
from quant import QuantizedTensor, dequantize, quantize
from quant.asymmetric import SCALE_LEVELS, dequantize_fixed, quantize_fixed

SCALE_DTYPE = torch.float16


class QuantizedPair:
    """Keys (index 0) and values (1) as one uint8 code tensor (2, B, H, capacity, D * bits / 8)
    with per-group scales and zero points (2, B, H, capacity, groups).

    One tensor for both halves the small operations per decode step (one quantize call, three
    writes, one dequantization), which dominate at batch 1 on a CPU.
    """

    def __init__(self, shape: tuple[int, int, int, int], bits: int, group: int, dtype, device):
        batch, heads, capacity, head_dim = shape
        self.bits, self.group, self.dtype, self.head_dim = bits, group, dtype, head_dim
        self.data = torch.zeros(
            2, batch, heads, capacity, head_dim * bits // 8, dtype=torch.uint8, device=device
        )
        groups = head_dim // group
        self.scale = torch.zeros(
            2, batch, heads, capacity, groups, dtype=SCALE_DTYPE, device=device
        )
        self.zero = torch.zeros_like(self.scale)

    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes + self.zero.nbytes

    def int8_rows(self) -> bool:
        """Whether the codes are INT8 with one float16 scale and zero point per row: the format
        the compiled CPU kernels read and write (grouped, INT4 or widened scales are not)."""
        return self.bits == 8 and self.group == self.head_dim and self.scale.dtype == SCALE_DTYPE

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.data, self.scale, self.zero

    def replace(self, tensors) -> None:
        self.data, self.scale, self.zero = tensors

    def pin_memory(self) -> None:
        self.replace(tuple(t.pin_memory() for t in self.tensors()))

    def pinned(self) -> bool:
        return page_locked(*self.tensors())

    def write(self, index: tuple, pair: torch.Tensor) -> None:
        """Quantize ``pair`` (shaped like ``data[index]`` with D values last) into ``index``.

        ``pair`` is quantized where it is and only the codes move here: for a host region fed
        from CUDA the device does the O(n) work and half (INT8) or a quarter (INT4) of the
        bytes cross, where quantizing on the host's cores took most of a long prompt's prefill.
        """
        here = self.data.device
        self.put(index, *(t.to(here) for t in self.code(pair)))

    def code(self, pair: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(data, scale, zero point) of ``pair`` in this pair's format, where ``pair`` is."""
        # K/V of a finite model are finite; a NaN here would already have poisoned the output.
        q = quantize(pair, self.bits, self.group, scale_dtype=self.scale.dtype, check_finite=False)
        return q.data, q.scale, q.zero_point

    def code_rows(self, tokens: torch.Tensor, targets: Callable[[], np.ndarray]) -> bool:
        """Quantize ``tokens`` (2, ..., D: keys and values, one row per (sequence, KV head,
        token)) into the rows ``targets()`` gives ((E,) int64 numpy rows of the (2, B * H *
        capacity, ·) view) by :func:`~alisa.ops.cpu.code_rows`, the same bytes as
        :meth:`code` and :meth:`put`, where the kernel takes them: host memory, float32 tokens,
        INT8 rows with one float16 scale each. False: nothing written (the caller takes
        :meth:`write`, which widens the scales where a row needs it)."""
        if not self._kernel_codes(tokens.dtype):
            return False
        return code_rows(
            tokens.detach().reshape(2, -1, tokens.shape[-1]).numpy(), *self._rows(), targets()
        )

    def code_token(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        slots: torch.Tensor,
        ring: tuple[torch.Tensor, ...],
        position: int,
    ) -> bool:
        """Quantize a decode step's (B, H_kv, 1, D) token into its (B, Hs, 1) ``slots`` and copy
        it into the full-precision ``ring`` (keys, values, slots, positions; E entries, entry
        ``position % E``) by :func:`~alisa.ops.cpu.code_token`, one compiled call, where the
        kernel takes them (as :meth:`code_rows`). False: nothing written."""
        if not self._kernel_codes(keys.dtype):
            return False
        residual = ring[3].shape[0]
        return code_token(
            keys.detach()[:, :, 0].numpy(),
            values.detach()[:, :, 0].numpy(),
            slots[..., 0].numpy(),
            *self._rows(),
            tuple(t.numpy() for t in ring),
            position % residual if residual else 0,
            position,
        )

    def _kernel_codes(self, dtype: torch.dtype) -> bool:
        """Whether the compiled coders take tokens of ``dtype`` into this pair: float32
        tokens, INT8 rows with one float16 scale each (host memory is the caller's)."""
        return dtype == torch.float32 and self.int8_rows()

    def _rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The (2, B * H_kv * capacity, ·) numpy views the compiled coders write: the codes, and
        the int16 bits of the float16 scales and zero points."""
        return (
            self.data.view(2, -1, self.data.shape[-1]).numpy(),
            self.scale.view(torch.int16).view(2, -1).numpy(),
            self.zero.view(torch.int16).view(2, -1).numpy(),
        )

    def put(self, index: tuple, data: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor):
        """Store codes already in this pair's format (bits, group) at ``index``."""
        if torch.promote_types(scale.dtype, self.scale.dtype) != self.scale.dtype:
            # a group needed more precision: widen once
            self.scale = self.scale.to(scale.dtype)
            self.zero = self.zero.to(scale.dtype)
        self.data[index] = data
        self.scale[index] = scale
        self.zero[index] = zero

    def dequantized(self, spare: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, H, capacity + spare, D) keys and values in the model dtype (views of one tensor);
        the ``spare`` slots after the capacity are allocated, not written."""
        if not spare:
            return self.decode(self.data, self.scale, self.zero)
        two, batch, heads, capacity, _ = self.data.shape
        both = torch.empty(
            two,
            batch,
            heads,
            capacity + spare,
            self.head_dim,
            dtype=self.dtype,
            device=self.data.device,
        )
        dequantize(self.quantized(self.data, self.scale, self.zero), out=both[:, :, :, :capacity])
        return both[0], both[1]

    def quantized(
        self, data: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
    ) -> QuantizedTensor:
        """Codes laid out as this pair's, (2, ..., ·) each, as a :class:`quant.QuantizedTensor`."""
        return QuantizedTensor(
            data=data,
            scale=scale,
            zero_point=zero,
            shape=(*data.shape[:-1], self.head_dim),
            dtype=self.dtype,
            bits=self.bits,
            group_size=self.group,
        )

    def decode(
        self, data: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (model dtype) of codes laid out as this pair's, (2, ..., ·) each:
        the whole pair, or rows gathered from it."""
        both = dequantize(self.quantized(data, scale, zero))
        return both[0], both[1]


class StaticPair(QuantizedPair):
    """A :class:`QuantizedPair` a static (compiled) decode step writes with one shape and no
    host read (issue 65): the same codes, scales and zero points, bit for bit.

    :class:`QuantizedPair` widens its scales' dtype when a token needs it (a host read and a
    new tensor). Here scales and zero points are kept as float64 from the start (it holds every
    dtype's values exactly) and the dtype they are values of is a device number, ``level``
    (an index in :data:`quant.asymmetric.SCALE_LEVELS`), which only rises:
    :func:`quant.asymmetric.quantize_fixed` codes at it and :func:`~quant.asymmetric.
    dequantize_fixed` decodes as :func:`quant.dequantize` would at it. The price is memory:
    16 bytes of scale and zero point a group against 4 (a D = 64 row with one group: 80
    against 68 bytes).
    """

    def __init__(
        self,
        shape: tuple[int, int, int, int],
        bits: int,
        group: int,
        dtype,
        device,
        *,
        branch: bool = False,
    ):
        super().__init__(shape, bits, group, dtype, device)
        self.branch = branch  # decode by torch.cond (alisa.ops.backends.Ops.branches)
        self.scale = self.scale.double()
        self.zero = self.zero.double()
        self.level = torch.tensor([SCALE_LEVELS.index(SCALE_DTYPE)], device=device)

    def nbytes(self) -> int:
        return super().nbytes() + self.level.nbytes

    def int8_rows(self) -> bool:
        """Never the compiled kernels' format (their scales are float16)."""
        return False

    def write(self, index: tuple, pair: torch.Tensor) -> None:
        """Quantize ``pair`` (shaped like ``data[index]`` with D values last) into ``index`` at
        the scales' level (raised where a group needs it, as :meth:`QuantizedPair.write`)."""
        data, scale, zero, level = quantize_fixed(
            pair, None, self.level, bits=self.bits, group_size=self.group
        )
        self.put(index, data, scale, zero)
        self.level.copy_(level)

    def dequantized(self, spare: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        both = self.decode(self.data, self.scale, self.zero)
        if spare:  # the spare slots after the capacity: zeros
            both = tuple(torch.nn.functional.pad(half, (0, 0, 0, spare)) for half in both)
        return both[0], both[1]

    def decode(
        self, data: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        both = dequantize_fixed(
            data, scale, zero, self.level, self.dtype, bits=self.bits, branch=self.branch
        )
        return both[0], both[1]


class QuantizedStore(DeviceResident):
    """Drop-in for :class:`~alisa.storage.store.DenseStore` holding K/V as ``bits``-bit codes.

    Parameters
    ----------
    keys, values
        (B, H_kv, L, D) the first tokens (positions 0..L-1, slots 0..L-1).
    capacity
        Slots to allocate.
    bits, group_size
        8 or 4 bits; values per scale along head_dim (default head_dim).
    residual_tokens
        Most recent tokens also kept in full precision (0: none).
    groups
        Selection groups of the cache layer (1, or H_kv when selecting per head).
    compiled
        Whether :meth:`attend` may run its compiled CPU kernel (None: when the tokens are on a
        CPU; False: attention always reads the dequantized :meth:`read`, the reference).
    static
        Code with one shape and no host read (:class:`StaticPair`), for a static cache whose
        decode step is compiled; its attention reads :meth:`read`.
    branch
        A static store decodes in the one dtype its scales' level picks, by a branch
        (:attr:`alisa.ops.backends.Ops.branches`).
    """

    def __init__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        capacity: int,
        *,
        bits: int,
        group_size: int | None,
        residual_tokens: int,
        groups: int,
        compiled: bool = False,
        static: bool = False,
        branch: bool = False,
    ) -> None:
        batch, heads, length, head_dim = keys.shape
        group = group_size or head_dim
        # Whether writes and attention run the compiled CPU kernels (alisa.ops.backends.Ops):
        # attention then reads the codes in place (:meth:`attend`).
        self.compiled = compiled
        shape = (batch, heads, capacity, head_dim)
        if static:
            self.codes = StaticPair(shape, bits, group, keys.dtype, keys.device, branch=branch)
        else:
            self.codes = QuantizedPair(shape, bits, group, keys.dtype, keys.device)
        self.residual = residual_tokens
        self.ring_keys = keys.new_zeros(batch, heads, residual_tokens, head_dim)
        self.ring_values = values.new_zeros(batch, heads, residual_tokens, head_dim)
        self.ring_slots = torch.full(
            (batch, groups, residual_tokens), -1, dtype=torch.long, device=keys.device
        )
        self.ring_positions = torch.full(
            (residual_tokens,), -1, dtype=torch.long, device=keys.device
        )
        self.write_range(0, keys, values, position=0)

    lossless = False  # reads are dequantized: a copy cannot be patched with raw K/V

    @property
    def capacity(self) -> int:
        return self.codes.data.shape[3]

    @property
    def device(self) -> torch.device:
        return self.codes.data.device

    def nbytes(self) -> int:
        """Bytes held: codes, scales, zero points and the full-precision ring."""
        ring = self.ring_keys.nbytes + self.ring_values.nbytes
        return self.codes.nbytes() + ring

    def static_buffers(self) -> tuple[torch.Tensor, ...]:
        """The codes, scales, zero points and their level, and the ring: a static step writes
        its token into them in place."""
        if not isinstance(self.codes, StaticPair):
            raise NotImplementedError("a QuantizedStore built without static=True")
        ring = (self.ring_keys, self.ring_values, self.ring_slots, self.ring_positions)
        return (*self.codes.tensors(), self.codes.level, *ring)

    def read(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, H_kv, capacity, D) keys and values in the model dtype.

        ``positions`` (B, Hs, capacity) is the layer's slot map; a ring entry is used only while
        its slot still holds the token it was written for (the token may have been evicted).
        """
        if not self.residual:
            return self.codes.dequantized()
        # One spare slot past the capacity takes every ring entry whose slot no longer holds
        # its token: then at most one entry writes a real slot (entries hold distinct
        # positions), so one scatter per tensor is deterministic with no host round trip.
        keys, values = self.codes.dequantized(spare=1)
        batch, heads, width, head_dim = keys.shape
        slots = self.ring_slots.clamp(min=0)
        live = (self.ring_slots >= 0) & (positions.gather(-1, slots) == self.ring_positions)
        target = torch.where(live, slots, width - 1).expand(batch, heads, -1)
        # Rows of the flattened (B * H_kv * width, D) tensors: whole head_dim rows are copied
        # (a scatter along the slot dimension with an expanded index is ~10x slower on a CPU).
        row = torch.arange(batch * heads, device=target.device).view(batch, heads, 1) * width
        index = (row + target).flatten()
        keys.view(-1, head_dim).index_copy_(0, index, self.ring_keys.flatten(0, 2))
        values.view(-1, head_dim).index_copy_(0, index, self.ring_values.flatten(0, 2))
        return keys[:, :, : width - 1], values[:, :, : width - 1]

    def attend(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        seen: int,
        window: int | None,
        scaling: float,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A decode query's attention read from the codes in place, on a CPU.

        :func:`alisa.ops.cpu.attend_slots` dequantizes each row in registers as it uses
        it, where :meth:`read` writes the whole region dequantized first (about 1 ms per layer
        and step at B = 16 x 2,048 on SmolLM2-135M, ``docs/host-speed.md``). It takes INT8
        codes with one float16 scale per row, a float32 model and one query per sequence;
        anything else returns None and attention reads :meth:`parts`.

        Parameters
        ----------
        positions
            (B, Hs, capacity) the layer's slot map.
        query
            (B, H, 1, D) the step's queries.
        seen
            Tokens seen so far (the query's position is ``seen - 1``).
        window
            A sliding layer's window, or None.
        scaling
            Softmax scale.

        Returns
        -------
        tuple or None
            ((B, 1, H, D) output, (B, H_kv, G, 1, capacity) float32 probabilities).
        """
        codes = self.codes
        if not (
            self.compiled
            and takes(query, codes.data)
            and codes.int8_rows()
            and codes.dtype == torch.float32
        ):
            return None
        keys, values = (
            Scales(codes.scale[half, ..., 0], codes.zero[half, ..., 0]) for half in (0, 1)
        )
        ring = None
        if self.residual:
            ring = Ring(self.ring_keys, self.ring_values, self.ring_slots, self.ring_positions)
        return attend_slots(
            query,
            codes.data[0],
            codes.data[1],
            positions,
            seen,
            window,
            scaling,
            scales=(keys, values),
            ring=ring,
        )

    def write_range(
        self,
        start: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        position: int,
        inputs: TokenInputs | None = None,
    ) -> None:
        """Store (B, H_kv, q, D) tokens at slots [start, start + q); positions from ``position``."""
        batch, kv_heads, count = keys.shape[:3]
        tokens = torch.stack([keys, values])  # (2, B, H_kv, q, D)
        if not self._code_rows(
            tokens,
            lambda: range_rows(batch * kv_heads, self.capacity, start, count),
        ):
            index = (slice(None), slice(None), slice(None), slice(start, start + count))
            self.codes.write(index, tokens)
        for offset in range(max(0, keys.shape[2] - self.residual), keys.shape[2]):
            slots = torch.full_like(self.ring_slots[..., :1], start + offset)
            self._remember(slots, keys[:, :, offset], values[:, :, offset], position + offset)

    def write_slots(
        self,
        slots: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        position: int | torch.Tensor,
        inputs: TokenInputs | None = None,
    ) -> None:
        """Store one token per (sequence, group) at ``slots`` (B, Hs, 1); ``position`` is a
        (1,) device tensor in a static step."""
        if self._code_token(slots, keys, values, position):
            return
        kv_heads = keys.shape[1]
        rows, heads, slots_ = slot_indices(slots, kv_heads)
        tokens = torch.stack([keys, values])  # (2, B, H_kv, 1, D)
        if not self._code_rows(
            tokens,
            lambda: (
                flat_rows(rows, heads, slots_, kv_heads, self.capacity, host=True).view(-1).numpy()
            ),
        ):
            self.codes.write((slice(None), rows, heads, slots_), tokens)
        self._remember(slots, keys[:, :, 0], values[:, :, 0], position)

    def _code_token(
        self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position: int
    ) -> bool:
        """A decode step's (B, H_kv, 1, D) token coded at ``slots`` and kept in the ring by
        :func:`~alisa.ops.cpu.code_token`, one compiled call, where this store runs its
        compiled kernels on float32 tokens; False: nothing written."""
        ring = (self.ring_keys, self.ring_values, self.ring_slots, self.ring_positions)
        return self.compiled and self.codes.code_token(keys, values, slots, ring, position)

    def _code_rows(self, tokens: torch.Tensor, targets: Callable[[], np.ndarray]) -> bool:
        """:meth:`QuantizedPair.code_rows` where this store runs its compiled kernels: one
        compiled call where quantize and three writes are two dozen small operations per layer
        and step. False: nothing written, the caller takes quantize's path."""
        return self.compiled and self.codes.code_rows(tokens, targets)

    def write_entries(
        self,
        rows: torch.Tensor,
        slots: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        position: int,
        inputs: TokenInputs | None = None,
    ) -> None:
        """Store one token for some sequences: rows, slots (E,), keys/values (E, H_kv, D)."""
        kv_heads = keys.shape[1]
        tokens = torch.stack([keys, values])  # (2, E, H_kv, D)
        heads = torch.arange(kv_heads, device=rows.device).view(1, kv_heads)
        if not self._code_rows(
            tokens,
            lambda: (
                flat_rows(
                    rows.view(-1, 1), heads, slots.view(-1, 1), kv_heads, self.capacity, host=True
                )
                .view(-1)
                .numpy()
            ),
        ):
            # rows/slots are advanced indices around a slice: numpy puts their dimension first.
            self.codes.write((slice(None), rows, slice(None), slots), tokens.transpose(0, 1))
        if self.residual:
            entry = position % self.residual
            self.ring_keys[rows, :, entry] = keys
            self.ring_values[rows, :, entry] = values
            self.ring_slots[rows, :, entry] = slots.view(-1, 1)
            self.ring_positions[entry].fill_(position)  # a scalar fill: no copy, no sync

    def write_heads(self, rows, heads, slots, tokens: HostRows) -> None:
        """Write (sequence, KV head) entries at index triples (E,).

        Host codes of this store's format are copied as they are (quantizing a dequantized
        token again would cost a B = 16 CPU step about 60 ms and add a second rounding). The
        full-precision ring is left alone: its entries are used only while their slot still
        holds the token they were written for.
        """
        pair = self.codes
        kv_heads, capacity = pair.data.shape[2:4]
        flat = flat_rows(rows, heads, slots, kv_heads, capacity, host=self.compiled)
        if tokens.codes_into(pair.bits, pair.group, pair.tensors(), flat):
            return
        index = (slice(None), rows, heads, slots)
        codes = tokens.codes(self.codes.bits, self.codes.group)
        if codes is None:
            self.codes.write(index, torch.stack(tokens.decoded()))
        else:
            self.codes.put(index, *codes)

    def plain_heads(self) -> None:
        """Codes, not plain rows: fetched tokens go through :meth:`write_heads`."""
        return None

    def fetch_static(self, region, region_level, placement, anchor) -> None:
        """A static step's fetch from an INT8 host region of this store's format: the rows'
        codes, scales and zero points as they are (:func:`~alisa.ops.reference.
        fetch_codes_static`), as :meth:`write_heads` copies them."""
        pair = self.codes
        if not isinstance(pair, StaticPair) or region_level is None:
            raise NotImplementedError("a static fetch needs static=True and an INT8 host region")
        fetch_codes_static(region, region_level, *placement, anchor, pair.tensors(), pair.level)

    def reindex(self, index: torch.Tensor, capacity: int) -> None:
        """New slot j holds old slot index[b, g, j]; grow to ``capacity``; remap the ring."""
        rows, heads, slots = slot_indices(index, self.codes.data.shape[2])
        old_capacity = self.capacity  # index < old_capacity: no read of its values needed
        self.codes.replace(
            tuple(with_capacity(t[:, rows, heads, slots], capacity) for t in self.codes.tensors())
        )
        if self.residual:
            old_to_new = torch.full(
                (*index.shape[:2], old_capacity + 1), -1, dtype=torch.long, device=index.device
            )
            new = torch.arange(index.shape[-1], device=index.device).expand_as(index)
            old_to_new.scatter_(-1, index, new)
            slots = self.ring_slots.clamp(min=0, max=old_to_new.shape[-1] - 1)
            moved = old_to_new.gather(-1, slots)
            self.ring_slots = torch.where(self.ring_slots >= 0, moved, -1)

    def grow(self, capacity: int) -> None:
        self.codes.replace(tuple(with_capacity(t, capacity) for t in self.codes.tensors()))

    def select_batch(self, indices: torch.Tensor) -> None:
        self.codes.replace(tuple(t.index_select(1, indices) for t in self.codes.tensors()))
        self.ring_keys = self.ring_keys.index_select(0, indices)
        self.ring_values = self.ring_values.index_select(0, indices)
        self.ring_slots = self.ring_slots.index_select(0, indices)

    def extend_rows(self, other: QuantizedStore) -> None:
        """Append ``other``'s sequences (same capacity and format) after these.

        Both rings hold the same positions at the same entries (position % R, the batches'
        timelines aligned by the caller); an entry one side never wrote (-1) takes the other's.
        """
        scale_dtype = torch.promote_types(self.codes.scale.dtype, other.codes.scale.dtype)
        self.codes.replace(
            tuple(
                torch.cat([mine, theirs], dim=1).to(mine.dtype if index == 0 else scale_dtype)
                for index, (mine, theirs) in enumerate(
                    zip(self.codes.tensors(), other.codes.tensors(), strict=True)
                )
            )
        )
        self.ring_keys = torch.cat([self.ring_keys, other.ring_keys])
        self.ring_values = torch.cat([self.ring_values, other.ring_values])
        self.ring_slots = torch.cat([self.ring_slots, other.ring_slots])
        self.ring_positions = torch.maximum(self.ring_positions, other.ring_positions)

    def shift_positions(self, delta: int) -> None:
        """Tokens moved ``delta`` positions: the ring's entries (position % R) rotate with them."""
        if not self.residual:
            return
        moved = self.ring_positions + delta
        gone = (self.ring_positions < 0) | (moved < 0)  # no sequence holds such a position
        self.ring_positions = torch.roll(moved.masked_fill(gone, -1), delta, 0)
        self.ring_slots = torch.roll(self.ring_slots.masked_fill(gone, -1), delta, 2)
        self.ring_keys = torch.roll(self.ring_keys, delta, 2)
        self.ring_values = torch.roll(self.ring_values, delta, 2)

    def pin_memory(self) -> None:
        """Page-lock the codes and the ring (host regions, CUDA only)."""
        self.codes.pin_memory()
        self.ring_keys, self.ring_values = (
            self.ring_keys.pin_memory(),
            self.ring_values.pin_memory(),
        )
        self.ring_slots = self.ring_slots.pin_memory()
        self.ring_positions = self.ring_positions.pin_memory()

    def pinned(self) -> bool:
        ring = (self.ring_keys, self.ring_values, self.ring_slots, self.ring_positions)
        return self.codes.pinned() and page_locked(*ring)

    def _remember(self, slots: torch.Tensor, keys, values, position: int | torch.Tensor) -> None:
        """Put one token (B, H_kv, D) into the full-precision ring at entry position % R
        (``position`` a (1,) device tensor in a static step: the entry is found there)."""
        if not self.residual:
            return
        if isinstance(position, torch.Tensor):
            entry = position % self.residual
            self.ring_keys.index_copy_(2, entry, keys.unsqueeze(2))
            self.ring_values.index_copy_(2, entry, values.unsqueeze(2))
            self.ring_slots.index_copy_(2, entry, slots)
            self.ring_positions.index_copy_(0, entry, position)
            return
        entry = position % self.residual
        self.ring_keys[:, :, entry] = keys
        self.ring_values[:, :, entry] = values
        self.ring_slots[:, :, entry] = slots[..., 0]
        self.ring_positions[entry].fill_(position)  # a scalar fill: no copy, no sync
