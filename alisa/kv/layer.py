"""One ALISA cache layer and its keeper protocol: the Hugging Face face of a slot map, a store
and a keeper.

The layer (:class:`AlisaLayer`) composes three parts with one job each: a
:class:`~alisa.kv.slots.SlotMap` (which token sits in which slot), a
:class:`~alisa.storage.store.KVStore` (the bytes, possibly over several tiers) and a
:class:`Keeper` (which tokens stay on the device). The attention function calls
:meth:`AlisaLayer.before_attention` at a decode step, reads :meth:`AlisaLayer.parts`, and calls
:meth:`AlisaLayer.after_attention` once per call; the layer forwards each to its keeper and
keeps the buffers sized and compact. It never asks which keeper it has.

Two keepers ship: :class:`~alisa.kv.drop.DropKeeper` (ALISA's SWA, H2O, ...: tokens over the
budget are evicted for good) and :class:`~alisa.kv.host.HostKeeper` (every token kept in host
memory, each decode step attends to the best tokens per KV head); windowed layers have
:class:`~alisa.kv.window.WindowKeeper`. A further one (a disk tier) is one more subclass.

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
from transformers.cache_utils import CacheLayerMixin

from alisa.kv.rest import RestColumn
from alisa.kv.slots import SlotMap, grown
from alisa.kv.static import StepPack, mark_static
from alisa.kv.tiering import CallInputs, Tiering
from alisa.policies import BudgetBook, KVPolicy, StepShares
from alisa.storage.store import DenseStore, KVStore, Part, StoreFactory, TokenInputs


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


class AlisaLayer(CacheLayerMixin):
    """KV of one attention layer: what its :class:`Keeper` keeps on the device.

    Parameters
    ----------
    keeper
        Decides which tokens the device holds (and owns any host copy of the rest).
    layer_idx
        Index of the attention layer (for tiers that recompute with its projections).
    store_factory
        Builds the prefill store (dense or quantized).
    tiering
        Splits the kept prefill over device/host/recompute tiers (None: all on the device).
    compiled
        The slot map claims a decode step's slots by a compiled CPU kernel
        (:attr:`alisa.ops.backends.Ops.compiled`); False: PyTorch operators.
    max_cache_len
        Make the layer static (:mod:`alisa.kv.static`): after the prefill its slot space is
        fixed at what contexts of up to this many tokens per sequence need
        (:meth:`Keeper.static_slots`, refused here for a keeper without a
        static step), and each decode step runs with one shape and no host read, so that
        ``torch.compile`` traces it once; None: the slot space grows and compacts as needed.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(
        self,
        keeper: Keeper,
        *,
        layer_idx: int = 0,
        store_factory: StoreFactory = DenseStore,
        tiering: Tiering | None = None,
        compiled: bool = False,
        max_cache_len: int | None = None,
    ) -> None:
        super().__init__()
        self.keeper = keeper
        self.compiled = compiled
        self.max_cache_len = max_cache_len
        # Slots of a static layer, fixed once (None: the layer grows and compacts).
        self.static_slots = None if max_cache_len is None else keeper.static_slots(max_cache_len)
        self.is_compileable = max_cache_len is not None
        # Transformers sizes its sliding-window masks against a layer that says it is sliding.
        self.is_sliding = keeper.window is not None
        self.layer_idx = layer_idx
        self.store_factory = store_factory
        self.tiering = tiering
        self._clear()

    def _clear(self) -> None:
        self.store: KVStore | None = None
        self.slots: SlotMap | None = None
        self.prefilling = False  # the last update started the cache (dense prefill attention)
        # Attention input and RoPE positions of the current call (tiers that recompute keep them).
        self.inputs: CallInputs | None = None
        self.is_initialized = False

    # ---- HF cache-layer interface -------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new tokens; return them (attention reads the stored slots via :meth:`parts`).

        Prefill attention runs densely over the returned prompt (as HF); later steps read every
        stored slot, empty ones masked.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.prefilling = self.store is None
        if self.prefilling:
            self._start(key_states, value_states)
        elif self.keeper.pack is not None:  # a static step: the host counted the token
            position = self.keeper.pack.position()
            self.keeper.write_static(position, key_states, value_states)
            slot = self.slots.claim_free(position)
            self.store.write_slots(slot, key_states, value_states, position)
        else:
            self.keeper.on_write(self.slots.seen, key_states, value_states, self.slots)
            if key_states.shape[2] == 1:
                self._write_one(key_states, value_states)
            else:
                self._append(key_states, value_states)
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.slots.seen if self.slots is not None else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Stored slots plus the query, offset so HF's mask builder stays inside the 2D mask;
        # the ALISA attention builds its own mask from slot positions after prefill.
        if self.max_cache_len is not None and self.slots is not None:
            # One size for every step, as HF's StaticLayer (a traced step reads no count);
            # attention masks by slot positions after the prefill.
            return self.max_cache_len, 0
        if self.slots is None:
            return query_length, 0
        return self.slots.width + query_length, self.slots.seen - self.slots.width

    def get_max_length(self) -> int:
        return -1 if self.max_cache_len is None else self.max_cache_len

    def reset(self) -> None:
        self._clear()
        self.keeper.reset()

    def bind(self, pack: StepPack, batch: int) -> None:
        """Give a static layer the numbers of its steps (:mod:`alisa.kv.static`): at the first
        decode step of ``batch`` sequences, and again when the batch changed. Its buffers keep
        their addresses from here on, and say so (:func:`alisa.kv.static.mark_static`)."""
        self.keeper.reserve(pack, batch)
        mark_static(
            *self.store.static_buffers(),
            *self.slots.static_buffers(),
            *self.keeper.static_buffers(),
        )

    def plan_step(self) -> None:
        """Before a static decode step (the host's half): count its token and write the
        keeper's numbers for it into its pack."""
        self.slots.advance()
        self.keeper.plan_step(self.slots)

    def seen_now(self) -> int | torch.Tensor:
        """Tokens seen, the one being attended included: the host count, or in a static
        step the (1,) device number (a traced step reads no host count)."""
        if self.keeper.pack is not None and not self.prefilling:
            return self.keeper.pack.position() + 1
        return self.slots.seen

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only some sequences of the batch (in the given order)."""
        if self.store is None:
            return
        indices = indices.to(self.device)
        self.store.select_batch(indices)
        self.slots.select_batch(indices, indices.cpu().numpy())
        self.keeper.select_batch(indices)

    def shift_positions(self, delta: int) -> None:
        """Move every sequence ``delta`` positions later (earlier when negative), as if it had
        that much more (less) left padding: the same tokens, budgets and RoPE (rotary angles
        come from the caller's ``position_ids``, never from slot positions)."""
        if self.store is None or delta == 0:
            return
        self.keeper.shift_positions(delta, self.slots)
        self.store.shift_positions(delta)
        self.slots.shift(delta)

    def extend_rows(self, other: AlisaLayer) -> None:
        """Append the sequences of ``other`` (this layer of another cache of the same config,
        prefilled, on the same timeline: equal ``seen``) after these.

        ``other`` is compacted first, then both slot spaces take the larger capacity (new slots
        empty) and each part (slot map, store, keeper) concatenates its own state.
        """
        if self.store is None:
            raise ValueError("a layer takes rows only once it holds some (after its prefill)")
        if other.slots.seen != self.slots.seen:
            raise ValueError(
                f"layers at {other.slots.seen} and {self.slots.seen} tokens seen cannot share a "
                "batch: shift one first"
            )
        other.trim()
        capacity = max(self.store.capacity, other.store.capacity)
        for layer in (self, other):
            layer._resize(capacity)
        self.keeper.extend_rows(other.keeper, self.slots, other.slots)
        self.store.extend_rows(other.store)
        self.slots.extend_rows(other.slots)

    def trim(self) -> None:
        """Return the memory of every empty slot now (compaction, whatever it would save): after
        sequences left or before they join another batch, the capacity follows the rows held."""
        if self.store is not None and self.store.compactable:
            self._compact(force=True)

    def crop(self, tokens_to_remove: int) -> None:
        # A ValueError, as for any mode alisa refuses: HF calls it from assisted decoding.
        raise ValueError(
            "crop(): an AlisaCache cannot be cropped "
            "(evicted tokens cannot be restored); assisted and speculative decoding "
            "(prompt_lookup_num_tokens, assistant_model) need a DynamicCache"
        )

    # ---- what attention and callers use -------------------------------------------------

    def before_attention(self, query: torch.Tensor) -> None:
        """A decode step's (B, H, q, D) query is about to attend: the keeper may change what
        the slots hold (host retention fetches this step's tokens)."""
        self.keeper.before_attention(self.slots, self.store, query, self._ensure_capacity)

    def rest(
        self, query: torch.Tensor, scaling: float, softcap: float | None = None
    ) -> RestColumn | None:
        """The estimated attention of the tokens this decode step leaves out (the keeper's
        :meth:`Keeper.rest`), or None."""
        return self.keeper.rest(self.slots, query, scaling, softcap)

    def parts(self, query: torch.Tensor | None = None) -> list[Part]:
        """(K, V, positions) per storage region, on the model's device, in slot order."""
        return self.store.parts(self.slots.positions, query, self.slots.width)

    def attend(
        self, query: torch.Tensor, scaling: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The store's own plain attention over the slots for a decode step's (B, H, 1, D)
        ``query`` (:meth:`~alisa.storage.store.KVStore.attend`): ((B, 1, H, D) output,
        (B, H_kv, G, 1, capacity) probabilities), or None where attention reads :meth:`parts`
        (a static step's store runs its kernels as operators, or leaves it to PyTorch's)."""
        return self.store.attend(
            self.slots.positions, query, self.seen_now(), self.keeper.window, scaling
        )

    def slot_positions(self) -> torch.Tensor:
        """(B, Hs, capacity) position of each slot's token (negative: empty or padding)."""
        return self.slots.positions

    def stored_tokens(self) -> int:
        """Tokens stored, summed over sequences (and over KV heads when selecting per head)."""
        return int(self.slots.kept.sum()) * self.slots.groups if self.store is not None else 0

    def kv_bytes(self) -> int:
        """Bytes of key/value buffers held, spare capacity included (every tier)."""
        return sum(self.tier_bytes().values())

    def tier_bytes(self) -> dict[str, int]:
        """KV bytes per tier (device, host, recompute): the store's regions plus what the
        keeper holds itself (host retention's host region and device key sketch)."""
        if self.store is None:
            return {}
        totals = dict(self.store.tier_bytes())
        for tier, count in self.keeper.tier_bytes().items():
            totals[tier] = totals.get(tier, 0) + count
        return totals

    def state_bytes(self) -> int:
        """Bytes of bookkeeping: slot positions and attention sums."""
        if self.store is None:
            return 0
        return self.slots.nbytes() + self.keeper.state_bytes()

    def receive_inputs(self, hidden: torch.Tensor, position_ids: torch.Tensor | None) -> None:
        """Keep this call's attention input and RoPE positions when a tier recomputes K/V."""
        if self.tiering is not None and self.tiering.keeps_inputs:
            self.inputs = CallInputs(hidden, position_ids)

    def mark_padding(self, valid: torch.Tensor) -> None:
        """Flag left-padding slots of the prefill; valid is (B, q) bool over the prefill tokens."""
        self.slots.mark_padding(valid)

    def scored_rows_wanted(self) -> int | None:
        """Prompt query rows to seed attention scores with: None = all, 0 = none."""
        return self.keeper.rows_wanted(self.slots)

    @property
    def observes_prompt(self) -> bool:
        """Whether the prompt seeds the scores as one pooled vote (an observation window)."""
        return self.keeper.observes

    def account(self, probabilities: torch.Tensor, *, vote: bool = False) -> None:
        """Prompt attention (B, H_kv, G, q, S') over slots [0, S') for the keeper's scores;
        ``vote``: the rows are the observation window's, summed into one."""
        self.keeper.account(probabilities, self.slots, vote=vote)

    def after_attention(self, query: torch.Tensor, probabilities: torch.Tensor | None) -> None:
        """The step hook: the keeper's turn (account, evict or update its history), compaction,
        then the tiers (the split after the prefill, a prefetch after a decode step).

        Parameters
        ----------
        query
            (B, H, q, D) this step's queries.
        probabilities
            (B, H_kv, G, q, S) this step's attention over the slots, or None when already
            accounted (prefill seeding).
        """
        self.keeper.after_attention(
            self.slots, self.store, query, probabilities, prefilling=self.prefilling
        )
        if self.static_slots is not None:
            if self.prefilling:  # once: the live slots to the front of the fixed space
                self._compact(force=True)
        elif self.keeper.frees_slots:
            self._maybe_compact()
        if self.prefilling:
            self._finish_prefill()
        elif self.tiering is not None:
            self.tiering.after_step(self.layer_idx)

    # ---- internals -------------------------------------------------------------------

    def _start(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        batch, heads, length, _ = keys.shape
        groups = heads if self.keeper.per_head else 1
        capacity = grown(length, self.keeper.window)
        if self.static_slots is not None:  # the prompt first, then the fixed space
            capacity = max(length, self.static_slots)
        self.store = self.store_factory(keys, values, capacity, groups=groups)
        self.slots = SlotMap(batch, groups, length, capacity, self.device, compiled=self.compiled)
        self.keeper.start(self.slots, keys, values)

    def _write_one(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        append = self.slots.appends()  # a slot freed below the frontier is refilled first
        if append.any():
            self._ensure_capacity(self.slots.width + 1)
        position = self.slots.seen
        inputs = self._inputs(1)
        placed = self.slots.place_one(append)
        if isinstance(placed, int):  # every sequence appends at the frontier: slice writes
            self.store.write_range(placed, keys, values, position, inputs)
        else:
            self.store.write_slots(placed, keys, values, position, inputs)

    def _append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        length = keys.shape[2]
        self._ensure_capacity(self.slots.width + length)
        position = self.slots.seen
        inputs = self._inputs(length)
        start = self.slots.place_range(length)
        self.store.write_range(start, keys, values, position, inputs)

    def _ensure_capacity(self, slots: int) -> None:
        if slots <= self.store.capacity:
            return
        if self.static_slots is not None:
            raise ValueError(
                f"layer {self.layer_idx} needs {slots} slots, past its static "
                f"{self.store.capacity} for max_cache_len={self.max_cache_len}"
            )
        self._resize(grown(slots, self.keeper.window))

    def _resize(self, capacity: int) -> None:
        """Grow the slot space to ``capacity`` slots (no-op when it has them)."""
        if capacity > self.store.capacity:
            self.store.grow(capacity)
            self.slots.grow(capacity)
            self.keeper.grow(capacity)

    def _inputs(self, length: int) -> TokenInputs | None:
        """Attention inputs and RoPE positions of the new tokens, for stores that recompute."""
        if not self.store.needs_inputs:
            return None
        return self.inputs.tokens(self.slots.seen, length)

    def _finish_prefill(self) -> None:
        """After the prefill's keeping: split the kept tokens over the tiers, if there are any."""
        if self.tiering is None:
            return
        prompt = None
        if self.inputs is not None:  # a recompute tier rebuilds K/V from the prompt's inputs
            prompt = self.inputs.gatherer(self.slots.positions[:, 0], self.slots.seen)
        self.inputs = None  # the prompt's hidden states are no longer needed
        self.store, mapping, width = self.tiering.split(
            self.layer_idx, self.store, self.slots, prompt
        )
        # Slots moved: old slot mapping[j] is now slot j (-1: nothing there).
        taken = self.slots.remap(mapping, width)
        self.keeper.moved(taken, vacated=mapping < 0)

    def _maybe_compact(self) -> None:
        """Copy live slots to the front of smaller buffers once over a third of width is empty."""
        if self.store.compactable:
            self._compact(force=False)

    def _compact(self, *, force: bool) -> None:
        moved = self.slots.compaction(self.keeper.window, force=force, capacity=self.static_slots)
        if moved is None:
            return
        index, capacity = moved
        self.store.reindex(index, capacity)
        self.keeper.moved(index, capacity)
