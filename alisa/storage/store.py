"""Slot storage of one layer's keys and values: the store protocol and the dense store.

The cache layer decides which slot holds which token; a store only holds the bytes. Every store
keeps the layout (B, H_kv, S, D) of HF caches and answers ``parts(positions, query)`` with
dense tensors over its slots in slot order, which is what attention consumes. A store is either
one device region (:class:`DenseStore`, :class:`~alisa.storage.quantized.QuantizedStore`) or an
ordered list of regions (:class:`~alisa.storage.tiers.TieredStore`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np
import torch

from alisa.ops import library
from alisa.ops.cpu import attend_slots, put_slots, takes
from alisa.ops.reference import fetch_placed_static


@dataclass(frozen=True)
class TokenInputs:
    """Attention inputs of the tokens being written, for stores that rebuild K/V from them.

    Attributes
    ----------
    hidden
        (B, n, hidden) the attention modules' inputs (after the layer norm).
    rope
        (B, n) RoPE positions the tokens were encoded at.
    """

    hidden: torch.Tensor
    rope: torch.Tensor

    def span(self, part: slice) -> TokenInputs:
        """The tokens ``part`` of the n written ones."""
        return TokenInputs(self.hidden[:, part], self.rope[:, part])

    def rows(self, rows: torch.Tensor) -> TokenInputs:
        """Some sequences' rows (entries of ``write_entries``)."""
        return TokenInputs(self.hidden[rows], self.rope[rows])


class Part(NamedTuple):
    """One region's keys and values on the model's device, and the position of each slot.

    ``keys``/``values`` are (B, H_kv, n, D); ``positions`` (B, Hs, n) (negative: empty).
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor


class HostRows(Protocol):
    """Tokens read back from the host region of ``retention="host"``, E (sequence, KV head)
    entries, as that region stores them."""

    def decoded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(E, D) keys and values in the model dtype, on the model's device."""
        ...

    def codes(self, bits: int, group: int) -> tuple[torch.Tensor, ...] | None:
        """The rows' (data, scale, zero point), each (2, E, ·), when the host region codes them
        with ``bits`` and ``group`` values per scale (a device region of that format copies them
        as they are: no dequantize-requantize round trip); None otherwise."""
        ...

    def codes_into(
        self, bits: int, group: int, codes: tuple[torch.Tensor, ...], rows: torch.Tensor
    ) -> bool:
        """Copy the rows' (data, scale, zero point) as stored into rows (E,) of the caller's
        ``codes``, each (2, B, H_kv, capacity, ·) (its own buffers), when the host region codes
        them with ``bits`` and ``group`` in the same dtypes and one compiled pass per tensor can
        do it (a CPU); else False, nothing written (the caller takes :meth:`codes`)."""
        ...

    def write_into(self, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor) -> None:
        """Write the tokens, decoded, into rows (E,) of the caller's (M, D) ``keys`` and
        ``values`` (its own buffers, viewed flat): :meth:`decoded` and a scatter, or one
        compiled pass from the host codes on a CPU."""
        ...


class KVStore(Protocol):
    """What a cache layer needs from its storage, whatever regions it has.

    Capabilities are plain members: ``compactable`` (``reindex`` may move slots; tiered stores
    keep their layout and reuse holes instead), ``needs_inputs`` (writes must carry
    :class:`TokenInputs`, for regions that recompute K/V) and ``lossless`` (``read`` returns
    exactly what was written and needs no slot map, so a copy of it can be patched in place).
    """

    compactable: bool
    needs_inputs: bool
    lossless: bool

    @property
    def capacity(self) -> int: ...

    @property
    def device(self) -> torch.device:
        """Where the (first region's) buffers live."""
        ...

    @property
    def regions(self) -> list[tuple[str, int]]:
        """(tier, slots) per region, in slot order."""
        ...

    def nbytes(self) -> int: ...

    def static_buffers(self) -> tuple[torch.Tensor, ...]:
        """The buffers a static (compiled) decode step writes in place, whose addresses stay
        fixed from the first decode step on (:mod:`alisa.kv.static`)."""
        ...

    def tier_bytes(self) -> dict[str, int]: ...

    def read(self, positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, H_kv, capacity, D) keys and values; ``positions`` is the layer's slot map."""
        ...

    def parts(
        self, positions: torch.Tensor, query: torch.Tensor | None = None, width: int | None = None
    ) -> list[Part]:
        """(K, V, positions) per region on the model's device, in slot order. ``width``: slots
        [width, capacity) are free (the slot map's frontier; None: not known), so a store whose
        read copies or rebuilds each slot may leave them out: a part's positions then cover
        only the slots it read."""
        ...

    def write_range(
        self,
        start: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        position: int,
        inputs: TokenInputs | None = None,
    ) -> None: ...

    def write_slots(
        self,
        slots: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        position: int,
        inputs: TokenInputs | None = None,
    ) -> None: ...

    def write_entries(
        self,
        rows: torch.Tensor,
        slots: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        position: int,
        inputs: TokenInputs | None = None,
    ) -> None: ...

    def write_heads(
        self, rows: torch.Tensor, heads: torch.Tensor, slots: torch.Tensor, tokens: HostRows
    ) -> None:
        """Write single (sequence, KV head) entries at index triples (E,): the tokens brought
        back from the host region by ``retention="host"``."""
        ...

    def plain_heads(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The (B, H_kv, capacity, D) keys and values when the store holds them as they are in
        the model's dtype (so a fetch may write rows straight into them,
        :func:`alisa.ops.cuda.fetch_placed`); None when it codes them."""
        ...

    def fetch_static(
        self,
        region: tuple[torch.Tensor, ...],
        region_level: torch.Tensor | None,
        placement: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        anchor: torch.Tensor,
    ) -> None:
        """A static host-retention step's fetch (:func:`alisa.ops.reference.
        fetch_placed_static`): the host ``region``'s rows the ``placement`` (chosen, fetch,
        target) fetches, written into their slots with one shape; ``region_level``: an INT8
        region's scale level (None for a 16-bit one)."""
        ...

    def attend(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        seen: int | torch.Tensor,
        window: int | None,
        scaling: float,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A decode step's plain softmax attention computed by the store over its slots, when
        it has a faster way than :meth:`parts` (on a CPU: compiled kernels over a float32
        region, or over an INT8 region's codes read in place):
        ((B, 1, H, D) output, (B, H_kv, G, 1, capacity) probabilities); None otherwise.
        ``positions`` is the layer's slot map, the query's position ``seen - 1`` (a (1,)
        device tensor in a static step)."""
        ...

    def reindex(self, index: torch.Tensor, capacity: int) -> None: ...

    def grow(self, capacity: int) -> None: ...

    def select_batch(self, indices: torch.Tensor) -> None: ...

    def extend_rows(self, other: KVStore) -> None:
        """Append ``other``'s sequences (a store of the same kind and capacity) after these."""
        ...

    def shift_positions(self, delta: int) -> None:
        """The layer's slot map moved every token ``delta`` positions (state kept per position
        follows; the slots do not move)."""
        ...

    def prefetch(self) -> None: ...

    def pin_memory(self) -> None: ...

    def pinned(self) -> bool:
        """Whether every buffer is page-locked host memory (what :meth:`pin_memory` makes)."""
        ...


class StoreFactory(Protocol):
    """Builds a layer's store from its first (B, H_kv, L, D) keys and values."""

    def __call__(
        self, keys: torch.Tensor, values: torch.Tensor, capacity: int, *, groups: int
    ) -> KVStore: ...


class DeviceResident:
    """The parts of :class:`KVStore` shared by stores that are one device region."""

    compactable = True
    needs_inputs = False
    lossless = True  # read returns exactly what was written (a copy of it can be patched)

    @property
    def capacity(self) -> int:
        raise NotImplementedError

    def nbytes(self) -> int:
        raise NotImplementedError

    def static_buffers(self) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError(f"{type(self).__name__} has no static decode step")

    def fetch_static(self, region, region_level, placement, anchor) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no static host fetch")

    def read(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    @property
    def regions(self) -> list[tuple[str, int]]:
        return [("device", self.capacity)]

    def tier_bytes(self) -> dict[str, int]:
        return {"device": self.nbytes()}

    def parts(
        self, positions: torch.Tensor, query: torch.Tensor | None = None, width: int | None = None
    ) -> list[Part]:
        """The one region: ``read(positions)``, every slot (``width`` is not needed: the
        buffers are read in place, and a view of the used slots would be strided)."""
        return [Part(*self.read(positions), positions)]

    def attend(self, positions, query, seen: int, window, scaling: float) -> None:
        """No path of its own: attention reads :meth:`parts`."""
        return None

    def prefetch(self) -> None:
        """Nothing to fetch: the buffers are already where attention reads them."""

    def shift_positions(self, delta: int) -> None:
        """Nothing is kept per position: slots hold the bytes wherever their token sits."""


def flat_rows(
    rows: torch.Tensor,
    heads: torch.Tensor,
    slots: torch.Tensor,
    kv_heads: int,
    capacity: int,
    *,
    host: bool = False,
) -> torch.Tensor:
    """(E,) row of each (sequence, KV head, slot) entry in a (B * H_kv * capacity, ·) view of a
    (B, H_kv, capacity, ·) buffer: one row index, so one ``index_select``/``index_copy_`` moves
    the entries (advanced indexing over three dimensions is several times slower on a CPU).

    ``host``: the indices are in host memory (the compiled CPU path), and the arithmetic runs in
    numpy (three small ops of a few microseconds, where each dispatched PyTorch op costs tens in
    a decode step).
    """
    if host:
        flat = (rows.numpy() * kv_heads + heads.numpy()) * capacity + slots.numpy()
        return torch.from_numpy(flat)
    return (rows * kv_heads + heads) * capacity + slots


def byte_view(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's bytes as a numpy view (no copy), its last dimension widened by the item
    size: for compiled kernels that move rows of any dtype (numba has no 16-bit floats)."""
    return tensor.detach().view(torch.uint8).numpy()


def range_rows(sequences: int, capacity: int, start: int, count: int) -> np.ndarray:
    """(sequences * count,) int64 rows of slots [start, start + count) of every (sequence, KV
    head) in a (``sequences`` * capacity, ·) view, in (sequence, slot) order: where a
    (``sequences``, count, ·) block of tokens lands."""
    rows = np.arange(sequences, dtype=np.int64).reshape(-1, 1) * capacity
    return (rows + np.arange(start, start + count, dtype=np.int64)).ravel()


def slot_indices(
    index: torch.Tensor, heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, Hs, n) slot index -> advanced indices (batch, head, slot) broadcast to (B, H_kv, n).

    Advanced indexing, not ``gather``/``scatter_`` with an expanded index: on CPU the latter
    copies the whole buffer (measured 3 ms vs 17 us for one token of a 16 x 1K bf16 cache).
    """
    batch, groups, count = index.shape
    rows = torch.arange(batch, device=index.device).view(batch, 1, 1)
    heads_index = torch.arange(heads, device=index.device).view(1, heads, 1)
    return rows, heads_index, index.expand(batch, heads, count)


class DenseStore(DeviceResident):
    """Keys and values in the model's dtype, in preallocated (B, H_kv, capacity, D) buffers.

    ``compiled`` (None: when the tokens are on a CPU) lets a float32 decode step's attention
    run the compiled kernels of :mod:`alisa.ops.cpu`; False keeps PyTorch's path.
    ``operators``: a static step's attention runs them as an operator
    (:func:`alisa.ops.library.attend_slots`), which ``torch.compile`` calls.
    """

    def __init__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        capacity: int,
        *,
        groups: int = 1,
        compiled: bool = False,
        operators: bool = False,
    ) -> None:
        batch, heads, length, head_dim = keys.shape
        # Whether writes and attention run the compiled CPU kernels (alisa.ops.backends.Ops).
        self.compiled = compiled
        self.operators = operators
        # Zeroed, not empty: masked slots still enter p @ V, and 0 * NaN garbage would be NaN.
        self.keys = keys.new_zeros(batch, heads, capacity, head_dim)
        self.values = values.new_zeros(batch, heads, capacity, values.shape[-1])
        self.keys[:, :, :length] = keys
        self.values[:, :, :length] = values

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    @property
    def device(self) -> torch.device:
        return self.keys.device

    def nbytes(self) -> int:
        """Bytes held by the buffers, spare capacity included."""
        return self.keys.nbytes + self.values.nbytes

    def static_buffers(self) -> tuple[torch.Tensor, ...]:
        """The keys and values: a static step writes its token into them in place."""
        return self.keys, self.values

    def attend(self, positions, query, seen: int | torch.Tensor, window, scaling: float):
        """A float32 decode step on a CPU: :func:`alisa.ops.cpu.attend_slots` over the
        buffers (one pass for the logits and mask, one for the output), called as an operator
        in a static step (``seen`` a (1,) tensor); else None."""
        if not ((self.compiled or self.operators) and takes(query, self.keys)):
            return None
        if self.operators:
            return library.attend_slots(
                query, self.keys, self.values, positions, seen, window or 0, scaling
            )
        return attend_slots(query, self.keys, self.values, positions, seen, window, scaling)

    def read(self, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole (B, H_kv, capacity, D) buffers, contiguous (``positions`` is not needed).

        Attention reads every slot (empty ones masked) rather than a view of the used prefix: a
        strided view sends bf16 matmuls on CPU to a slow path (6x here), while the spare
        capacity is at most 1/8 of the slots.
        """
        return self.keys, self.values

    def write_range(
        self,
        start: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        position: int = 0,
        inputs: TokenInputs | None = None,
    ) -> None:
        """Write (B, H_kv, q, D) tensors into slots [start, start + q)."""
        end = start + keys.shape[2]
        self.keys[:, :, start:end] = keys
        self.values[:, :, start:end] = values

    def write_slots(
        self,
        slots: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        position: int = 0,
        inputs: TokenInputs | None = None,
    ) -> None:
        """Write one token per (sequence, group): slots (B, Hs, 1), keys/values (B, H_kv, 1, D)."""
        if self.compiled:  # one compiled copy of the rows' bytes
            rows = (byte_view(t) for t in (self.keys, self.values, keys, values))
            if not put_slots(*rows, slots.numpy()):
                raise IndexError(f"a slot outside [0, {self.capacity}) in {slots.view(-1)}")
            return
        index = slot_indices(slots, self.keys.shape[1])
        self.keys[index] = keys
        self.values[index] = values

    def write_entries(
        self,
        rows: torch.Tensor,
        slots: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        position: int = 0,
        inputs: TokenInputs | None = None,
    ) -> None:
        """Write one token for some sequences: rows, slots (E,), keys/values (E, H_kv, D)."""
        self.keys[rows, :, slots] = keys
        self.values[rows, :, slots] = values

    def write_heads(self, rows, heads, slots, tokens: HostRows) -> None:
        """Write (sequence, KV head) entries at index triples (E,)."""
        batch, kv_heads, capacity, dim = self.keys.shape
        flat = flat_rows(rows, heads, slots, kv_heads, capacity, host=self.compiled)
        tokens.write_into(self.keys.view(-1, dim), self.values.view(-1, dim), flat)

    def plain_heads(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys, self.values

    def fetch_static(self, region, region_level, placement, anchor) -> None:
        """The fetched rows, decoded, into the keys and values (:meth:`KVStore.fetch_static`)."""
        fetch_placed_static(region, *placement, anchor, self.keys, self.values)

    def reindex(self, index: torch.Tensor, capacity: int) -> None:
        """New slot j holds old slot index[b, g, j]; then grow to ``capacity`` slots."""
        index = slot_indices(index, self.keys.shape[1])
        self.keys = with_capacity(self.keys[index], capacity)
        self.values = with_capacity(self.values[index], capacity)

    def grow(self, capacity: int) -> None:
        """Extend to ``capacity`` slots (one copy, amortised by growing in chunks)."""
        self.keys = with_capacity(self.keys, capacity)
        self.values = with_capacity(self.values, capacity)

    def select_batch(self, indices: torch.Tensor) -> None:
        """Keep (and reorder) sequences: finished ones dropped, beams reordered."""
        self.keys = self.keys.index_select(0, indices)
        self.values = self.values.index_select(0, indices)

    def extend_rows(self, other: DenseStore) -> None:
        """Append ``other``'s sequences (same capacity) after these: one concatenation."""
        self.keys = torch.cat([self.keys, other.keys])
        self.values = torch.cat([self.values, other.values])

    def pin_memory(self) -> None:
        """Page-lock host buffers so host-to-device copies run asynchronously (CUDA only)."""
        self.keys, self.values = self.keys.pin_memory(), self.values.pin_memory()

    def pinned(self) -> bool:
        return page_locked(self.keys, self.values)


def page_locked(*tensors: torch.Tensor) -> bool:
    """Whether every tensor is in page-locked host memory (an empty one has no memory to lock:
    it counts as locked)."""
    return all(t.is_pinned() or t.numel() == 0 for t in tensors)


def headroom(slots: int) -> int:
    """Spare slots allocated beyond what is stored: growth in chunks of 1/8, at least 32."""
    return max(32, slots // 8)


def with_capacity(tensor: torch.Tensor, capacity: int) -> torch.Tensor:
    """Copy with the slot dimension (second to last) at ``capacity``: cut or zero-padded."""
    length = tensor.shape[-2]
    if length == capacity:
        return tensor.contiguous()
    out = tensor.new_zeros(*tensor.shape[:-2], capacity, tensor.shape[-1])
    kept = min(length, capacity)
    out[..., :kept, :] = tensor[..., :kept, :]
    return out
