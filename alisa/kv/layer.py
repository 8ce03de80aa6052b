"""One ALISA cache layer: the Hugging Face face of a slot map, a store and a keeper.

The layer composes three parts with one job each: a :class:`~alisa.kv.slots.SlotMap` (which token
sits in which slot), a :class:`~alisa.storage.store.KVStore` (the bytes, possibly over several
tiers) and a :class:`~alisa.kv.keeper.Keeper` (which tokens stay on the device: dropping or host
retention). The attention function calls :meth:`AlisaLayer.before_attention` at a decode step,
reads :meth:`AlisaLayer.parts`, and calls :meth:`AlisaLayer.after_attention` once per call; the
layer forwards each to its keeper and keeps the buffers sized and compact. It never asks which
keeper it has.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from alisa.kv.keeper import Keeper
from alisa.kv.rest import RestColumn
from alisa.kv.slots import SlotMap, grown
from alisa.kv.static import StepPack, mark_static
from alisa.kv.tiering import CallInputs, Tiering
from alisa.storage.store import DenseStore, KVStore, Part, StoreFactory, TokenInputs


class AlisaLayer(CacheLayerMixin):
    """KV of one attention layer: what its :class:`~alisa.kv.keeper.Keeper` keeps on the device.

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
        (:meth:`~alisa.kv.keeper.Keeper.static_slots`, refused here for a keeper without a
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
        :meth:`~alisa.kv.keeper.Keeper.rest`), or None."""
        return self.keeper.rest(self.slots, query, scaling, softcap)

    def parts(self, query: torch.Tensor | None = None) -> list[Part]:
        """(K, V, positions) per storage region, on the model's device, in slot order."""
        return self.store.parts(self.slots.positions, query)

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
