"""The eviction decision of one cache layer: a KV policy plus the attention it has received.

Apart from the slot map (:mod:`alisa.slots`), which only records where tokens sit, this decides
which tokens go: per sequence, the excess over the policy's budget, lowest score first, with
sinks, the recent window and empty slots protected.
"""

from __future__ import annotations

import numpy as np
import torch

from alisa.accumulator import AttentionAccumulator
from alisa.policies import KVPolicy
from alisa.slots import SlotMap

# Neighbouring tokens pooled into the observation window's vote (SnapKV's kernel, as kvpress):
# a multi-token fact (a number, a name) is kept whole rather than its single loudest token.
OBSERVATION_POOL = 5


class Eviction:
    """A layer's policy and its attention sums (when the policy scores by attention).

    ``scored=False``: the layer selects tokens another way (``retention="host"``) and only uses
    the policy's budget and protections, so no attention is summed.
    """

    def __init__(self, policy: KVPolicy, *, scored: bool = True) -> None:
        self.policy = policy
        self.scored = scored
        self.scores: AttentionAccumulator | None = None

    @property
    def needs_attention(self) -> bool:
        """Whether attention probabilities must reach the policy (never when nothing is evicted)."""
        return self.scored and self.policy.needs_attention and self.policy.can_evict()

    def start(self, slots: SlotMap) -> None:
        """Fresh attention sums for a new slot map (prefill); none when not needed."""
        self.scores = None
        if self.needs_attention:
            window = self.policy.score_window(np.ones(len(slots.kept), dtype=np.int64))
            decayed = window is not None and self.policy.score_decay
            self.scores = AttentionAccumulator(
                len(slots.kept),
                slots.groups,
                slots.capacity,
                slots.device,
                windowed=window is not None and not decayed,
                decayed=decayed,
            )

    def budget(self, slots: SlotMap) -> np.ndarray:
        """(B,) tokens each sequence may keep."""
        return self.policy.budget(slots.lengths())

    def window(self, budget: np.ndarray) -> np.ndarray | None:
        """(B,) decode steps whose attention the policy sums, given the budgets; None: all."""
        return self.policy.score_window(self.policy.recent(budget))

    @property
    def observes(self) -> bool:
        """Whether the prompt's last queries seed the scores as one pooled vote (SnapKV)."""
        return self.needs_attention and self.policy.observation_window > 0

    def rows_wanted(self, slots: SlotMap) -> int | None:
        """Prompt query rows to seed attention scores with: None = all, 0 = none."""
        if not self.needs_attention:
            return 0
        if self.observes:
            return self.policy.observation_window
        window = self.window(self.budget(slots))
        return None if window is None else int(window.max())

    def combine_heads(
        self, probabilities: torch.Tensor, groups: int, *, vote: bool = False
    ) -> torch.Tensor:
        """(B, Hs, q, S') score rows from attention (B, H_kv, G, q, S'): the G query heads of a
        KV group summed (or, for decode steps, their max: ``head_max``), then every KV head
        summed when the layer selects one index set (``groups`` = 1). An observation ``vote``
        always sums its query heads, as SnapKV does.
        """
        largest = self.policy.head_max and not vote
        rows = probabilities.amax(dim=2) if largest else probabilities.sum(dim=2)
        return rows.sum(dim=1, keepdim=True) if groups == 1 else rows

    def account(self, rows: torch.Tensor, slots: SlotMap) -> None:
        """Add attention rows (B, Hs, R, S') of R consecutive queries over slots [0, S')."""
        if self.scores is None:
            return
        window = self.window(self.budget(slots))
        if rows.shape[2] == 1:
            self.scores.add(rows[:, :, 0], window)
        else:
            self.scores.add_rows(rows, window)

    def observe(self, vote: torch.Tensor, slots: SlotMap) -> None:
        """Seed the scores with the observation window's vote (B, Hs, S'): the attention of the
        last prompt queries summed, then averaged over neighbouring slots (prompt slots are in
        position order), added as one step.

        SnapKV, Li et al. 2024, https://arxiv.org/abs/2404.14469, §4.2.
        """
        if self.scores is None:
            return
        batch, groups, width = vote.shape
        pooled = torch.nn.functional.avg_pool1d(
            vote.reshape(batch * groups, 1, width),
            OBSERVATION_POOL,
            stride=1,
            padding=OBSERVATION_POOL // 2,
            count_include_pad=False,
        )
        self.scores.add(pooled.view(batch, groups, width), self.window(self.budget(slots)))

    def victims(self, slots: SlotMap):
        """Slots to evict now, as flat (rows, groups, slots) and the (B,) excess; None if none."""
        if not self.policy.can_evict():
            return None
        budget = self.budget(slots)
        excess = np.maximum(slots.kept - budget, 0)
        if excess.max(initial=0) <= 0:
            return None
        policy, device = self.policy, slots.device
        positions = slots.positions
        first = torch.as_tensor(slots.first, device=device)
        recent = torch.as_tensor(policy.recent(budget), device=device)
        attention = None
        if self.scores is not None:
            attention = self.scores.window_sum(self.window(budget), slots.capacity)
        score = policy.score(positions, attention, first).to(torch.float32)
        keep_first = policy.protected(positions, first, slots.seen, recent) | (positions < 0)
        priority = torch.where(keep_first, torch.inf, score)
        count = int(excess.max())
        chosen = torch.topk(priority, count, dim=-1, largest=False, sorted=True).indices
        wanted = torch.arange(count, device=device).view(1, 1, -1)
        valid = wanted < torch.as_tensor(excess, device=device).view(-1, 1, 1)
        # Every group (KV head, when selecting per head) of a sequence drops its excess.
        valid = valid.expand(-1, slots.groups, -1)
        rows, groups, ranks = valid.nonzero(as_tuple=True)
        return rows, groups, chosen[rows, groups, ranks], excess

    def forget(self, rows: torch.Tensor, groups: torch.Tensor, slots: torch.Tensor) -> None:
        """Zero the sums of emptied slots so a reused slot starts afresh."""
        if self.scores is not None:
            self.scores.clear_slots(rows, groups, slots)

    def reindex(self, index: torch.Tensor, capacity: int | None = None) -> None:
        """Follow the slot map: new slot j takes old slot index[b, g, j]; then grow."""
        if self.scores is not None:
            self.scores.reindex(index)
            if capacity is not None:
                self.scores.grow(capacity)

    def grow(self, capacity: int) -> None:
        if self.scores is not None:
            self.scores.grow(capacity)

    def select_batch(self, indices: torch.Tensor) -> None:
        if self.scores is not None:
            self.scores.select_batch(indices)

    def nbytes(self) -> int:
        return self.scores.nbytes() if self.scores is not None else 0
