"""What a cache layer needs from storage tiers: the split protocol, and the attention inputs a
recompute tier rebuilds K/V from (ALISA's phase III, https://arxiv.org/abs/2403.17312, §V)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch

from alisa.kv.slots import SlotMap
from alisa.storage.store import KVStore, TokenInputs


class Tiering(Protocol):
    """Splits a layer's prefill over storage tiers (:class:`~alisa.planning.tiers.TierPlanner`)."""

    keeps_inputs: bool  # whether layers must keep their attention inputs (recompute tier)

    def split(
        self,
        layer_idx: int,
        store: KVStore,
        slots: SlotMap,
        inputs: Callable[[slice], TokenInputs] | None,
    ) -> tuple[KVStore, torch.Tensor, int]:
        """The tiered store, for each new slot the old slot it holds (-1: none), the new width."""
        ...

    def after_step(self, layer_idx: int) -> None:
        """A layer finished its decode step (start copying what the next layer needs)."""
        ...


class CallInputs(NamedTuple):
    """One attention call's input (B, q, hidden) and RoPE positions (B, q) or None (HF's
    default ``arange``)."""

    hidden: torch.Tensor
    rope: torch.Tensor | None

    def tokens(self, start: int, length: int) -> TokenInputs:
        """Inputs of the call's ``length`` new tokens, the first at position ``start``."""
        return TokenInputs(self.hidden, self._positions(start, length))

    def gatherer(self, slot_positions: torch.Tensor, seen: int) -> Callable[[slice], TokenInputs]:
        """Inputs of a span of slots of a prefill of ``seen`` tokens, gathered lazily;
        ``slot_positions`` (B, S) is the position each slot holds (negative: none)."""
        rope = self._positions(0, seen)
        rows = torch.arange(self.hidden.shape[0], device=self.hidden.device).view(-1, 1)

        def gather(span: slice) -> TokenInputs:
            take = slot_positions[:, span].clamp(min=0)
            return TokenInputs(self.hidden[rows, take], rope[rows, take])

        return gather

    def _positions(self, start: int, length: int) -> torch.Tensor:
        rope = self.rope
        if rope is None:
            rope = torch.arange(start, start + length, device=self.hidden.device)
        return rope.expand(self.hidden.shape[0], -1)
