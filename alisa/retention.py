"""``retention="host"``: nothing is lost; each decode step attends to the best tokens per KV head.

ALISA's phase II keeps the KV of tokens that are not cached on the device in host memory and
brings the selected ones back each step (https://arxiv.org/abs/2403.17312, §IV; Quest, InfiniGen
and ShadowKV select per head from a complete store the same way). Here every token of a layer is
written once to the host region (:class:`~alisa.storage.pages.HostPages`) and coded into a 4-bit
key sketch on the device (:class:`~alisa.storage.sketch.KeySketch`). Before attention, per
sequence and KV head:

1. the budget is the policy's (``round(n*r)``, at least ``min_budget_tokens``, sinks covered);
2. the policy's protections (sinks, its recent window, the new token) are always chosen, the rest
   of the budget goes to the highest ``q . k_hat`` (max over the KV head's query heads);
3. the device slots become exactly that set: slots whose token was not chosen are freed, chosen
   tokens the device does not hold are fetched from the host region (only those rows are read and
   dequantized) into freed slots.

Attention then runs exactly (one softmax) over the device slots. Tokens written at this step stay
in full precision on the device until a selection first leaves them out, so with a budget that is
never reached nothing ever moves and the output is that of dense attention.
"""

from __future__ import annotations

import numpy as np
import torch

from alisa.policies import KVPolicy
from alisa.slots import FREE, SlotMap
from alisa.storage.pages import HostPages
from alisa.storage.sketch import KeySketch
from alisa.storage.store import KVStore


class HostRetention:
    """The host region, the key sketch and the per-step selection of one layer.

    Parameters
    ----------
    host_bits
        Precision of the host region: 16 (model dtype), 8 or 4.
    sink_tokens
        The policy's sinks: always attended, so they do not shape the key sketch.
    """

    def __init__(self, host_bits: int, sink_tokens: int) -> None:
        self.host_bits = host_bits
        self.sinks = sink_tokens
        self.reset()

    def reset(self) -> None:
        self.pages: HostPages | None = None
        self.sketch: KeySketch | None = None
        self.fetched = 0  # tokens copied host -> device, all sequences and KV heads
        self.steps = 0  # decode steps that selected (budget below the tokens seen)

    # ---- writes --------------------------------------------------------------------------

    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor, slots: SlotMap) -> None:
        """Keep (B, H_kv, m, D) new tokens at positions [start, start + m) in both regions.

        Sinks and padding (known from ``slots``) are coded but do not widen the sketch's range.
        """
        batch, heads, length, head_dim = keys.shape
        if self.pages is None:
            self.pages = HostPages(
                batch, heads, head_dim, bits=self.host_bits, dtype=keys.dtype, device=keys.device
            )
            self.sketch = KeySketch(batch, heads, head_dim, start + length, keys.device)
        self.pages.write(start, keys, values)
        counted = None
        if self.sketch.widens(start):
            positions = torch.arange(start, start + length, device=keys.device)
            counted = self._counted(positions, slots)
        self.sketch.write(start, keys, counted)

    def _counted(self, positions: torch.Tensor, slots: SlotMap) -> torch.Tensor:
        """(B, m) whether each position is a real, non-sink token (it may shape the sketch)."""
        first = torch.as_tensor(slots.first, device=positions.device).view(-1, 1)
        return positions.view(1, -1) >= first + self.sinks

    # ---- the step -------------------------------------------------------------------------

    def select(self, slots: SlotMap, store: KVStore, policy: KVPolicy, query: torch.Tensor) -> None:
        """Make each (sequence, KV head)'s device slots exactly this step's chosen tokens.

        Parameters
        ----------
        slots
            The layer's slot map (groups = KV heads); the new token is already placed.
        store
            The device region; fetched tokens are written with ``write_heads``.
        policy
            Budget and protections.
        query
            (B, H, 1, D) this step's query.
        """
        lengths = slots.lengths()
        budget = policy.budget(lengths)
        if (budget >= lengths).all():  # budgets only fall behind n: nothing has left yet
            return
        batch, kv_heads = slots.positions.shape[:2]
        grouped = query[:, :, -1].reshape(batch, kv_heads, -1, query.shape[-1])
        wanted = self._choose(slots, policy, budget, grouped)
        self._swap(slots, store, wanted)
        slots.kept = budget.copy()
        self.steps += 1

    def _choose(
        self, slots: SlotMap, policy: KVPolicy, budget: np.ndarray, query: torch.Tensor
    ) -> torch.Tensor:
        """(B, H_kv, seen) bool: protected tokens first, then the best estimated logits."""
        seen, device = slots.seen, query.device
        score = self.sketch.scores(query, seen)  # (B, H_kv, seen)
        positions = torch.arange(seen, device=device).view(1, -1)
        first = torch.as_tensor(slots.first, device=device).view(-1, 1)
        recent = np.maximum(policy.recent(budget), 1)  # the new token is always attended
        newest = positions >= torch.as_tensor(seen - recent, device=device).view(-1, 1)
        protected = (positions - first < policy.sink_tokens) | newest
        priority = torch.where(protected.unsqueeze(1), torch.inf, score)
        priority = priority.masked_fill((positions < first).unsqueeze(1), -torch.inf)
        count = int(budget.max())
        # Rows with smaller budgets take the first of the ranked tokens: only then sort.
        ranked = bool((budget != count).any())
        top = torch.topk(priority, count, dim=-1, sorted=ranked).indices  # (B, H_kv, count)
        in_budget = torch.arange(count, device=device).view(1, 1, -1) < torch.as_tensor(
            budget, device=device
        ).view(-1, 1, 1)
        wanted = torch.zeros_like(priority, dtype=torch.bool)
        return wanted.scatter_(-1, top, in_budget.expand_as(top))

    def _swap(self, slots: SlotMap, store: KVStore, wanted: torch.Tensor) -> None:
        """Free slots of tokens not wanted; fetch wanted tokens not held into free slots."""
        positions = slots.positions  # (B, H_kv, capacity)
        seen = wanted.shape[-1]
        held = positions >= 0
        index = torch.where(held, positions, seen)  # an extra column catches empty slots
        holding = torch.zeros(*wanted.shape[:2], seen + 1, dtype=torch.bool, device=wanted.device)
        holding.scatter_(-1, index, held)
        leaving = held & ~wanted.gather(-1, positions.clamp(min=0))
        fetch = wanted & ~holding[..., :seen]
        free = (positions == FREE) | leaving
        positions.masked_fill_(leaving, FREE)
        rows, heads, tokens = fetch.nonzero(as_tuple=True)
        if rows.numel() == 0:
            return
        # The j-th fetched token of a (sequence, head) goes to its j-th free slot, lowest first:
        # free_slot[b, h, j] is that slot (an extra column takes the occupied ones).
        capacity = positions.shape[-1]
        free_rank = torch.where(free, free.cumsum(-1) - 1, capacity)
        free_slot = torch.empty(*free.shape[:2], capacity + 1, dtype=torch.long, device=free.device)
        free_slot.scatter_(
            -1, free_rank, torch.arange(capacity, device=free.device).expand_as(free_rank)
        )
        counts = fetch.sum(-1).flatten()
        starts = torch.cumsum(counts, 0) - counts
        rank = (
            torch.arange(rows.numel(), device=rows.device) - starts[rows * fetch.shape[1] + heads]
        )
        target = free_slot[rows, heads, rank]
        keys, values = self.pages.fetch(rows, heads, tokens)
        store.write_heads(rows, heads, target, keys, values)
        positions[rows, heads, target] = tokens
        slots.width = max(slots.width, int(target.max()) + 1)
        self.fetched += int(rows.numel())

    # ---- bookkeeping ----------------------------------------------------------------------

    def tier_bytes(self) -> dict[str, int]:
        """Bytes per tier: the sketch counts on the device, the pages on the host."""
        if self.pages is None:
            return {"device": 0, "host": 0}
        return {"device": self.sketch.nbytes(), "host": self.pages.nbytes()}

    def select_batch(self, indices: torch.Tensor) -> None:
        if self.pages is not None:
            self.pages.select_batch(indices)
            self.sketch.select_batch(indices)
