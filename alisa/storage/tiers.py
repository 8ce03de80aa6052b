"""KV split over tiers (ALISA phases II/III): resident, host-offloaded and recomputed slots.

One layer's slots are laid out as an ordered list of regions (see :mod:`alisa.storage.regions`),
for example [device | host | recompute]. The device region is bounded by the byte budget; the
host region holds KV in host memory (pinned when CUDA is present); the recompute region keeps
only the attention inputs (hidden states) and RoPE position and rebuilds K/V with the layer's own
projections. Attention reads the regions as parts: one layer's host and recomputed KV are on the
device only while that layer runs, so the device holds resident KV plus one layer. Every tier
keeps every token exactly: offload and recompute are lossless.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from alisa.storage.regions import (
    DeviceRegion,
    HostRegion,
    RecomputeRegion,
    Region,
    RegionContext,
    TierStats,
)
from alisa.storage.store import Part, TokenInputs


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

    def regions(self) -> list[tuple[type[Region], int]]:
        """(region class, slots) in slot order; the last region takes all overflow and grows."""
        if not self.recompute:
            return [(DeviceRegion, self.device_slots), (HostRegion, self.host_slots)]
        host = [(HostRegion, self.host_slots)] if self.host_slots else []
        return [(DeviceRegion, self.device_slots), *host, (RecomputeRegion, 0)]


class TieredStore:
    """A :class:`~alisa.storage.store.KVStore` over an ordered list of regions.

    Built after prefill eviction from the layer's compacted store (see :func:`split_prefill`);
    never compacted again: evictions leave holes that later tokens fill.
    """

    compactable = False
    lossless = False  # a read may rebuild K/V (recompute) and needs the slot map

    def __init__(self, regions: list[Region], model_device: torch.device, stats: TierStats):
        self._regions = regions
        self.model_device = model_device
        self.stats = stats
        self.needs_inputs = any(region.needs_inputs for region in regions)
        self._width: int | None = None  # the slot map's width at the last parts() (prefetch)

    # ---- traffic counters ---------------------------------------------------------------

    @property
    def fetched_bytes(self) -> int:
        return self.stats.fetched_bytes

    @property
    def recomputed_tokens(self) -> int:
        return self.stats.recomputed_tokens

    @property
    def prefetch_hits(self) -> int:
        return self.stats.prefetch_hits

    # ---- the store interface ------------------------------------------------------------

    @property
    def regions(self) -> list[tuple[str, int]]:
        """(tier, slots) in slot order."""
        return [(region.tier, region.slots) for region in self._regions]

    @property
    def capacity(self) -> int:
        return sum(region.slots for region in self._regions)

    @property
    def device(self) -> torch.device:
        return self.model_device

    def nbytes(self) -> int:
        return sum(region.nbytes() for region in self._regions)

    def static_buffers(self) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError("a tiered store has no static decode step (its regions move)")

    def fetch_static(self, region, region_level, placement, anchor) -> None:
        raise NotImplementedError("a tiered store has no static decode step (its regions move)")

    def tier_bytes(self) -> dict[str, int]:
        """Bytes held per tier (device KV, host KV, host hidden states for recomputation)."""
        totals: dict[str, int] = {}
        for region in self._regions:
            totals[region.tier] = totals.get(region.tier, 0) + region.nbytes()
        return totals

    def parts(
        self, positions: torch.Tensor, query: torch.Tensor | None = None, width: int | None = None
    ) -> list[Part]:
        """(K, V, positions) per region on the model's device, in slot order.

        With the slot map's ``width``, a host region copies and a recompute region rebuilds only
        its slots below it, not the spare ones its growth allocated (a recompute region's
        capacity was 1.23x its tokens at B = 8 x 1,024); a region wholly past it holds nothing
        and is left out. The width is kept for :meth:`prefetch`.
        """
        self._width = width
        parts = []
        for region, span in self._spans():
            used = _used(span, width)
            if used <= 0 and parts:
                continue
            keys, values = region.read(positions[..., span], used)
            read = slice(span.start, span.start + keys.shape[2])
            parts.append(Part(keys, values, positions[..., read]))
        return parts

    def read(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        parts = self.parts(positions)
        return torch.cat([p.keys for p in parts], dim=2), torch.cat([p.values for p in parts], 2)

    def write_range(
        self, start: int, keys, values, position: int, inputs: TokenInputs | None = None
    ) -> None:
        """Write (B, H_kv, q, D) tokens into slots [start, start + q), spanning regions."""
        for region, span in self._spans():
            lo, hi = max(start, span.start), min(start + keys.shape[2], span.stop)
            if lo < hi:
                part = slice(lo - start, hi - start)
                region.write_range(
                    lo - span.start,
                    keys[:, :, part],
                    values[:, :, part],
                    position + part.start,
                    inputs.span(part) if region.needs_inputs else None,
                )

    def write_slots(
        self, slots, keys, values, position: int, inputs: TokenInputs | None = None
    ) -> None:
        """One token per sequence at ``slots`` (B, 1, 1), whichever region each slot is in."""
        rows = torch.arange(slots.shape[0], device=slots.device)
        self.write_entries(rows, slots.view(-1), keys[:, :, 0], values[:, :, 0], position, inputs)

    def write_entries(
        self, rows, slots, keys, values, position: int, inputs: TokenInputs | None = None
    ) -> None:
        """One token for some sequences: rows, slots (E,), keys/values (E, H_kv, D), inputs
        (E, 1, ...) when a region recomputes."""
        for region, span in self._spans():
            inside = ((slots >= span.start) & (slots < span.stop)).nonzero(as_tuple=True)[0]
            if inside.numel():
                region.write_entries(
                    rows[inside],
                    slots[inside] - span.start,
                    keys[inside],
                    values[inside],
                    position,
                    inputs.rows(inside) if region.needs_inputs else None,
                )

    def write_heads(self, rows, heads, slots, tokens) -> None:
        """Tiers hold one index set per layer; per-head writes come only from
        ``retention="host"``, which the configuration keeps apart from tiers."""
        raise ValueError("retention='host' cannot be combined with gpu_memory tiers")

    def plain_heads(self) -> None:
        """Regions, not one buffer (and host retention does not combine with tiers)."""
        return None

    def attend(self, positions, query, seen: int, window, scaling: float) -> None:
        """Regions read part by part: attention reads :meth:`parts`."""
        return None

    def grow(self, capacity: int) -> None:
        """Extend the last region (appends land there)."""
        last = self._regions[-1]
        last.grow(last.slots + capacity - self.capacity)

    def reindex(self, index: torch.Tensor, capacity: int) -> None:
        raise NotImplementedError("tiered stores are not compacted; holes are reused")

    def extend_rows(self, other: TieredStore) -> None:
        """Tiers are laid out per batch (region sizes from one plan): rows cannot join."""
        raise ValueError("gpu_memory tiers cannot take rows into a running batch")

    def shift_positions(self, delta: int) -> None:
        """Recompute regions keep RoPE positions as written: rows cannot move in time."""
        raise ValueError("gpu_memory tiers cannot take rows into a running batch")

    def select_batch(self, indices: torch.Tensor) -> None:
        for region in self._regions:
            region.select_batch(indices)

    def prefetch(self) -> None:
        """Start copying what the next read needs (called while the previous layer runs): up
        to one slot past the width of the last read, since a decode step places one token, at
        the frontier or in a hole below it."""
        width = None if self._width is None else self._width + 1
        for region, span in self._spans():
            region.prefetch(_used(span, width))

    def pin_memory(self) -> None:
        """Host regions are page-locked when built."""

    def pinned(self) -> bool:
        """Whether every host region's buffers are page-locked (on CUDA they must be)."""
        return all(region.pinned() for region in self._regions)

    def _spans(self):
        offset = 0
        for region in self._regions:
            yield region, slice(offset, offset + region.slots)
            offset += region.slots


def _used(span: slice, width: int | None) -> int:
    """How many of a region's slots (``span`` of the layer's) lie below ``width`` (None: all)."""
    if width is None:
        return span.stop - span.start
    return min(span.stop, width) - span.start


def split_prefill(
    keys: torch.Tensor,
    values: torch.Tensor,
    inputs: Callable[[slice], TokenInputs] | None,
    layout: TierLayout,
    context: RegionContext,
) -> tuple[TieredStore, list[int]]:
    """Split a layer's first W kept slots over the regions of ``layout``.

    Parameters
    ----------
    keys, values
        (B, H_kv, W, D) the compacted prefill slots, in slot order.
    inputs
        Attention inputs and RoPE positions of a span of those slots, gathered only for regions
        that recompute (None: no prompt inputs were kept).

    Returns
    -------
    tuple
        The store and how many of the W slots each region took (in order).
    """
    width = keys.shape[2]
    regions, counts, start = [], [], 0
    specs = layout.regions()
    for index, (region_class, slots) in enumerate(specs):
        rest = width - start
        last = index == len(specs) - 1
        count = rest if last else min(rest, slots)
        # The last region takes all overflow (and grows later); keep one slot at least so that
        # it exists when the regions before it fill up.
        capacity = max(slots, count, 1) if last else slots
        span = slice(start, start + count)
        region_inputs = inputs(span) if region_class.needs_inputs else None
        regions.append(
            region_class.build(
                keys[:, :, span], values[:, :, span], region_inputs, capacity, context
            )
        )
        counts.append(count)
        start += count
    return TieredStore(regions, context.model_device, context.stats), counts
