"""Dropping: the keeper that evicts each sequence's excess tokens for good (ALISA's SWA, H2O, ...).

Per sequence, the excess over the policy's budget goes, lowest policy score first, with sinks,
the recent window and empty slots protected (:func:`alisa.ops.reference.evict`). Evicted tokens are
really gone: their slot is overwritten by the next token, and compaction returns the memory.
ALISA, https://arxiv.org/abs/2403.17312, Alg. 1.
"""

from __future__ import annotations

import numpy as np
import torch

from alisa.kv.accumulator import AttentionAccumulator
from alisa.kv.layer import Keeper
from alisa.kv.slots import SlotMap
from alisa.kv.static import StepPack
from alisa.ops.backends import Ops, choose_ops
from alisa.ops.reference import Eviction
from alisa.ops.transfer import upload
from alisa.storage.store import KVStore

# Neighbouring tokens pooled into the observation window's vote (SnapKV's kernel, as kvpress):
# a multi-token fact (a number, a name) is kept whole rather than its single loudest token.
OBSERVATION_POOL = 5
# A static step's numbers per sequence: excess, recent share, keep weight, first position,
# snapshot slot, snapshot subtracted and whether there is one (DropKeeper.reserve).
STATIC_FIELDS = 7


class DropKeeper(Keeper):
    """Keeps each sequence's budget of tokens and deletes the rest, by the policy's scores.

    An attention-scored policy (SWA, H2O, TOVA) gets the attention each slot received, summed
    over its score window (:class:`~alisa.kv.accumulator.AttentionAccumulator`).

    Parameters
    ----------
    policy, per_head
        As :class:`~alisa.kv.layer.Keeper` takes them.
    ops
        The kernels that add the sums and choose the victims
        (:func:`alisa.ops.backends.choose_ops`: the compiled CPU kernels on a CPU); None: the
        device's default, chosen at the prefill, when the device is known.
    """

    def __init__(self, policy, *, per_head: bool = False, ops: Ops | None = None) -> None:
        super().__init__(policy, per_head=per_head)
        self.ops_option = ops
        self.ops: Ops | None = None  # chosen at the prefill
        self.scores: AttentionAccumulator | None = None
        # Where this keeper's fields sit in a static cache's step pack (laid out for pack.rows).
        self._fields = 0

    @property
    def needs_attention(self) -> bool:
        """Whether attention probabilities must reach the policy (never when nothing is evicted)."""
        return self.policy.needs_attention and self.policy.can_evict()

    def start(self, slots: SlotMap, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Fresh attention sums for a new slot map (prefill); none when not needed."""
        self.ops = self.ops_option or choose_ops(keys.device, keys.dtype)
        self.ops.check_device(keys.device)
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
                add_sums=self.ops.add_sums,
            )

    @property
    def observes(self) -> bool:
        return self.needs_attention and self.policy.observation_window > 0

    def rows_wanted(self, slots: SlotMap) -> int | None:
        if not self.needs_attention:
            return 0
        if self.observes:
            return self.policy.observation_window
        window = self.steps_scored(slots)
        return None if window is None else int(window.max())

    def account(self, probabilities: torch.Tensor, slots: SlotMap, *, vote: bool = False) -> None:
        """Add attention probabilities (B, H_kv, G, q, S') over slots [0, S') to the sums.

        ``vote``: the q rows are the observation window's, summed and pooled into one step.
        Columns past the slot map (parts a store adds beyond its slots) are not slots: ignored.
        """
        if self.scores is None:
            return
        window = self.steps_scored(slots)
        heads = probabilities.shape[1]
        if not vote and probabilities.shape[3] == 1 and slots.groups == heads:
            # One decode step, a set per KV head: the sums' kernel combines the query heads.
            step = probabilities[:, :, :, 0, : slots.capacity]
            self.scores.add(step, window, head_max=self.policy.head_max)
            return
        rows = self.policy.combine_heads(
            probabilities[..., : slots.capacity], slots.groups, vote=vote
        )
        if vote:
            self._observe(rows.sum(dim=2), window)
        elif rows.shape[2] == 1:
            self.scores.add(rows[:, :, 0], window)
        else:
            self.scores.add_rows(rows, window)

    def _observe(self, vote: torch.Tensor, window: np.ndarray | None) -> None:
        """Seed the scores with the observation window's vote (B, Hs, S'): the attention of the
        last prompt queries summed, then averaged over neighbouring slots (prompt slots are in
        position order), added as one step.

        SnapKV, Li et al. 2024, https://arxiv.org/abs/2404.14469, §4.2.
        """
        batch, groups, width = vote.shape
        pooled = torch.nn.functional.avg_pool1d(
            vote.reshape(batch * groups, 1, width),
            OBSERVATION_POOL,
            stride=1,
            padding=OBSERVATION_POOL // 2,
            count_include_pad=False,
        )
        self.scores.add(pooled.view(batch, groups, width), window)

    def after_attention(
        self,
        slots: SlotMap,
        store: KVStore,
        query: torch.Tensor,
        probabilities: torch.Tensor | None,
        *,
        prefilling: bool,
    ) -> None:
        """Account this step's attention, then evict each sequence's excess."""
        if self.pack is not None and not prefilling:
            self._after_static(slots, probabilities)
            return
        if probabilities is not None:
            self.account(probabilities, slots)
        chosen = self.victims(slots)
        if chosen is None:
            return
        victims, taken, excess = chosen
        if excess.min() == excess.max():  # every entry counts: known here, no mask to apply
            taken = None
        slots.free(victims, taken, excess)
        if self.scores is not None:
            self.scores.clear_slots(victims, taken)  # a reused slot starts afresh
        self.evicted += int(excess.sum()) * slots.groups

    def victims(self, slots: SlotMap):
        """Slots to evict now: (B, Hs, k) slots, a bool of the same shape False past a
        sequence's excess, and the (B,) excess; None if none."""
        if not self.policy.can_evict():
            return None
        shares = self.shares(slots)
        excess = np.maximum(slots.kept - shares.budget, 0)
        if excess.max(initial=0) <= 0:
            return None
        positions = slots.positions
        attention = None
        if self.scores is not None:
            attention = self.scores.window_sum(self.steps_scored(slots), slots.capacity)
        score = self.policy.score(positions, attention, upload(slots.first, slots.device))
        # Every group (KV head, when selecting per head) of a sequence drops its excess.
        chosen, taken = self.ops.evict(
            Eviction(
                scores=score,
                positions=positions,
                first=slots.first,
                seen=slots.seen,
                recent=shares.recent.copy(),  # the book's array is read-only
                sinks=self.policy.sink_tokens,
                excess=excess,
            )
        )
        return chosen, taken, excess

    # ---- a static step (:mod:`alisa.kv.static`) -----------------------------------------

    def static_slots(self, max_len: int) -> int:
        """The budget at ``max_len`` tokens and the new token (budgets never shrink as a
        sequence grows, so a step evicts at most the one token it adds); every token when
        the policy never evicts."""
        if not self.policy.can_evict():
            return max_len
        budget = int(self.policy.budget(np.array([max_len], dtype=np.int64))[0])
        return min(budget + 1, max_len)

    def reserve(self, pack: StepPack, batch: int) -> None:
        """Fields (B,) each: the excess over the budget (0 or 1), the recent share, the sums'
        keep weight, the rows' first positions, the ring slot of this step's snapshot of the
        sums (the same for every row), each row's snapshot to subtract and whether it has
        one."""
        super().reserve(pack, batch)
        self._fields = pack.reserve(STATIC_FIELDS, batch)

    def plan_step(self, slots: SlotMap) -> None:
        """The eager step's numbers, from the same shares: what :meth:`victims` and
        :meth:`account` compute on the host."""
        if not self.policy.can_evict():
            return
        shares = self.shares(slots)
        excess = np.maximum(slots.kept - shares.budget, 0)
        if excess.max(initial=0) > 1:
            raise ValueError(
                f"policy={self.policy.name!r}: a budget that shrinks as a sequence grows "
                f"(excess {excess.tolist()}) has no static step"
            )
        block = self.pack.host(self._fields, STATIC_FIELDS, self.pack.rows)
        block[0], block[1], block[3] = excess, shares.recent, slots.first
        if self.scores is not None:
            if self.scores.decayed:
                block[2] = self.scores.keep_of(shares.window)
            block[4] = self.scores.count_step(shares.window)
            if self.scores.windowed and shares.window is not None:
                block[5], block[6] = self.scores.snapshot_choice(shares.window)
            else:  # the whole sums (H2O, or no window asked)
                block[6] = 0
        slots.release(excess)
        self.evicted += int(excess.sum()) * slots.groups

    def _field(self, index: int) -> torch.Tensor:
        return self.pack.field(self._fields, self.pack.rows, index)

    def _after_static(self, slots: SlotMap, probabilities: torch.Tensor) -> None:
        """:meth:`after_attention` of a static step: the same accounting and choice, every
        number read from the device (one victim per sequence, taken where its excess is 1)."""
        if self.scores is not None:
            rows = self.policy.combine_heads(probabilities, slots.groups)
            keep = self._field(2).to(torch.float32) if self.scores.decayed else None
            snapshot = self._field(4)[:1].to(torch.int64)
            self.scores.add_static(rows[:, :, 0], keep, snapshot)
        if not self.policy.can_evict():
            return
        positions = slots.positions
        first, recent = self._field(3).to(torch.int64), self._field(1).to(torch.int64)
        attention = None
        if self.scores is not None:
            choice, has = self._field(5).to(torch.int64), self._field(6) > 0
            attention = self.scores.static_window_sum(choice, has)
        score = self.policy.score(positions, attention, first).to(torch.float32)
        seen = self.pack.position() + 1
        victim = self.ops.evict_static(
            score, positions, first, seen, recent, self.policy.sink_tokens
        )
        taken = (self._field(0) > 0).view(-1, 1, 1).expand(victim.shape)
        slots.empty(victim, taken)
        if self.scores is not None:
            self.scores.clear_slots(victim, taken)

    def grow(self, capacity: int) -> None:
        if self.scores is not None:
            self.scores.grow(capacity)

    def moved(
        self, index: torch.Tensor, capacity: int | None = None, vacated: torch.Tensor | None = None
    ) -> None:
        if self.scores is not None:
            self.scores.reindex(index, vacated)
            if capacity is not None:
                self.scores.grow(capacity)

    def state_bytes(self) -> int:
        return self.scores.nbytes() if self.scores is not None else 0

    def static_buffers(self) -> tuple[torch.Tensor, ...]:
        return self.scores.static_buffers() if self.scores is not None else ()

    def select_batch(self, indices: torch.Tensor) -> None:
        if self.scores is not None:
            self.scores.select_batch(indices)

    def extend_rows(self, other: Keeper, slots: SlotMap, other_slots: SlotMap) -> None:
        """Append ``other``'s sequences: their attention sums follow their slots."""
        super().extend_rows(other, slots, other_slots)
        if (self.scores is None) != (other.scores is None):
            raise ValueError("keepers with and without attention sums cannot share a batch")
        if self.scores is not None:
            self.scores.extend_rows(other.scores)

    def reset(self) -> None:
        super().reset()
        self.scores = None
