"""Attention received by each stored slot, summed over a sliding window of decode steps.

ALISA's "local attention sum" adds the attention rows of the last w steps (Alg. 1); H2O adds all
rows since the start. Keeping w full rows would cost w values per stored token. Instead we keep
one running total per slot and a small ring of snapshots of it, taken every ceil(w / blocks)
steps: total - snapshot(step - w) is the sum over the last w steps, rounded up to a whole
snapshot interval (exact when w <= blocks). Memory: (blocks + 3) values per slot.

A decayed accumulator keeps a soft window instead: each step multiplies the running totals by
1 - 1/w before adding the new row, so a row's weight fades with its age and all weights sum to w,
as a window of w steps does (A2SF's forgetting factor, https://arxiv.org/abs/2407.20485). One value
per slot, no snapshots.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from alisa.ops.reference import add_sums as reference_add_sums
from alisa.ops.reference import put_taken
from alisa.ops.transfer import upload

NO_STAMP = -(2**62)


class AttentionAccumulator:
    """Per-slot windowed attention sums for one cache layer.

    Parameters
    ----------
    batch, groups, capacity
        Shape (B, Hs, S) of the slot space: batch, selection groups (1 per layer, or one per KV
        head), stored slots.
    device
        Where the sums live (the cache's device).
    windowed
        False for whole-history sums (H2O): no snapshots are kept.
    decayed
        Exponentially faded sums with time constant w (not ``windowed``: no snapshots).
    blocks
        Snapshots per window; more is closer to exact, each costs one value per slot.
    add_sums
        How a decode step's row is added (:attr:`alisa.ops.backends.Ops.add_sums`: the cache's
        kernels; the PyTorch reference by default).
    """

    def __init__(
        self,
        batch: int,
        groups: int,
        capacity: int,
        device: torch.device,
        *,
        windowed: bool,
        decayed: bool = False,
        blocks: int = 8,
        add_sums: Callable[[torch.Tensor, torch.Tensor, np.ndarray | None, bool], None] = (
            reference_add_sums
        ),
    ) -> None:
        if windowed and decayed:
            raise ValueError("an accumulator is windowed or decayed, not both")
        self.blocks = blocks
        self.decayed = decayed
        self._add_sums = add_sums
        # A plain attribute, not the ring's length read off the tensor: a compiled step then
        # never touches an empty ring, whose strides (left by the slot space it was cut from)
        # would be guarded and recompile a step of the same shapes.
        self.windowed = windowed
        self.total = torch.zeros(batch, groups, capacity, dtype=torch.float32, device=device)
        ring = blocks + 2 if windowed else 0
        self.snapshots = torch.zeros(
            ring, batch, groups, capacity, dtype=torch.float32, device=device
        )
        # (B, ring) step of each snapshot, per sequence: a sequence that joins a running batch
        # brings its own history (see :meth:`extend_rows`).
        self.stamps = np.full((batch, ring), NO_STAMP, dtype=np.int64)
        self.step = 0
        self.last_snapshot = 0
        self.next_slot = 0

    def nbytes(self) -> int:
        """Bytes held by the running totals and snapshots."""
        return self.total.nbytes + self.snapshots.nbytes

    def static_buffers(self) -> tuple[torch.Tensor, ...]:
        """The totals and snapshots, which a static step adds to and clears in place."""
        return (self.total, self.snapshots) if self.windowed else (self.total,)

    def add(
        self, row: torch.Tensor, window: np.ndarray | None, *, head_max: bool | None = None
    ) -> None:
        """Add one step's attention row (B, Hs, S') over the first S' slots; with ``head_max``
        given, ``row`` is (B, Hs, G, S'), each group's G query heads to combine first (their
        max, or their sum in head order: :func:`alisa.ops.reference.combine_queries`)."""
        keep = self._keep(window).astype(np.float32) if self.decayed else None
        heads = row.unsqueeze(2) if head_max is None else row
        self._add_sums(self.total, heads, keep, bool(head_max))
        self._advance(1, window)

    def add_static(
        self, row: torch.Tensor, keep: torch.Tensor | None, snapshot: torch.Tensor
    ) -> None:
        """A static decode step's row (B, Hs, S) over every slot (:mod:`alisa.kv.static`):
        what :meth:`add` does on the device, with the host's numbers of the step
        (:meth:`count_step`): a decayed accumulator's (B,) float32 ``keep`` weights, and a
        windowed one's ``snapshot``, the (1,) ring slot that takes the new totals this step
        (-1: none)."""
        # In place by method: ``self.total += row`` would rebind the attribute, which a traced
        # step returns as an output (a CUDA graph's output buffer, rewritten by the next replay).
        if self.decayed:  # the weight itself, as add multiplies by it
            self.total.mul_(keep.view(-1, 1, 1))
        self.total.add_(row)
        if self.windowed:  # a masked copy: every step writes one ring slot, most write it back
            slot = snapshot.clamp(min=0)
            current = self.snapshots.index_select(0, slot)
            taken = torch.where(snapshot.view(1, 1, 1, 1) >= 0, self.total.unsqueeze(0), current)
            self.snapshots.index_copy_(0, slot, taken)

    def count_step(self, window: np.ndarray | None) -> int:
        """The host's half of :meth:`add_static`: one more step summed; returns the ring slot
        the step's totals go to (-1: no snapshot this step), its stamp recorded as
        :meth:`add` records it."""
        self.step += 1
        if self.windowed and self.step - self.last_snapshot >= self._interval(window):
            return self._stamp(self.step)
        return -1

    @staticmethod
    def keep_of(window: np.ndarray) -> np.ndarray:
        """(B,) float64 per-step keep weight 1 - 1/w of a decayed accumulator (the value
        :meth:`add` casts to float32)."""
        return 1.0 - 1.0 / np.maximum(window, 1)

    def add_rows(self, rows: torch.Tensor, window: np.ndarray | None) -> None:
        """Add several consecutive steps at once (prefill seeding): rows is (B, Hs, R, S')."""
        width = rows.shape[-1]
        if self.decayed:
            # Row i of R is R - 1 - i steps old once all are added.
            ages = torch.arange(rows.shape[2] - 1, -1, -1, device=rows.device)
            weights = self._fade(window, ages)  # (B, 1, R)
            self.total *= self._fade(window, rows.shape[2])
            self.total[..., :width] += (rows * weights.unsqueeze(-1)).sum(dim=2)
            self.step += rows.shape[2]
            return
        if not self.windowed:
            self.total[..., :width] += rows.sum(dim=2)
            self.step += rows.shape[2]
            return
        running = rows.cumsum(dim=2)  # (B, Hs, R, S'): totals after each row
        interval = self._interval(window)
        base = self.total[..., :width].clone()
        for index in range(rows.shape[2]):
            if (self.step + index + 1 - self.last_snapshot) >= interval:
                self._snapshot(base + running[:, :, index], self.step + index + 1, width)
        self.total[..., :width] = base + running[:, :, -1]
        self.step += rows.shape[2]

    def window_sum(self, window: np.ndarray | None, width: int) -> torch.Tensor:
        """(B, Hs, width) attention summed over each sequence's last ``window[b]`` steps."""
        total = self.total[..., :width]
        if window is None or not self.windowed:
            return total
        choice, has_snapshot = self.snapshot_choice(window)
        if not has_snapshot.any():
            return total
        device = total.device
        return self._less_snapshot(total, upload(choice, device), upload(has_snapshot, device))

    def snapshot_choice(self, window: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(B,) ring index of the snapshot each sequence's window sum subtracts, and (B,)
        whether it has one (host numbers: the stamps live on the host).

        For each sequence, the newest snapshot taken at least window[b] steps ago. With no such
        snapshot, either the history is shorter than the window (sum everything) or the ring
        has already recycled it (use the oldest snapshot: a slightly shorter window).
        """
        taken = self.stamps > NO_STAMP  # (B, ring)
        cutoff = self.step - window  # (B,)
        eligible = taken & (self.stamps <= cutoff[:, None])  # (B, ring)
        newest_eligible = np.where(eligible, self.stamps, NO_STAMP).argmax(axis=1)
        oldest = np.where(taken, self.stamps, np.iinfo(np.int64).max).argmin(axis=1)
        ring_full = taken.all(axis=1)
        has_snapshot = eligible.any(axis=1) | ring_full
        choice = np.where(eligible.any(axis=1), newest_eligible, oldest)
        return choice, has_snapshot

    def _less_snapshot(
        self, total: torch.Tensor, choice: torch.Tensor, has_snapshot: torch.Tensor
    ) -> torch.Tensor:
        """(B, Hs, width) ``total`` less each sequence's chosen snapshot, where it has one:
        (B,) ring indices and flags on the device."""
        batch = torch.arange(total.shape[0], device=total.device)
        older = self.snapshots[choice, batch, :, : total.shape[-1]]  # (B, Hs, width)
        return torch.where(has_snapshot.view(-1, 1, 1), total - older, total)

    def static_window_sum(self, choice: torch.Tensor, has_snapshot: torch.Tensor) -> torch.Tensor:
        """:meth:`window_sum` over every slot of a static step, the host's
        :meth:`snapshot_choice` given as (B,) device numbers."""
        if not self.windowed:
            return self.total
        return self._less_snapshot(self.total, choice, has_snapshot)

    def clear_slots(self, slots: torch.Tensor, taken: torch.Tensor | None) -> None:
        """Zero the sums of evicted slots so a reused slot starts afresh: (B, Hs, k) distinct
        slots per row, only where ``taken`` (a masked scatter: no host round trip; None: every
        entry)."""
        put_taken(self.total, slots, taken, 0.0)
        if self.windowed:
            ring = self.snapshots.shape[0]
            put_taken(
                self.snapshots,
                slots.expand(ring, *slots.shape),
                None if taken is None else taken.expand(ring, *taken.shape),
                0.0,
            )

    def reindex(self, index: torch.Tensor, vacated: torch.Tensor | None = None) -> None:
        """Move slots as the cache does: new slot j takes old slot index[b, h, j] (B, Hs, S').

        ``vacated`` (S',) bool: new slots that hold nothing, zeroed.
        """
        rows = torch.arange(index.shape[0], device=index.device).view(-1, 1, 1)
        groups = torch.arange(index.shape[1], device=index.device).view(1, -1, 1)
        self.total = self.total[rows, groups, index]
        if self.windowed:
            self.snapshots = self.snapshots[:, rows, groups, index]
        if vacated is not None:
            self.total.masked_fill_(vacated, 0.0)
            if self.windowed:
                self.snapshots.masked_fill_(vacated, 0.0)

    def grow(self, capacity: int) -> None:
        """Extend the slot space to ``capacity`` slots, new ones zero."""
        self.total = torch.nn.functional.pad(self.total, (0, capacity - self.total.shape[-1]))
        self.snapshots = torch.nn.functional.pad(
            self.snapshots, (0, capacity - self.snapshots.shape[-1])
        )

    def select_batch(self, indices: torch.Tensor) -> None:
        """Keep only some sequences (finished ones dropped, beams reordered)."""
        self.total = self.total.index_select(0, indices)
        self.snapshots = self.snapshots.index_select(1, indices)
        self.stamps = self.stamps[indices.cpu().numpy()]

    def extend_rows(self, other: AttentionAccumulator) -> None:
        """Append ``other``'s sequences (same kind, ring and slot space) after these.

        Whole-history and decayed sums simply concatenate. Windowed ones bring their snapshots:
        stamps move to this accumulator's step count and the ring rotates so that their oldest
        snapshot is the next one overwritten, as it would have been alone. Snapshots are then
        taken at this batch's cadence: exact while that is every step (windows up to
        ``blocks``), otherwise within one snapshot interval of the window, as always.
        """
        if (other.windowed, other.decayed, other.snapshots.shape[0]) != (
            self.windowed,
            self.decayed,
            self.snapshots.shape[0],
        ):
            raise ValueError("attention sums of different kinds cannot share a batch")
        rotation = self.next_slot - other.next_slot
        stamps = np.where(other.stamps > NO_STAMP, other.stamps + self.step - other.step, NO_STAMP)
        self.stamps = np.concatenate([self.stamps, np.roll(stamps, rotation, axis=1)])
        snapshots = torch.roll(other.snapshots, rotation, 0) if self.windowed else other.snapshots
        self.snapshots = torch.cat([self.snapshots, snapshots], dim=1)
        self.total = torch.cat([self.total, other.total])

    def _keep(self, window: np.ndarray | None) -> np.ndarray:
        """:meth:`keep_of` the window, refused without one."""
        if window is None:
            raise ValueError("a decayed accumulator needs the window w of each sequence")
        return self.keep_of(window)

    def _fade(self, window: np.ndarray | None, age: int | torch.Tensor) -> torch.Tensor:
        """(B, 1, A) weights (1 - 1/w[b]) ** age of rows ``age`` steps old (A = 1 for an int)."""
        keep = upload(self._keep(window), self.total.device, torch.float32)
        return _faded(keep, age)

    def _interval(self, window: np.ndarray | None) -> int:
        widest = int(window.max()) if window is not None and len(window) else 1
        return max(1, math.ceil(widest / self.blocks))

    def _advance(self, steps: int, window: np.ndarray | None) -> None:
        self.step += steps
        if self.windowed and self.step - self.last_snapshot >= self._interval(window):
            self._snapshot(self.total, self.step, self.total.shape[-1])

    def _snapshot(self, values: torch.Tensor, stamp: int, width: int) -> None:
        slot = self._stamp(stamp)
        self.snapshots[slot].zero_()
        self.snapshots[slot, ..., :width] = values[..., :width]

    def _stamp(self, stamp: int) -> int:
        """Record a snapshot at step ``stamp`` on the host; returns the ring slot it takes."""
        slot = self.next_slot
        self.stamps[:, slot] = stamp
        self.next_slot = (slot + 1) % self.snapshots.shape[0]
        self.last_snapshot = stamp
        return slot


def _faded(keep: torch.Tensor, age: int | torch.Tensor) -> torch.Tensor:
    """(B, 1, A) weights keep[b] ** age of rows ``age`` steps old (A = 1 for an int)."""
    if isinstance(age, int):  # filled on the device: nothing to copy
        age = torch.full((1,), age, device=keep.device)
    return keep.view(-1, 1, 1) ** age.reshape(1, 1, -1)
