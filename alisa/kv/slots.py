"""Which token sits in which slot of one cache layer: positions, free slots, compaction.

Slots are preallocated. A decode step writes its token into a slot freed by an earlier eviction
(or appends at the frontier), so the per-step cost never copies the cache; the buffers are
compacted only when much of them is empty (after prefill eviction, or a long shrink), an
amortised copy.

Coordinates: ``seen`` counts tokens of the padded batch (left padding included), so a token's
position is its index in the padded sequence, the same for every sequence of the batch. A
sequence that joins a running batch (continuous batching) is placed in these coordinates as if it
had been left-padded: :meth:`SlotMap.shift` moves its positions so that its newest token is the
batch's newest, and :meth:`SlotMap.extend_rows` appends its rows. The padding is virtual (no slot
holds it; ``first`` records it), so joining costs an integer add, not a copy of the running rows.
"""

from __future__ import annotations

import numpy as np
import torch

from alisa.ops import cpu
from alisa.ops.reference import FREE, put_taken  # FREE: slot holds nothing; may be reused
from alisa.ops.transfer import upload
from alisa.storage.store import headroom


def first_free(positions: torch.Tensor, width: int) -> torch.Tensor:
    """The first empty slot below ``width`` of every (sequence, group) of (B, Hs, S)
    ``positions``: (B, Hs, 1) int64, ``width`` where a row has none (the frontier).

    A minimum over slot numbers, not an ``argmax`` over a 0/1 mask: inductor's CUDA argmax of
    an int8 mask gave indices past the row at Llama-3.1-8B shapes (docs/gpu.md, seventh run),
    and a minimum has one answer whatever the reduction's split.
    """
    return first_slot(positions[..., :width] == FREE)


def first_slot(where: torch.Tensor) -> torch.Tensor:
    """The first slot of every (sequence, group) of a (B, Hs, S) bool ``where`` that is True:
    (B, Hs, 1) int64, S where none is (a minimum over slot numbers: see :func:`first_free`)."""
    slots = torch.arange(where.shape[-1], device=where.device)
    return torch.where(where, slots, where.shape[-1]).amin(dim=-1, keepdim=True)


PAD = -2  # slot holds a left-padding token; masked, reclaimed at the next compaction


def grown(slots: int, limit: int | None = None) -> int:
    """Capacity to allocate for ``slots``: the growth rule's headroom, but none past ``limit``
    (a sliding layer never holds more than its window) while ``slots`` fits under it."""
    capacity = slots + headroom(slots)
    if limit is not None and slots < limit:
        capacity = min(capacity, limit)
    return capacity


class SlotMap:
    """Slot positions (B, Hs, capacity) and per-sequence counts of one layer.

    Parameters
    ----------
    batch, groups
        Sequences and selection groups (1, or H_kv when selecting per KV head).
    length
        Prefill tokens, in slots [0, length).
    capacity
        Slots allocated.
    device
        Where the position map lives (the model's device).
    compiled
        Claim a decode step's slots by the compiled CPU kernel (:func:`alisa.ops.cpu.place_one`);
        False: PyTorch operators (the reference).
    """

    def __init__(
        self,
        batch: int,
        groups: int,
        length: int,
        capacity: int,
        device: torch.device,
        *,
        compiled: bool = False,
    ) -> None:
        positions = torch.arange(capacity, device=device)
        positions = torch.where(positions < length, positions, FREE)
        self.positions = positions.expand(batch, groups, capacity).contiguous()
        self.device = device
        self.compiled = compiled
        self.seen = length  # tokens seen (padded coordinates)
        self.width = length  # slots [0, width) may be occupied; the rest are free
        self.first = np.zeros(batch, dtype=np.int64)  # (B,) position of the first real token
        self.kept = np.full(batch, length, dtype=np.int64)  # (B,) tokens stored (per group)
        self.dead = np.zeros(batch, dtype=np.int64)  # (B,) padding slots still held

    @property
    def capacity(self) -> int:
        return self.positions.shape[-1]

    @property
    def batch(self) -> int:
        return self.positions.shape[0]

    @property
    def groups(self) -> int:
        return self.positions.shape[1]

    def lengths(self) -> np.ndarray:
        """(B,) real tokens seen per sequence (what budgets are computed from)."""
        return self.seen - self.first

    def mark_padding(self, valid: torch.Tensor) -> None:
        """Flag left-padding slots of the prefill; valid is (B, q) bool over the prefill tokens."""
        if bool(valid.all()):
            return
        length = valid.shape[1]
        pads = (~valid).to(self.device)
        region = self.positions[..., self.width - length : self.width]
        region.masked_fill_(pads.unsqueeze(1), PAD)
        counts = pads.sum(dim=1).cpu().numpy().astype(np.int64)
        self.dead += counts
        self.kept -= counts
        # Left padding: a sequence's first real token follows its pads.
        self.first = self.first + counts

    def appends(self) -> np.ndarray:
        """(B,) whether each sequence's next token goes to the frontier (no hole below width)."""
        return self.width - self.kept - self.dead <= 0

    def place_one(self, append: np.ndarray) -> int | torch.Tensor:
        """Claim one slot per sequence for the next token (capacity already ensured).

        Returns the frontier slot when every sequence appends (plain slice writes), else the
        (B, Hs, 1) slots: the first free one below width, or the frontier for appending rows.
        """
        grows = True  # some sequence appends at the frontier
        if append.all():
            placed: int | torch.Tensor = self.width
            self.positions[..., self.width] = self.seen
        elif self.compiled:
            # One compiled call, where each dispatched PyTorch op of the branch below costs more
            # than its work in a decode step (a host-retention step refills a slot per layer).
            slots = np.empty(self.positions.shape[:2], dtype=np.int64)
            grows = cpu.place_one(self.positions.numpy(), self.width, self.seen, append, slots)
            placed = torch.from_numpy(slots[..., None])
        else:
            appended = upload(append, self.device).view(-1, 1, 1)
            placed = torch.where(appended, self.width, first_free(self.positions, self.width))
            self.positions.scatter_(-1, placed, self.seen)
            grows = bool(append.any())
        if grows:
            self.width += 1
        self.seen += 1
        self.kept += 1
        return placed

    def place_range(self, length: int) -> int:
        """Claim slots [width, width + length) for ``length`` new tokens; returns the start."""
        start = self.width
        new = torch.arange(self.seen, self.seen + length, device=self.device)
        self.positions[..., start : start + length] = new
        # Sequences whose slots below width are not all used get holes: accounted as free.
        self.width += length
        self.seen += length
        self.kept += length
        return start

    def grow(self, capacity: int) -> None:
        """Extend to ``capacity`` slots, the new ones free."""
        extra = capacity - self.capacity
        self.positions = torch.nn.functional.pad(self.positions, (0, extra), value=FREE)

    def free(self, slots: torch.Tensor, taken: torch.Tensor | None, excess: np.ndarray) -> None:
        """Empty evicted slots: (B, Hs, k) distinct slots per row, ``taken`` (B, Hs, k) False
        past a sequence's ``excess`` (B,) tokens (those slots are left as they are; None:
        every sequence's excess is k).

        No host round trip (:func:`~alisa.ops.reference.put_taken`).
        """
        self.empty(slots, taken)
        self.release(excess)

    def free_before(self, cutoff: int | torch.Tensor, leaving: np.ndarray | None) -> None:
        """Empty every slot holding a position below ``cutoff`` (an int, or a (1,) device
        tensor in a static step); ``leaving`` (B,) is how many real tokens that is per
        sequence (per group), None where the host counted them already (:meth:`release`)."""
        held = self.positions >= 0
        self.positions.masked_fill_(held & (self.positions < cutoff), FREE)
        if leaving is not None:
            self.release(leaving)

    def empty(self, slots: torch.Tensor, taken: torch.Tensor | None) -> None:
        """The device half of :meth:`free`: mark the ``taken`` slots of (B, Hs, k) empty."""
        put_taken(self.positions, slots, taken, FREE)

    def release(self, leaving: np.ndarray) -> None:
        """The host half of :meth:`free`: (B,) tokens per sequence (per group) leave."""
        self.kept -= leaving

    # ---- a static step (:mod:`alisa.kv.static`): the host counts, the device places ----

    def advance(self) -> None:
        """Count a static decode step's token on the host (the device places it:
        :meth:`claim_free`), before the step's numbers are computed from the lengths."""
        self.seen += 1
        self.kept += 1

    def claim_free(self, position: torch.Tensor) -> torch.Tensor:
        """The first empty slot of every (sequence, group) takes the token at ``position``
        ((1,) int64 on the device), found on the device: no host round trip, one shape.

        The slot the eager step picks too (:meth:`place_one`: the first free slot below the
        width, else the frontier, which is the first free slot). A static slot space always
        has one (:meth:`alisa.kv.layer.Keeper.static_slots`). Returns the (B, Hs, 1) slots.
        """
        slot = first_free(self.positions, self.capacity)
        self.positions.scatter_(-1, slot, position.view(1, 1, 1).expand(slot.shape))
        return slot

    def holding(self, position: torch.Tensor) -> torch.Tensor:
        """(B, Hs, 1) int64: the slot that holds ``position`` ((1,) int64 on the device) in
        every (sequence, group), found on the device (one every row holds: a step's token)."""
        return first_slot(self.positions == position.view(1, 1, 1))

    def settle(self, kept: np.ndarray) -> None:
        """After a selection made the slots its chosen positions (:mod:`alisa.ops.reference`):
        ``kept`` (B,) tokens per group, and the width bound."""
        self.kept = kept.copy()
        # A fetched token's slot at or past the old width means every free slot below it was
        # taken, so the slots below it are all occupied: it is below kept + dead. The bound needs
        # no read of the targets (a device round trip).
        self.width = max(self.width, int((self.kept + self.dead).max()))

    def compaction(
        self, limit: int | None = None, *, force: bool = False, capacity: int | None = None
    ) -> tuple[torch.Tensor, int] | None:
        """Move live slots to the front once over a third of width is empty (``force``: as
        soon as any slot below width is empty or the capacity exceeds the growth rule's).

        Returns (index, capacity): new slot j holds old slot index[b, g, j], for the store and
        the attention sums to follow; None when not worth a copy. ``limit``: slots the layer
        never needs more of (a sliding window), so no headroom past it. ``capacity``: the slot
        space to end with instead of the growth rule's (a static layer's, fixed).
        """
        live = int(self.kept.max(initial=0))  # compaction drops padding slots as well
        target = grown(live, limit) if capacity is None else capacity
        # A static step places its tokens on the device, in any free slot of the whole space,
        # and keeps no width bound on the host: all of it is read.
        width = self.width if capacity is None else self.capacity
        if force:
            if capacity is None:
                fits = self.capacity <= target
            else:  # a static space: its exact size, and no padding slot left (never reused)
                fits = self.capacity == target and not self.dead.any()
            if width == live and fits:
                return None
        elif width - live <= max(32, width // 3):
            return None
        occupied = self.positions[..., :width] >= 0
        order = torch.argsort((~occupied).to(torch.int8), dim=-1, stable=True)
        index = order[..., :live]
        capacity = target
        moved = self.positions.gather(-1, index)
        moved = torch.where(occupied.gather(-1, index), moved, FREE)
        self.positions = torch.nn.functional.pad(moved, (0, capacity - live), value=FREE)
        self.width = live
        self.dead[:] = 0
        return index, capacity

    def remap(self, mapping: torch.Tensor, width: int) -> torch.Tensor:
        """Slots moved to another layout: new slot j holds old slot mapping[j] (-1: none).

        Returns the (B, Hs, S') gather index used, for the attention sums to follow.
        """
        taken = mapping.clamp(min=0).view(1, 1, -1).expand(*self.positions.shape[:2], -1)
        moved = self.positions.gather(-1, taken)
        self.positions = torch.where(mapping >= 0, moved, FREE).contiguous()
        self.width = width
        return taken

    def shift(self, delta: int) -> None:
        """Move every sequence ``delta`` positions later (earlier when negative) in the padded
        coordinates: the same tokens, as if each had ``delta`` more (fewer) padding tokens on
        its left. Empty and padding slots keep their markers; lengths and budgets are unchanged.
        """
        self.positions = torch.where(self.positions >= 0, self.positions + delta, self.positions)
        self.seen += delta
        self.first = self.first + delta

    def extend_rows(self, other: SlotMap) -> None:
        """Append ``other``'s sequences after these (same ``seen``, groups and capacity)."""
        if (other.seen, other.groups, other.capacity) != (self.seen, self.groups, self.capacity):
            raise ValueError(
                f"slot maps of seen/groups/capacity {(other.seen, other.groups, other.capacity)} "
                f"and {(self.seen, self.groups, self.capacity)} cannot share a batch"
            )
        self.positions = torch.cat([self.positions, other.positions])
        self.width = max(self.width, other.width)
        self.first = np.concatenate([self.first, other.first])
        self.kept = np.concatenate([self.kept, other.kept])
        self.dead = np.concatenate([self.dead, other.dead])

    def select_batch(self, indices: torch.Tensor, host: np.ndarray) -> None:
        """Keep (and reorder) sequences; ``host`` is ``indices`` as a numpy array."""
        self.positions = self.positions.index_select(0, indices)
        self.first, self.kept, self.dead = self.first[host], self.kept[host], self.dead[host]

    def nbytes(self) -> int:
        return self.positions.nbytes

    def static_buffers(self) -> tuple[torch.Tensor, ...]:
        """The slot positions, which a static step claims and empties in place."""
        return (self.positions,)
