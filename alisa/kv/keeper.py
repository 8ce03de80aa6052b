"""The keeper protocol: what one cache layer holds on the device, decided around attention.

A layer (:class:`~alisa.kv.layer.AlisaLayer`) owns the slot map (which token sits in which slot) and
the store (the bytes); its keeper decides which tokens those are. Two keepers ship:
:class:`~alisa.kv.drop.DropKeeper` (ALISA's SWA, H2O, ...: tokens over the budget are evicted
for good) and :class:`~alisa.kv.host.HostKeeper` (every token kept in host memory, each decode
step attends to the best tokens per KV head). A third (a disk tier, a keeper for sliding-window
layers) is one more subclass; the layer never asks which keeper it has.

The layer calls, in order: :meth:`Keeper.start` when the prefill arrives; :meth:`Keeper.on_write`
for every later write; at prefill :meth:`Keeper.rows_wanted` and :meth:`Keeper.account` (the
attention function seeds scores from the last prompt queries); :meth:`Keeper.before_attention`
at each decode step; :meth:`Keeper.after_attention` after every attention call. When the slots
move (growth, compaction, the tier split) it calls :meth:`Keeper.grow` and :meth:`Keeper.moved`
so that per-slot state follows; when sequences leave or join a running batch,
:meth:`Keeper.select_batch`, :meth:`Keeper.shift_positions` and :meth:`Keeper.extend_rows`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from alisa.kv.budgets import BudgetBook, StepShares
from alisa.kv.rest import RestColumn
from alisa.kv.slots import SlotMap
from alisa.kv.static import StepPack
from alisa.policies import KVPolicy
from alisa.storage.store import KVStore


class Keeper:
    """Base of every keeper: the hooks a layer calls, each a no-op unless a keeper needs it.

    Parameters
    ----------
    policy
        Budgets, protections and scores (the keeper's rules).
    per_head
        Keep one index set per KV head (slot groups = H_kv) instead of one per layer.
    """

    #: A sliding window W: queries see only positions (p - W, p] (None: every held token).
    window: int | None = None

    def __init__(self, policy: KVPolicy, *, per_head: bool = False) -> None:
        self.policy = policy
        self.per_head = per_head
        self.evicted = 0  # tokens deleted for good, all sequences and groups
        self._fetched = 0  # tokens brought back to the device, counted on the host
        self._fetched_on_device: torch.Tensor | None = None  # ... counted where they were
        # The policy's budget and its shares for the current lengths: the cache's layers share
        # one book (:meth:`share_budgets`), which computes them once a step for all of them.
        self.budgets = BudgetBook()
        # A static cache's step numbers (alisa.kv.static), once its first decode step binds them.
        self.pack: StepPack | None = None

    @property
    def frees_slots(self) -> bool:
        """Whether slots may empty after attention (then the layer compacts when worth it)."""
        return self.policy.can_evict()

    @property
    def observes(self) -> bool:
        """Whether the prompt's last queries seed the scores as one pooled vote (SnapKV)."""
        return False

    def start(self, slots: SlotMap, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The prefill's (B, H_kv, n, D) K/V were stored in slots [0, n) of a fresh slot map."""

    def on_write(
        self, start: int, keys: torch.Tensor, values: torch.Tensor, slots: SlotMap
    ) -> None:
        """(B, H_kv, m, D) tokens at positions [start, start + m) are about to be stored."""

    def rows_wanted(self, slots: SlotMap) -> int | None:
        """Prompt query rows to seed attention scores with: None = all, 0 = none."""
        return 0

    def account(self, probabilities: torch.Tensor, slots: SlotMap, *, vote: bool = False) -> None:
        """Prompt attention (B, H_kv, G, q, S') over slots [0, S'), rows or one pooled ``vote``."""

    def before_attention(
        self,
        slots: SlotMap,
        store: KVStore,
        query: torch.Tensor,
        reserve: Callable[[int], None],
    ) -> None:
        """A decode step's (B, H, q, D) query is about to attend to the stored slots.

        ``reserve(n)`` makes room for ``n`` slots (store, slot map and keeper state grow).
        """

    def rest(
        self, slots: SlotMap, query: torch.Tensor, scaling: float, softcap: float | None
    ) -> RestColumn | None:
        """The attention this decode step's (B, H, q, D) query would give the tokens the slots
        do not hold, as one softmax column (:mod:`alisa.kv.rest`); None: nothing is estimated
        (every token the step may see is in the slots, or the keeper dropped the others)."""
        return None

    def after_attention(
        self,
        slots: SlotMap,
        store: KVStore,
        query: torch.Tensor,
        probabilities: torch.Tensor | None,
        *,
        prefilling: bool,
    ) -> None:
        """Attention ran: (B, H, q, D) queries, (B, H_kv, G, q, S) probabilities over the slots
        (None when already accounted, at prefill)."""
        raise NotImplementedError

    # ---- a static step (:mod:`alisa.kv.static`) -----------------------------------------

    def static_slots(self, max_len: int) -> int:
        """Slots a static layer needs for contexts of up to ``max_len`` tokens per sequence
        (the most it ever holds at once, the new token included).

        Raises
        ------
        ValueError
            The keeper has no static decode step (naming the mode and why).
        """
        raise ValueError(
            f"{type(self).__name__} has no static decode step: build the cache without "
            "max_cache_len (compile='off')"
        )

    def reserve(self, pack: StepPack, batch: int) -> None:
        """Take this keeper's fields of a static step's numbers for ``batch`` sequences."""
        self.pack = pack

    def static_buffers(self) -> tuple[torch.Tensor, ...]:
        """The device tensors of this keeper a static step writes in place (none here)."""
        return ()

    def plan_step(self, slots: SlotMap) -> None:
        """A static decode step is about to run (the host counted its token:
        :meth:`SlotMap.advance`): write this keeper's numbers into its fields of
        :attr:`pack` and count on the host what the step will do on the device."""

    def write_static(self, position: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
        """A static decode step stores its (B, H_kv, 1, D) token at ``position`` ((1,) int64 on
        the device; the layer placed it in a slot): what the keeper keeps of it besides the
        slot, written with one shape and no host read (nothing here)."""

    def grow(self, capacity: int) -> None:
        """The slot space grew to ``capacity`` slots."""

    def moved(
        self, index: torch.Tensor, capacity: int | None = None, vacated: torch.Tensor | None = None
    ) -> None:
        """Slots moved: new slot j holds old slot index[b, g, j] (B, Hs, S'); then the space is
        ``capacity`` slots (None: S'); ``vacated`` (S',) new slots that hold nothing."""

    def tier_bytes(self) -> dict[str, int]:
        """KV bytes per tier held by the keeper itself, besides the layer's store."""
        return {}

    def host_bytes(self, keys: torch.Tensor, tokens: int) -> int:
        """The most host memory the keeper takes for ``tokens`` positions of the sequences of a
        prefill's (B, H_kv, n, D) ``keys`` (0: it keeps nothing on the host)."""
        return 0

    def state_bytes(self) -> int:
        """Bytes of bookkeeping (attention sums)."""
        return 0

    def select_batch(self, indices: torch.Tensor) -> None:
        """Keep (and reorder) sequences."""

    def shift_positions(self, delta: int, slots: SlotMap) -> None:
        """Every token is about to move ``delta`` positions (``slots`` not moved yet): state
        kept per position follows (continuous batching aligns a joining batch's timeline)."""

    def extend_rows(self, other: Keeper, slots: SlotMap, other_slots: SlotMap) -> None:
        """Append the sequences of ``other`` (a keeper of the same kind and config, slot space
        of the same capacity and timeline) after these; ``slots`` and ``other_slots`` are the
        two slot maps, not merged yet."""
        self.evicted += other.evicted
        self._fetched += other._fetched
        if other._fetched_on_device is not None:
            self.count_fetched(other._fetched_on_device)

    def reset(self) -> None:
        """Forget everything; the next write is a new prefill."""
        self.evicted = 0
        self._fetched = 0
        self._fetched_on_device = None
        self.pack = None

    @property
    def fetched(self) -> int:
        """Tokens brought back to the device so far, all sequences and KV heads (reading it
        waits for the device when fetches were counted there)."""
        if self._fetched_on_device is None:
            return self._fetched
        return self._fetched + int(self._fetched_on_device)

    def count_fetched(self, count: int | torch.Tensor) -> None:
        """Add ``count`` fetched tokens: a host int, or a 0-d device tensor (kept there, so a
        step that never brings its fetch list to the host does not wait to count it)."""
        if isinstance(count, int):
            self._fetched += count
        elif self._fetched_on_device is None:
            self._fetched_on_device = count.to(torch.int64)
        else:
            self._fetched_on_device = self._fetched_on_device + count

    def share_budgets(self, book: BudgetBook) -> None:
        """Read budgets from ``book``, shared with the other layers of a cache (each layer
        asking its own policy every step cost about 2 % of a step at one sequence)."""
        self.budgets = book

    def shares(self, slots: SlotMap) -> StepShares:
        """The policy's budget, recent share and score window for the current lengths (the
        book's arrays: read them, or copy)."""
        return self.budgets.shares(self.policy, slots.lengths())

    def budget(self, slots: SlotMap) -> np.ndarray:
        """(B,) tokens each sequence may hold per group now."""
        return self.shares(slots).budget.copy()

    def recent(self, slots: SlotMap) -> np.ndarray:
        """(B,) newest tokens each sequence keeps now (:meth:`KVPolicy.recent` of the budget)."""
        return self.shares(slots).recent.copy()

    def steps_scored(self, slots: SlotMap) -> np.ndarray | None:
        """(B,) decode steps whose attention is summed now, None: every step
        (:meth:`KVPolicy.steps_scored` of the budget)."""
        window = self.shares(slots).window
        return None if window is None else window.copy()
