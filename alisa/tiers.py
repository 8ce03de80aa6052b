"""Tiered KV storage: a device region bounded by bytes, a host region, a recompute region.

ALISA's three phases (https://arxiv.org/abs/2403.17312, §IV): KV on the device (I), KV split
between device and host (II), part of it deleted and recomputed (III). A layer's slots are split
into contiguous regions [device | host | recompute]; the cache layer fills holes lowest slot
first, so the device region is used before the host, and appends land in the last region. The
host region is a separate pool (pinned memory on CUDA, so copies can overlap compute); the
recompute region keeps each token's attention input and RoPE position and rebuilds K/V with the
layer's own projections. Attention reads the regions as parts: one layer's host and recomputed
KV are on the device only while that layer runs, so the device holds resident KV plus one layer.
Every tier keeps every token exactly: offload and recompute are lossless.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from alisa.store import DenseStore, KVStore

Recompute = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, kw_only=True)
class TierLayout:
    """Slots per sequence of one layer in each tier.

    Attributes
    ----------
    device_slots
        Slots kept on the model's device (from the byte budget).
    host_slots
        Slots in the host pool; with ``recompute`` the rest go to the recompute region.
    recompute
        Whether overflow beyond the host region is deleted and recomputed.
    """

    device_slots: int
    host_slots: int
    recompute: bool = False


class HiddenStore:
    """Attention inputs (B, S, hidden) and RoPE positions (B, S) of the recompute region."""

    def __init__(self, batch: int, capacity: int, hidden_size: int, dtype, device) -> None:
        self.hidden = torch.zeros(batch, capacity, hidden_size, dtype=dtype, device=device)
        self.rope = torch.zeros(batch, capacity, dtype=torch.long, device=device)

    @property
    def capacity(self) -> int:
        return self.hidden.shape[1]

    def nbytes(self) -> int:
        return self.hidden.nbytes + self.rope.nbytes

    def write(self, index, hidden: torch.Tensor, rope: torch.Tensor) -> None:
        self.hidden[index] = hidden.to(self.hidden.device, non_blocking=True)
        self.rope[index] = rope.to(self.rope.device, non_blocking=True)

    def grow(self, capacity: int) -> None:
        extra = capacity - self.capacity
        self.hidden = torch.nn.functional.pad(self.hidden, (0, 0, 0, extra))
        self.rope = torch.nn.functional.pad(self.rope, (0, extra))

    def select_batch(self, indices: torch.Tensor) -> None:
        self.hidden = self.hidden.index_select(0, indices.to(self.hidden.device))
        self.rope = self.rope.index_select(0, indices.to(self.rope.device))


class TieredStore:
    """Drop-in store over [device | host | recompute] slot regions (one index set per layer).

    Built after prefill eviction from the layer's compacted dense store (see
    :meth:`from_dense`); never compacted again: evictions leave holes that later tokens fill.
    """

    compactable = False
    takes_parts = True

    def __init__(
        self,
        device: KVStore,
        host: KVStore | None,
        hidden: HiddenStore | None,
        recompute: Recompute | None,
        model_device: torch.device,
    ) -> None:
        self.device, self.host, self.hidden, self.recompute = device, host, hidden, recompute
        self.model_device = model_device
        self.fetched_bytes = 0  # host -> device traffic so far
        self.recomputed_tokens = 0
        self.prefetch_hits = 0
        self._prefetched = None  # (keys, values, event) of the host region, copied ahead
        self._stream = None  # CUDA side stream for the copies, created on first use
        self.takes_inputs = hidden is not None

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_dense(
        cls,
        dense: DenseStore,
        width: int,
        layout: TierLayout,
        *,
        region_factory: Callable[[torch.Tensor, torch.Tensor, int], KVStore],
        host_device: torch.device,
        hidden: torch.Tensor | None,
        rope: torch.Tensor | None,
        slot_positions: torch.Tensor,
        positions: torch.Tensor,
        recompute: Recompute | None,
    ) -> TieredStore:
        """Split the first ``width`` slots of a prefill store into the tiers of ``layout``.

        ``hidden``/``rope`` are the prompt's attention inputs (B, L, hidden) and RoPE positions
        (B, L); ``slot_positions`` (B, width) says which prompt token each slot holds, and
        ``positions`` is the layer's whole slot map (B, 1, capacity), for stores that need it.
        """
        keys, values = dense.read(positions)
        device_end = min(width, layout.device_slots)
        if layout.recompute:
            host_end = device_end + min(width - device_end, layout.host_slots)
        else:
            host_end = width
        device = region_factory(
            keys[:, :, :device_end], values[:, :, :device_end], layout.device_slots
        )
        host = None
        # Without recomputation the host region takes all overflow (and grows); keep one slot at
        # least so that it exists when the device region fills up later.
        host_capacity = (
            layout.host_slots
            if layout.recompute
            else max(layout.host_slots, host_end - device_end, 1)
        )
        if host_capacity:
            host_keys = keys[:, :, device_end:host_end].to(host_device)
            host_values = values[:, :, device_end:host_end].to(host_device)
            host = _pin_store(region_factory(host_keys, host_values, host_capacity))
        store_hidden = None
        if layout.recompute:
            batch = keys.shape[0]
            count = width - host_end
            store_hidden = HiddenStore(
                batch, max(count, 1), hidden.shape[-1], hidden.dtype, host_device
            )
            if count:
                take = slot_positions[:, host_end:width].clamp(min=0)
                rows = torch.arange(batch, device=take.device).view(-1, 1)
                store_hidden.write(
                    (slice(None), slice(0, count)), hidden[rows, take], rope[rows, take]
                )
        return cls(device, host, store_hidden, recompute, keys.device)

    # ---- the store interface ----------------------------------------------------------

    @property
    def regions(self) -> list[tuple[str, int]]:
        """(tier, slots) in slot order."""
        regions = [("device", self.device.capacity)]
        if self.host is not None:
            regions.append(("host", self.host.capacity))
        if self.hidden is not None:
            regions.append(("recompute", self.hidden.capacity))
        return regions

    @property
    def capacity(self) -> int:
        return sum(slots for _, slots in self.regions)

    def nbytes(self) -> int:
        return sum(self.tier_bytes().values())

    def tier_bytes(self) -> dict[str, int]:
        """Bytes held per tier (device KV, host KV, host hidden states for recomputation)."""
        return {
            "device": self.device.nbytes(),
            "host": self.host.nbytes() if self.host is not None else 0,
            "recompute": self.hidden.nbytes() if self.hidden is not None else 0,
        }

    def parts(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(K, V) per region on the model's device, in slot order."""
        offset, parts = 0, []
        for tier, slots in self.regions:
            region_positions = positions[..., offset : offset + slots]
            if tier == "device":
                parts.append(self.device.read(region_positions))
            elif tier == "host":
                parts.append(self._host_part(region_positions))
            else:
                hidden = self.hidden.hidden.to(self.model_device, non_blocking=True)
                rope = self.hidden.rope.to(self.model_device, non_blocking=True)
                self.recomputed_tokens += hidden.shape[0] * hidden.shape[1]
                parts.append(self.recompute(hidden, rope))
            offset += slots
        return parts

    def prefetch(self) -> None:
        """Start copying the host region to the device (a side stream on CUDA).

        Called while the previous layer computes: the next ``parts`` finds the copy ready. SWA's
        kept set for a step is fixed by the step before, so what the copy holds stays valid; the
        one token written in between is patched into the copy. Only plain (not quantized) host
        regions are prefetched; others are read when needed.
        """
        if self.host is None or not isinstance(self.host, DenseStore) or self._prefetched:
            return
        if self.model_device.type == "cuda":
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.model_device)
            stream = self._stream
            stream.wait_stream(torch.cuda.current_stream(self.model_device))
            with torch.cuda.stream(stream):
                keys, values = self._copy_host()
                event = torch.cuda.Event()
                event.record(stream)
        else:
            (keys, values), event = self._copy_host(), None
        self._prefetched = (keys, values, event)

    def _copy_host(self) -> tuple[torch.Tensor, torch.Tensor]:
        # A real copy even on CPU-only machines (where .to would be a no-op view): the host
        # pool is a separate tier, and the cost model prices this traffic.
        keys = self.host.keys.to(self.model_device, non_blocking=True, copy=True)
        values = self.host.values.to(self.model_device, non_blocking=True, copy=True)
        self.fetched_bytes += keys.nbytes + values.nbytes
        return keys, values

    def _host_part(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._prefetched is not None:
            keys, values, event = self._prefetched
            self._prefetched = None
            if event is not None:
                torch.cuda.current_stream(self.model_device).wait_event(event)
            self.prefetch_hits += 1
            return keys, values
        if isinstance(self.host, DenseStore):
            return self._copy_host()
        keys, values = self.host.read(positions.to(_device_of(self.host)))
        keys = keys.to(self.model_device, non_blocking=True, copy=True)
        values = values.to(self.model_device, non_blocking=True, copy=True)
        self.fetched_bytes += keys.nbytes + values.nbytes
        return keys, values

    def read(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        parts = self.parts(positions)
        return torch.cat([k for k, _ in parts], dim=2), torch.cat([v for _, v in parts], dim=2)

    def write_range(self, start, keys, values, position, hidden=None, rope=None) -> None:
        """Write (B, H_kv, q, D) tokens into slots [start, start + q), spanning regions."""
        offset = 0
        for tier, slots in self.regions:
            lo, hi = max(start, offset), min(start + keys.shape[2], offset + slots)
            if lo < hi:
                part = slice(lo - start, hi - start)
                if tier == "recompute":
                    self.hidden.write(
                        (slice(None), slice(lo - offset, hi - offset)),
                        hidden[:, part],
                        rope[:, part],
                    )
                else:
                    region = self.device if tier == "device" else self.host
                    target = _device_of(region)
                    if tier == "host" and self._prefetched is not None:
                        copied_keys, copied_values, _ = self._prefetched  # keep it in step
                        copied_keys[:, :, lo - offset : hi - offset] = keys[:, :, part]
                        copied_values[:, :, lo - offset : hi - offset] = values[:, :, part]
                    region.write_range(
                        lo - offset,
                        keys[:, :, part].to(target),
                        values[:, :, part].to(target),
                        position + part.start,
                    )
            offset += slots

    def write_slots(self, slots, keys, values, position, hidden=None, rope=None) -> None:
        """One token per sequence at ``slots`` (B, 1, 1), whichever region each slot is in."""
        flat = slots.view(-1)
        offset = 0
        for tier, size in self.regions:
            inside = (flat >= offset) & (flat < offset + size)
            rows = inside.nonzero(as_tuple=True)[0]
            if rows.numel():
                local = flat[rows] - offset
                if tier == "recompute":
                    self.hidden.write((rows, local), hidden[rows, 0], rope[rows, 0])
                else:
                    region = self.device if tier == "device" else self.host
                    target = _device_of(region)
                    if tier == "host" and self._prefetched is not None:
                        # Keep the copy in step: the same values go to its slots.
                        copied_keys, copied_values, _ = self._prefetched
                        copied_keys[rows, :, local] = keys[rows, :, 0].to(copied_keys.dtype)
                        copied_values[rows, :, local] = values[rows, :, 0].to(copied_values.dtype)
                    region.write_entries(
                        rows.to(target),
                        local.to(target),
                        keys[rows, :, 0].to(target),
                        values[rows, :, 0].to(target),
                        position,
                    )
            offset += size

    def grow(self, capacity: int) -> None:
        """Extend the last region (appends land there)."""
        extra = capacity - self.capacity
        tier, slots = self.regions[-1]
        self._prefetched = None
        if tier == "recompute":
            self.hidden.grow(slots + extra)
        elif tier == "host":
            self.host.grow(slots + extra)
        else:
            raise ValueError(
                "the device tier is full and no host tier was configured (set host_memory)"
            )

    def reindex(self, index: torch.Tensor, capacity: int) -> None:
        raise NotImplementedError("tiered stores are not compacted; holes are reused")

    def select_batch(self, indices: torch.Tensor) -> None:
        self._prefetched = None
        self.device.select_batch(indices)
        if self.host is not None:
            self.host.select_batch(indices.to(_device_of(self.host)))
        if self.hidden is not None:
            self.hidden.select_batch(indices)


def _device_of(store: KVStore) -> torch.device:
    buffer = store.codes.data if hasattr(store, "codes") else store.keys
    return buffer.device


def _pin_store(store: KVStore) -> KVStore:
    """Page-locked host buffers when CUDA is present, so host-to-device copies run async."""
    if not torch.cuda.is_available():
        return store
    for name, value in vars(store).items():
        if isinstance(value, torch.Tensor) and value.device.type == "cpu":
            setattr(store, name, value.pin_memory())
        elif hasattr(value, "tensors"):  # quantized buffers: codes, scales, zero points
            value.replace(tuple(t.pin_memory() for t in value.tensors()))
    return store
