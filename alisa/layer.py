"""One layer of the ALISA cache: slot map + storage + eviction decision, and the step hook.

The layer composes three parts with one job each: a :class:`~alisa.slots.SlotMap` (which token
sits in which slot), a :class:`~alisa.storage.store.KVStore` (the bytes, possibly over several
tiers) and an :class:`~alisa.eviction.Eviction` (policy plus attention sums). Attention calls
:meth:`AlisaLayer.after_attention` once per step: account attention, evict, then run the
layer's extensions (prefetch of the next layer's host tier). Evicted
tokens are really gone: their slot is overwritten by the next token, and compaction returns the
memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch
from transformers.cache_utils import CacheLayerMixin

from alisa.eviction import Eviction
from alisa.policies import KVPolicy
from alisa.retention import HostRetention
from alisa.slots import SlotMap, headroom
from alisa.storage.store import DenseStore, KVStore, Part, StoreFactory, TokenInputs


class StepExtension(Protocol):
    """Work a layer runs after its eviction each decode step (and when it evicts)."""

    def on_evict(self, layer: AlisaLayer, rows, groups, slots) -> None:
        """Slots (flat index triples) about to be emptied; their K/V are still stored."""
        ...

    def after_step(self, layer: AlisaLayer, query: torch.Tensor, scaling: float) -> None: ...

    def select_batch(self, indices: torch.Tensor) -> None: ...

    def reset(self) -> None: ...


class Tiering(Protocol):
    """Splits a layer's prefill over storage tiers (see :class:`alisa.planning.TierPlanner`)."""

    keeps_inputs: bool  # whether layers must keep their attention inputs (recompute tier)

    def split(
        self,
        layer_idx: int,
        store: KVStore,
        slots: SlotMap,
        inputs: Callable[[slice], TokenInputs] | None,
    ) -> tuple[KVStore, torch.Tensor, int]: ...


class AlisaLayer(CacheLayerMixin):
    """KV of one attention layer, kept by a :class:`~alisa.policies.KVPolicy`.

    Parameters
    ----------
    policy
        Decides budgets and token scores for this layer.
    layer_idx
        Index of the attention layer (for tiers that recompute with its projections).
    per_head
        One index set per KV head instead of one per layer (and sequence).
    store_factory
        Builds the prefill store (dense or quantized).
    tiering
        Splits the kept prefill over device/host/recompute tiers (None: all on the device).
    extensions
        Run after each decode step's eviction, in order.
    retention
        ``retention="host"``: every token kept in a host region, each decode step attends to
        the tokens chosen per KV head (selection replaces eviction; implies per-head slots).
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(
        self,
        policy: KVPolicy,
        *,
        layer_idx: int = 0,
        per_head: bool = False,
        store_factory: StoreFactory = DenseStore,
        tiering: Tiering | None = None,
        extensions: Sequence[StepExtension] = (),
        retention: HostRetention | None = None,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.retention = retention
        self.per_head = per_head or retention is not None
        self.store_factory = store_factory
        self.tiering = tiering
        self.extensions = tuple(extensions)
        self.eviction = Eviction(policy, scored=retention is None)
        self._clear()

    def _clear(self) -> None:
        self.store: KVStore | None = None
        self.slots: SlotMap | None = None
        self.evicted = 0  # tokens evicted so far, all sequences and groups
        self.prefilling = False  # the last update started the cache (dense prefill attention)
        # Attention input and RoPE positions of the current call (tiers that recompute keep them).
        self.inputs: tuple[torch.Tensor, torch.Tensor | None] | None = None
        # retention="host": the prompt, written to the host region once its padding is known.
        self.prompt: tuple[torch.Tensor, torch.Tensor] | None = None
        self.is_initialized = False

    @property
    def policy(self) -> KVPolicy:
        return self.eviction.policy

    @property
    def groups(self) -> int:
        return self.slots.groups

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
        elif key_states.shape[2] == 1:
            self._write_one(key_states, value_states)
        else:
            self._append(key_states, value_states)
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.slots.seen if self.slots is not None else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Stored slots plus the query, offset so HF's mask builder stays inside the 2D mask;
        # the ALISA attention builds its own mask from slot positions after prefill.
        if self.slots is None:
            return query_length, 0
        return self.slots.width + query_length, self.slots.seen - self.slots.width

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self._clear()
        if self.retention is not None:
            self.retention.reset()
        for extension in self.extensions:
            extension.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only some sequences of the batch (in the given order)."""
        if self.store is None:
            return
        indices = indices.to(self.device)
        self.store.select_batch(indices)
        self.slots.select_batch(indices, indices.cpu().numpy())
        self.eviction.select_batch(indices)
        if self.retention is not None:
            self.retention.select_batch(indices)
        for extension in self.extensions:
            extension.select_batch(indices)

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "AlisaCache cannot be cropped (evicted tokens cannot be restored); assisted and "
            "speculative decoding need a DynamicCache"
        )

    # ---- what attention and callers use -------------------------------------------------

    @property
    def needs_attention(self) -> bool:
        """Whether attention probabilities must reach the policy (never when nothing is evicted)."""
        return self.eviction.needs_attention

    def parts(self, query: torch.Tensor | None = None) -> list[Part]:
        """(K, V, positions) per storage region, on the model's device, in slot order.

        With ``retention="host"`` and a decode ``query`` (B, H, 1, D), the slots are first made
        this step's chosen tokens (fetching from the host region what the device lacks).
        """
        if self.retention is not None and query is not None and not self.prefilling:
            budget = self.eviction.budget(self.slots)
            self._ensure_capacity(int(budget.max()) + int(self.slots.dead.max(initial=0)) + 1)
            self.retention.select(self.slots, self.store, self.policy, query, budget)
        return self.store.parts(self.slots.positions, query)

    def slot_positions(self) -> torch.Tensor:
        """(B, Hs, capacity) position of each slot's token (negative: empty or padding)."""
        return self.slots.positions

    def stored_tokens(self) -> int:
        """Tokens stored, summed over sequences (and over KV heads when selecting per head)."""
        return int(self.slots.kept.sum()) * self.groups if self.store is not None else 0

    def kv_bytes(self) -> int:
        """Bytes of key/value buffers held, spare capacity included (every tier)."""
        return sum(self.tier_bytes().values())

    def tier_bytes(self) -> dict[str, int]:
        """KV bytes per tier (device, host, recompute): the store's regions, plus the host
        region and the device key sketch of ``retention="host"``."""
        if self.store is None:
            return {}
        totals = dict(self.store.tier_bytes())
        if self.retention is not None:
            for tier, count in self.retention.tier_bytes().items():
                totals[tier] = totals.get(tier, 0) + count
        return totals

    def state_bytes(self) -> int:
        """Bytes of bookkeeping: slot positions and attention sums."""
        if self.store is None:
            return 0
        history = 0 if self.retention is None else self.retention.state_bytes()
        return self.slots.nbytes() + self.eviction.nbytes() + history

    def receive_inputs(self, hidden: torch.Tensor, position_ids: torch.Tensor | None) -> None:
        """Keep this call's attention input and RoPE positions when a tier recomputes K/V."""
        if self.tiering is not None and self.tiering.keeps_inputs:
            self.inputs = (hidden, position_ids)

    def mark_padding(self, valid: torch.Tensor) -> None:
        """Flag left-padding slots of the prefill; valid is (B, q) bool over the prefill tokens."""
        self.slots.mark_padding(valid)

    def scored_rows_wanted(self) -> int | None:
        """Prompt query rows to seed attention scores with: None = all, 0 = none."""
        return self.eviction.rows_wanted(self.slots)

    @property
    def observes_prompt(self) -> bool:
        """Whether the prompt seeds the scores as one pooled vote (an observation window)."""
        return self.eviction.observes

    def account(self, probabilities: torch.Tensor, *, vote: bool = False) -> None:
        """Add attention probabilities (B, H_kv, G, q, S') over slots [0, S') to the sums.

        ``vote``: the q rows are the observation window's, summed and pooled into one step.
        Columns past the slot map (parts a store adds beyond its slots) are not slots: ignored.
        """
        if self.eviction.scores is None:
            return
        rows = self.eviction.combine_heads(
            probabilities[..., : self.slots.capacity], self.groups, vote=vote
        )
        if vote:
            self.eviction.observe(rows.sum(dim=2), self.slots)
        else:
            self.eviction.account(rows, self.slots)

    def after_attention(
        self, query: torch.Tensor, probabilities: torch.Tensor | None, scaling: float
    ) -> None:
        """The step hook: account attention, evict, then extensions (or, after the prefill,
        the split over storage tiers).

        Parameters
        ----------
        query
            (B, H, q, D) this step's queries.
        probabilities
            (B, H_kv, G, q, S) this step's attention over the slots, or None when already
            accounted (prefill seeding).
        scaling
            Softmax scale.
        """
        if self.retention is not None:
            if self.prefilling:
                # The prompt goes to the host region; the device keeps only what the last
                # prompt query chooses, so no layer holds the whole prompt past its prefill.
                self._keep_prompt()
                budget = self.eviction.budget(self.slots)
                self.retention.select(self.slots, self.store, self.policy, query[:, :, -1:], budget)
            elif probabilities is not None:
                # The policy's own combination of query heads (sum, or SWA's max by default).
                rows = self.eviction.combine_heads(
                    probabilities[..., : self.slots.capacity], self.groups
                )
                window = self.eviction.window(self.eviction.budget(self.slots))
                self.retention.account(rows[:, :, 0], self.slots, window)
            self._maybe_compact()  # the selection freed slots; return their memory
        else:
            if probabilities is not None:
                self.account(probabilities)
            self.evict()
        if self.prefilling:
            self._finish_prefill()
            return
        for extension in self.extensions:
            extension.after_step(self, query, scaling)

    def evict(self) -> None:
        """Drop each sequence's excess tokens, lowest policy score first, sinks/recent protected."""
        chosen = self.eviction.victims(self.slots)
        if chosen is None:
            if self.policy.can_evict():
                self._maybe_compact()
            return
        rows, groups, slots, excess = chosen
        for extension in self.extensions:
            extension.on_evict(self, rows, groups, slots)
        self.slots.free(rows, groups, slots, excess)
        self.eviction.forget(rows, groups, slots)
        self.evicted += int(excess.sum()) * self.groups
        self._maybe_compact()

    # ---- internals -------------------------------------------------------------------

    def _start(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        batch, heads, length, _ = keys.shape
        groups = heads if self.per_head else 1
        capacity = length + headroom(length)
        self.store = self.store_factory(keys, values, capacity, groups=groups)
        self.slots = SlotMap(batch, groups, length, capacity, self.device)
        self.eviction.start(self.slots)
        if self.retention is not None:
            self.prompt = (keys, values)

    def _keep_prompt(self) -> None:
        """After the prefill attention marked padding: the prompt goes to the host region."""
        if self.prompt is not None:
            self.retention.write(0, *self.prompt, self.slots)
            self.prompt = None

    def _write_one(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.retention is not None:
            # Every new token is kept on the host as well; on the device it goes to the
            # frontier (the selection reuses freed slots, compaction returns the rest).
            self.retention.write(self.slots.seen, keys, values, self.slots)
            append = np.ones(len(self.slots.kept), dtype=bool)
        else:
            append = self.slots.appends()
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
        if self.retention is not None:
            self.retention.write(position, keys, values, self.slots)
        inputs = self._inputs(length)
        start = self.slots.place_range(length)
        self.store.write_range(start, keys, values, position, inputs)

    def _ensure_capacity(self, slots: int) -> None:
        if slots <= self.store.capacity:
            return
        capacity = slots + headroom(slots)
        self.store.grow(capacity)
        self.slots.grow(capacity)
        self.eviction.grow(capacity)

    def _inputs(self, length: int) -> TokenInputs | None:
        """Attention inputs and RoPE positions of the new tokens, for stores that recompute."""
        if not self.store.needs_inputs:
            return None
        hidden, rope = self.inputs
        return TokenInputs(hidden, _rope_positions(hidden, rope, self.slots.seen, length))

    def _finish_prefill(self) -> None:
        """After prefill eviction: split the kept tokens over the tiers, if the cache has tiers."""
        if self.tiering is None:
            return
        prompt = self._prompt_inputs()
        self.inputs = None  # the prompt's hidden states are no longer needed
        self.store, mapping, width = self.tiering.split(
            self.layer_idx, self.store, self.slots, prompt
        )
        # Slots moved: old slot mapping[j] is now slot j (-1: nothing there).
        taken = self.slots.remap(mapping, width)
        if self.eviction.scores is not None:
            self.eviction.reindex(taken)
            empty = (mapping < 0).nonzero(as_tuple=True)[0]
            batch = torch.arange(self.slots.positions.shape[0], device=self.device)
            rows = batch.repeat_interleave(empty.numel())
            self.eviction.forget(rows, torch.zeros_like(rows), empty.repeat(len(batch)))

    def _prompt_inputs(self) -> Callable[[slice], TokenInputs] | None:
        """Attention inputs of a span of the first slots (recompute tiers), gathered lazily."""
        if self.inputs is None:
            return None
        hidden, rope = self.inputs
        rope = _rope_positions(hidden, rope, 0, self.slots.seen)
        slot_positions = self.slots.positions[:, 0]
        rows = torch.arange(hidden.shape[0], device=hidden.device).view(-1, 1)

        def gather(span: slice) -> TokenInputs:
            take = slot_positions[:, span].clamp(min=0)
            return TokenInputs(hidden[rows, take], rope[rows, take])

        return gather

    def _maybe_compact(self) -> None:
        """Copy live slots to the front of smaller buffers once over a third of width is empty."""
        if not self.store.compactable:
            return
        moved = self.slots.compaction()
        if moved is None:
            return
        index, capacity = moved
        self.store.reindex(index, capacity)
        self.eviction.reindex(index, capacity)


def _rope_positions(
    hidden: torch.Tensor, rope: torch.Tensor | None, start: int, length: int
) -> torch.Tensor:
    """(B, length) RoPE positions of a call: the model's ``position_ids``, or HF's default
    ``arange`` from ``start`` when it passed none."""
    if rope is None:
        rope = torch.arange(start, start + length, device=hidden.device)
    return rope.expand(hidden.shape[0], -1)
