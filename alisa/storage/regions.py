"""The regions a tiered store is made of: device, host (offload) and recompute.

A region owns a contiguous range of a layer's slots and answers attention with dense (K, V) on
the model's device. Adding a tier means adding one class here that follows :class:`Region`
(built by ``build`` from its share of the prefill); the tiered store routes reads, writes, growth
and batch selection to its regions in one loop and never looks at their names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from alisa.storage.store import KVStore, TokenInputs, page_locked

Recompute = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class TierStats:
    """Traffic of one layer's slower tiers (counters shared by its regions)."""

    fetched_bytes: int = 0  # host -> device bytes copied
    recomputed_tokens: int = 0  # tokens whose K/V were rebuilt
    prefetch_hits: int = 0  # host reads served by a copy started a layer ahead


@dataclass(frozen=True)
class RegionContext:
    """What regions need besides their tokens: where things live and how to rebuild K/V."""

    factory: Callable[[torch.Tensor, torch.Tensor, int], KVStore]  # dense or quantized
    model_device: torch.device
    host_device: torch.device
    recompute: Recompute | None
    stats: TierStats
    # Host buffers page-locked and copies on a side stream (the model is on CUDA:
    # alisa.ops.backends.Ops.pinned).
    pinned: bool = False


class Region(Protocol):
    """One slot range of a tiered store.

    ``tier`` names it in byte and token reports; ``needs_inputs`` says whether writes must carry
    :class:`~alisa.storage.store.TokenInputs`.
    """

    tier: str
    needs_inputs: bool

    @classmethod
    def build(
        cls,
        keys: torch.Tensor,
        values: torch.Tensor,
        inputs: TokenInputs | None,
        capacity: int,
        context: RegionContext,
    ) -> Region:
        """A region of ``capacity`` slots holding the first tokens (B, H_kv, n, D) (inputs
        (B, n, ...) when it ``needs_inputs``)."""
        ...

    @property
    def slots(self) -> int: ...

    def nbytes(self) -> int: ...

    def read(self, positions: torch.Tensor, used: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, H_kv, n, D) keys and values of the region's first n slots on the model's device,
        ``used`` <= n <= slots (the slots from ``used`` on are free: a region may leave them
        out); positions (B, Hs, slots)."""
        ...

    def write_range(
        self, start: int, keys, values, position: int, inputs: TokenInputs | None
    ) -> None: ...

    def write_entries(
        self, rows, slots, keys, values, position: int, inputs: TokenInputs | None
    ) -> None: ...

    def grow(self, slots: int) -> None: ...

    def select_batch(self, indices: torch.Tensor) -> None: ...

    def prefetch(self, used: int) -> None:
        """Start copying the first ``used`` slots (at least) that the next :meth:`read` needs."""
        ...

    def pinned(self) -> bool:
        """Whether its host buffers are page-locked (True when it has none): on CUDA they
        must be, or every copy to the device waits for the host."""
        ...


class DeviceRegion:
    """Resident KV on the model's device (dense or quantized store)."""

    tier = "device"
    needs_inputs = False

    def __init__(self, store: KVStore) -> None:
        self.store = store

    @classmethod
    def build(cls, keys, values, inputs, capacity: int, context: RegionContext) -> DeviceRegion:
        return cls(context.factory(keys, values, capacity))

    @property
    def slots(self) -> int:
        return self.store.capacity

    def nbytes(self) -> int:
        return self.store.nbytes()

    def read(self, positions: torch.Tensor, used: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slot: the buffers are read in place (a view of the used ones would be strided,
        and a strided bfloat16 product takes a slow path on a CPU)."""
        return self.store.read(positions)

    def write_range(self, start, keys, values, position, inputs) -> None:
        self.store.write_range(start, keys, values, position)

    def write_entries(self, rows, slots, keys, values, position, inputs) -> None:
        self.store.write_entries(rows, slots, keys, values, position)

    def grow(self, slots: int) -> None:
        raise ValueError(
            "the device tier is full and no host tier was configured (set host_memory)"
        )

    def select_batch(self, indices: torch.Tensor) -> None:
        self.store.select_batch(indices)

    def prefetch(self, used: int) -> None:
        """Already resident."""

    def pinned(self) -> bool:
        return True


class HostRegion:
    """Offloaded KV in host memory (page-locked on CUDA), copied to the device when read.

    Lossless stores (plain, not quantized) can be copied a layer ahead by :meth:`prefetch`, on a
    side stream on CUDA: SWA's kept set for a step is fixed by the step before, so the copy stays
    valid, and the one token written in between is patched into it.
    """

    tier = "host"
    needs_inputs = False

    def __init__(
        self, store: KVStore, model_device: torch.device, stats: TierStats, *, pinned: bool = False
    ) -> None:
        self.store, self.model_device, self.stats = store, model_device, stats
        self.pin = pinned  # page-locked buffers, copies on a side stream (CUDA)
        self._pin()
        self._prefetched = None  # (keys, values, event) copied ahead
        self._stream = None  # CUDA side stream for the copies, created on first use

    @classmethod
    def build(cls, keys, values, inputs, capacity: int, context: RegionContext) -> HostRegion:
        host_keys, host_values = keys.to(context.host_device), values.to(context.host_device)
        store = context.factory(host_keys, host_values, capacity)
        return cls(store, context.model_device, context.stats, pinned=context.pinned)

    @property
    def slots(self) -> int:
        return self.store.capacity

    def nbytes(self) -> int:
        return self.store.nbytes()

    def prefetch(self, used: int) -> None:
        """Start copying the region's first ``used`` slots to the device; the next :meth:`read`
        finds them ready."""
        if not self.store.lossless or self._prefetched is not None or used <= 0:
            return
        if self.pin:
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.model_device)
            stream = self._stream
            stream.wait_stream(torch.cuda.current_stream(self.model_device))
            with torch.cuda.stream(stream):
                keys, values = self._copy(None, used)
                event = torch.cuda.Event()
                event.record(stream)
        else:
            (keys, values), event = self._copy(None, used), None
        self._prefetched = (keys, values, event)

    def read(self, positions: torch.Tensor, used: int) -> tuple[torch.Tensor, torch.Tensor]:
        prefetched, self._prefetched = self._prefetched, None
        if prefetched is not None and prefetched[0].shape[2] >= used:
            keys, values, event = prefetched
            if event is not None:
                torch.cuda.current_stream(self.model_device).wait_event(event)
            self.stats.prefetch_hits += 1
            return keys, values
        # A lossless store reads without the slot map: skip moving it to the host.
        return self._copy(None if self.store.lossless else positions.to(self.store.device), used)

    def _copy(self, positions: torch.Tensor | None, used: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.store.read(positions)
        # A real copy even on CPU-only machines (where .to would be a no-op view): the host
        # pool is a separate tier, and the cost model prices this traffic. Only the used slots
        # cross (the copy is contiguous whatever the view).
        keys = keys[:, :, :used].to(self.model_device, non_blocking=True, copy=True)
        values = values[:, :, :used].to(self.model_device, non_blocking=True, copy=True)
        self.stats.fetched_bytes += keys.nbytes + values.nbytes
        return keys, values

    def write_range(self, start, keys, values, position, inputs) -> None:
        end = start + keys.shape[2]
        if self._prefetched is not None and end > self._prefetched[0].shape[2]:
            self._prefetched = None  # past the slots copied ahead: read afresh
        if self._prefetched is not None:  # keep the copy in step with the store
            copied_keys, copied_values, _ = self._prefetched
            copied_keys[:, :, start:end] = keys
            copied_values[:, :, start:end] = values
        target = self.store.device
        self.store.write_range(start, keys.to(target), values.to(target), position)

    def write_entries(self, rows, slots, keys, values, position, inputs) -> None:
        if self._prefetched is not None:  # the same values go to the copy's slots
            # Within the copy without a check (which would read the slots back to the host):
            # entries are a decode step's one token per row, in a hole below the width or at
            # the frontier, and the copy reaches one slot past the width (TieredStore.prefetch).
            copied_keys, copied_values, _ = self._prefetched
            copied_keys[rows, :, slots] = keys.to(copied_keys.dtype)
            copied_values[rows, :, slots] = values.to(copied_values.dtype)
        target = self.store.device
        self.store.write_entries(
            rows.to(target), slots.to(target), keys.to(target), values.to(target), position
        )

    def grow(self, slots: int) -> None:
        self._prefetched = None
        self.store.grow(slots)
        self._pin()

    def select_batch(self, indices: torch.Tensor) -> None:
        self._prefetched = None
        self.store.select_batch(indices.to(self.store.device))
        self._pin()

    def pinned(self) -> bool:
        return self.store.pinned()

    def _pin(self) -> None:
        """Page-lock the store's (new) buffers when the model is on CUDA."""
        if self.pin:
            self.store.pin_memory()


class RecomputeRegion:
    """Attention inputs (B, S, hidden) and RoPE positions (B, S) in host memory; K/V rebuilt
    by the layer's own projections whenever attention reads the region."""

    tier = "recompute"
    needs_inputs = True

    def __init__(
        self, hidden: torch.Tensor, rope: torch.Tensor, recompute: Recompute, context
    ) -> None:
        self.model_device, self.stats = context.model_device, context.stats
        self.pin = context.pinned
        self.hidden, self.rope, self.recompute = hidden, rope, recompute
        self._pin()

    @classmethod
    def build(
        cls, keys, values, inputs: TokenInputs, capacity: int, context: RegionContext
    ) -> RecomputeRegion:
        batch, count = keys.shape[0], keys.shape[2]
        hidden_size = inputs.hidden.shape[-1]
        host = context.host_device
        hidden = torch.zeros(batch, capacity, hidden_size, dtype=inputs.hidden.dtype, device=host)
        rope = torch.zeros(batch, capacity, dtype=torch.long, device=host)
        region = cls(hidden, rope, context.recompute, context)
        if count:
            region.write_range(0, keys, values, 0, inputs)
        return region

    @property
    def slots(self) -> int:
        return self.hidden.shape[1]

    def nbytes(self) -> int:
        return self.hidden.nbytes + self.rope.nbytes

    def read(self, positions: torch.Tensor, used: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the first ``used`` slots, rebuilt (the spare ones past them are not)."""
        # Contiguous: a model's projection may view its input (GPT-2's Conv1D does).
        hidden = self.hidden[:, :used].to(self.model_device, non_blocking=True).contiguous()
        rope = self.rope[:, :used].to(self.model_device, non_blocking=True).contiguous()
        self.stats.recomputed_tokens += hidden.shape[0] * hidden.shape[1]
        return self.recompute(hidden, rope)

    def write_range(self, start, keys, values, position, inputs: TokenInputs) -> None:
        self._write((slice(None), slice(start, start + keys.shape[2])), inputs)

    def write_entries(self, rows, slots, keys, values, position, inputs: TokenInputs) -> None:
        self._write((rows, slots), TokenInputs(inputs.hidden[:, 0], inputs.rope[:, 0]))

    def _write(self, index, inputs: TokenInputs) -> None:
        self.hidden[index] = inputs.hidden.to(self.hidden.device, non_blocking=True)
        self.rope[index] = inputs.rope.to(self.rope.device, non_blocking=True)

    def grow(self, slots: int) -> None:
        extra = slots - self.slots
        self.hidden = torch.nn.functional.pad(self.hidden, (0, 0, 0, extra))
        self.rope = torch.nn.functional.pad(self.rope, (0, extra))
        self._pin()

    def select_batch(self, indices: torch.Tensor) -> None:
        self.hidden = self.hidden.index_select(0, indices.to(self.hidden.device))
        self.rope = self.rope.index_select(0, indices.to(self.rope.device))
        self._pin()

    def prefetch(self, used: int) -> None:
        """Rebuilt on read; nothing to copy ahead."""

    def pinned(self) -> bool:
        return page_locked(self.hidden, self.rope)

    def _pin(self) -> None:
        """Page-lock the inputs when the model is on CUDA, so reading them does not wait."""
        if self.pin and not self.hidden.is_pinned():
            self.hidden, self.rope = self.hidden.pin_memory(), self.rope.pin_memory()
