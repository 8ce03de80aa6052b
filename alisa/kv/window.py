"""Sliding-window layers: the keeper that holds exactly what transformers' window lets attend.

A layer that transformers runs as ``sliding_attention`` with window W lets the query at position
p attend to positions (p - W, p] (``sliding_window_overlay``: W tokens, itself included), so its
own cache keeps the newest W - 1 (``DynamicSlidingWindowLayer``). :class:`WindowKeeper` keeps the
same tokens, in padded coordinates as transformers does: after every attention call, each
position at or below ``seen - W`` leaves. The layer's KV is therefore bounded by the window and no
KV policy is needed there; in a hybrid model (Gemma 2/3, GPT-OSS, Cohere2, ...) the caching ratio
applies to the full-attention layers only.
"""

from __future__ import annotations

import numpy as np
import torch

from alisa.kv.layer import Keeper
from alisa.kv.slots import SlotMap
from alisa.policies import KVPolicy
from alisa.storage.store import KVStore


class WindowKeeper(Keeper):
    """Keeps the newest ``window - 1`` positions of every sequence (HF's sliding window).

    Parameters
    ----------
    policy
        The layer's policy (a dense one: the window, not a budget, bounds the layer).
    window
        W, the model's ``sliding_window`` for this layer.
    """

    def __init__(self, policy: KVPolicy, window: int) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window={window!r} must be an integer >= 1")
        super().__init__(policy)
        self.window = window
        # Positions below this have left (padded coordinates, shared by every sequence, so it
        # survives batch selection).
        self.cutoff = 0

    @property
    def frees_slots(self) -> bool:
        return True

    def after_attention(
        self,
        slots: SlotMap,
        store: KVStore,
        query: torch.Tensor,
        probabilities: torch.Tensor | None,
        *,
        prefilling: bool,
    ) -> None:
        """Free every slot whose position the next query's window no longer reaches."""
        if self.pack is not None and not prefilling:  # a static step: counted in plan_step
            # The token written sits at pack.position(); seen is one more.
            slots.free_before(self.pack.position() + 2 - self.window, None)
            return
        leaving = self._leaving(slots)
        if leaving is not None:
            slots.free_before(self.cutoff, leaving)

    def _leaving(self, slots: SlotMap) -> np.ndarray | None:
        """Move the cutoff to where the next query's window starts; (B,) real tokens of each
        sequence it passed (padding is not counted: it sits in PAD slots until compaction),
        known on the host without a sync; None when it did not move."""
        cutoff = slots.seen - self.window + 1
        if cutoff <= self.cutoff:
            return None
        leaving = np.maximum(cutoff - np.maximum(self.cutoff, slots.first), 0)
        self.evicted += int(leaving.sum()) * slots.groups
        self.cutoff = cutoff
        return leaving

    def static_slots(self, max_len: int) -> int:
        """The window: W - 1 tokens kept and the new one (fewer for shorter contexts)."""
        return min(self.window, max_len)

    def plan_step(self, slots: SlotMap) -> None:
        """Count on the host the tokens the step's window leaves behind."""
        leaving = self._leaving(slots)
        if leaving is not None:
            slots.release(leaving)

    def shift_positions(self, delta: int, slots: SlotMap) -> None:
        self.cutoff = max(self.cutoff + delta, 0)

    def extend_rows(self, other: Keeper, slots: SlotMap, other_slots: SlotMap) -> None:
        """Append ``other``'s sequences. The earlier cutoff serves both: a sequence's real
        tokens start at its ``first``, and a batch that was shifted later to join has its
        cutoff at or below its sequences' ``first``, so no token is counted as leaving twice."""
        super().extend_rows(other, slots, other_slots)
        self.cutoff = min(self.cutoff, other.cutoff)

    def reset(self) -> None:
        super().reset()
        self.cutoff = 0
