"""One layer of the ALISA cache: which token sits in which slot, and eviction by policy.

Slots are preallocated. A decode step writes its token into a slot freed by an earlier eviction
(or appends), so the per-step cost never copies the cache; the buffers are compacted only when
much of them is empty (after prefill eviction, or a long shrink), an amortised copy. Evicted tokens
are really gone: their slot is overwritten by the next token, and compaction returns the memory.

Coordinates: ``seen`` counts tokens of the padded batch (left padding included), so a token's
position is its index in the padded sequence, the same for every sequence of the batch.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers.cache_utils import CacheLayerMixin

from alisa.accumulator import AttentionAccumulator
from alisa.policies import KVPolicy
from alisa.store import DenseStore, KVStore, StoreFactory

FREE = -1  # slot holds nothing; may be reused
PAD = -2  # slot holds a left-padding token; masked, reclaimed at the next compaction


def headroom(slots: int) -> int:
    """Spare slots allocated beyond what is stored: growth in chunks of 1/8, at least 32."""
    return max(32, slots // 8)


class AlisaLayer(CacheLayerMixin):
    """KV of one attention layer, kept by a :class:`~alisa.policies.KVPolicy`.

    Parameters
    ----------
    policy
        Decides budgets and token scores for this layer.
    per_head
        One index set per KV head instead of one per layer (and sequence).
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(
        self, policy: KVPolicy, *, per_head: bool = False, store_factory: StoreFactory = DenseStore
    ) -> None:
        super().__init__()
        self.policy = policy
        self.per_head = per_head
        self.store_factory = store_factory
        self.store: KVStore | None = None
        self.scores: AttentionAccumulator | None = None
        self.positions: torch.Tensor | None = None  # (B, Hs, capacity) int64
        self.seen = 0
        self.width = 0  # slots [0, width) may be occupied; the rest are free
        self.first = np.zeros(0, dtype=np.int64)  # (B,) position of the first real token
        self.kept = np.zeros(0, dtype=np.int64)  # (B,) tokens stored (per group)
        self.dead = np.zeros(0, dtype=np.int64)  # (B,) padding slots still held
        self.evicted = 0  # tokens evicted so far, all sequences and groups
        self.prefilling = False  # the last update started the cache (dense prefill attention)
        self.layer_idx = 0
        self.recall = None  # RecallPool of evicted tokens, when recall is on
        self.recall_every = 0
        self.recall_tokens = 0
        self.decode_steps = 0
        self.recalled = 0  # tokens swapped back in from the recall pool
        self.tiering = None  # set by the cache when KV must be split over device/host/recompute
        self.next_layer: AlisaLayer | None = None  # whose host tier to prefetch after this one
        # Attention input and RoPE positions of the current call (tiers that recompute keep them).
        self.inputs: tuple[torch.Tensor, torch.Tensor | None] | None = None

    # ---- HF cache-layer interface -------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads = key_states.shape[:2]
        self.groups = heads if self.per_head else 1
        self.first = np.zeros(batch, dtype=np.int64)
        self.kept = np.zeros(batch, dtype=np.int64)
        self.dead = np.zeros(batch, dtype=np.int64)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new tokens and return the K/V this step's attention reads.

        Prefill returns the new tensors themselves (dense attention, as HF); later steps return
        the (B, H_kv, capacity, D) slot buffers, empty slots masked by the attention.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = key_states.shape[2]
        self.prefilling = self.store is None
        if self.prefilling:
            self._start(key_states, value_states)
            return key_states, value_states
        if length == 1:
            self._write_one(key_states, value_states)
        else:
            self._append(key_states, value_states)
        if getattr(self.store, "takes_parts", False):
            return key_states, value_states  # the attention fetches every tier's part itself
        return self.store.read(self.positions)

    def parts(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(K, V) per storage region, on the model's device, in slot order."""
        return self.store.parts(self.positions)

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Stored slots plus the query, offset so HF's mask builder stays inside the 2D mask;
        # the ALISA attention builds its own mask from slot positions after prefill.
        return self.width + query_length, self.seen - self.width

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        kept = (
            self.tiering,
            self.layer_idx,
            self.next_layer,
            self.recall,
            self.recall_every,
            self.recall_tokens,
        )
        self.__init__(self.policy, per_head=self.per_head, store_factory=self.store_factory)
        (
            self.tiering,
            self.layer_idx,
            self.next_layer,
            recall,
            self.recall_every,
            self.recall_tokens,
        ) = kept
        self.recall = type(recall)(recall.host) if recall is not None else None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only some sequences of the batch (in the given order)."""
        if self.store is None:
            return
        indices = indices.to(self.device)
        host = indices.cpu().numpy()
        self.store.select_batch(indices)
        self.positions = self.positions.index_select(0, indices)
        if self.scores is not None:
            self.scores.select_batch(indices)
        self.first, self.kept, self.dead = self.first[host], self.kept[host], self.dead[host]
        if self.recall is not None:
            self.recall.select_batch(indices)

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "AlisaCache cannot be cropped (evicted tokens cannot be restored); assisted and "
            "speculative decoding need a DynamicCache"
        )

    # ---- what attention and callers use -------------------------------------------------

    @property
    def needs_attention(self) -> bool:
        """Whether attention probabilities must reach the policy (never when nothing is evicted)."""
        return self.policy.needs_attention and self.policy.can_evict()

    def slot_positions(self) -> torch.Tensor:
        """(B, Hs, capacity) position of each slot's token (negative: empty or padding)."""
        return self.positions

    def stored_tokens(self) -> int:
        """Tokens stored, summed over sequences (and over KV heads when selecting per head)."""
        return int(self.kept.sum()) * self.groups if self.store is not None else 0

    def kv_bytes(self) -> int:
        """Bytes of key/value buffers held, spare capacity included."""
        return self.store.nbytes() if self.store is not None else 0

    def state_bytes(self) -> int:
        """Bytes of bookkeeping: slot positions and attention sums."""
        if self.store is None:
            return 0
        scores = self.scores.nbytes() if self.scores is not None else 0
        return self.positions.nbytes + scores

    def mark_padding(self, valid: torch.Tensor) -> None:
        """Flag left-padding slots of the prefill; valid is (B, q) bool over the prefill tokens."""
        if bool(valid.all()):
            return
        length = valid.shape[1]
        pads = (~valid).to(self.positions.device)
        region = self.positions[..., self.width - length : self.width]
        region.masked_fill_(pads.unsqueeze(1), PAD)
        counts = pads.sum(dim=1).cpu().numpy().astype(np.int64)
        self.dead += counts
        self.kept -= counts
        # Left padding: a sequence's first real token follows its pads.
        self.first = self.first + counts

    def scored_rows_wanted(self) -> int | None:
        """Prompt query rows to seed attention scores with: None = all, 0 = none."""
        if not self.needs_attention:
            return 0
        window = self.policy.score_window(self.policy.recent(self._budget()))
        return None if window is None else int(window.max())

    def add_attention(self, rows: torch.Tensor) -> None:
        """Account attention rows (B, Hs, R, S') of R consecutive queries over slots [0, S')."""
        if self.scores is None:
            return
        window = self.policy.score_window(self.policy.recent(self._budget()))
        if rows.shape[2] == 1:
            self.scores.add(rows[:, :, 0], window)
        else:
            self.scores.add_rows(rows, window)

    def evict(self) -> None:
        """Drop each sequence's excess tokens, lowest policy score first, sinks/recent protected."""
        if not self.policy.can_evict():
            return
        budget = self._budget()
        excess = np.maximum(self.kept - budget, 0)
        if excess.max(initial=0) > 0:
            self._drop(excess, budget)
        self._maybe_compact()

    # ---- internals -------------------------------------------------------------------

    def _budget(self) -> np.ndarray:
        return self.policy.budget(self.seen - self.first)

    def _start(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        batch, heads, length, _ = keys.shape
        capacity = length + headroom(length)
        self.store = self.store_factory(keys, values, capacity, groups=self.groups)
        positions = torch.arange(capacity, device=self.device)
        positions = torch.where(positions < length, positions, FREE)
        self.positions = positions.expand(batch, self.groups, capacity).contiguous()
        if self.needs_attention:
            window = self.policy.score_window(np.ones(batch, dtype=np.int64))
            self.scores = AttentionAccumulator(
                batch, self.groups, capacity, self.device, windowed=window is not None
            )
        self.seen = self.width = length
        self.kept += length

    def _write_one(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        holes = self.width - self.kept - self.dead  # (B,) free slots below width
        append = holes <= 0
        if append.any():
            self._ensure_capacity(self.width + 1)
        if append.all():  # every sequence appends at the frontier: plain slice writes
            self.store.write_range(self.width, keys, values, self.seen, **self._inputs(1))
            self.positions[..., self.width] = self.seen
        else:
            free = self.positions[..., : self.width] == FREE
            first_free = free.to(torch.int8).argmax(dim=-1, keepdim=True)  # (B, Hs, 1)
            appended = torch.as_tensor(append, device=self.device).view(-1, 1, 1)
            slots = torch.where(appended, self.width, first_free)
            self.store.write_slots(slots, keys, values, self.seen, **self._inputs(1))
            self.positions.scatter_(-1, slots, self.seen)
        if append.any():
            self.width += 1
        self.seen += 1
        self.kept += 1

    def _append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        length = keys.shape[2]
        self._ensure_capacity(self.width + length)
        self.store.write_range(self.width, keys, values, self.seen, **self._inputs(length))
        new = torch.arange(self.seen, self.seen + length, device=self.device)
        self.positions[..., self.width : self.width + length] = new
        # Sequences whose slots below width are not all used get holes: account them as free.
        self.width += length
        self.seen += length
        self.kept += length

    def _ensure_capacity(self, slots: int) -> None:
        capacity = self.store.capacity
        if slots <= capacity:
            return
        capacity = slots + headroom(slots)
        self.store.grow(capacity)
        grown = torch.full(
            (*self.positions.shape[:2], capacity - self.positions.shape[-1]),
            FREE,
            dtype=self.positions.dtype,
            device=self.device,
        )
        self.positions = torch.cat([self.positions, grown], dim=-1)
        if self.scores is not None:
            self.scores.grow(capacity)

    def _drop(self, excess: np.ndarray, budget: np.ndarray) -> None:
        policy = self.policy
        positions = self.slot_positions()
        first = torch.as_tensor(self.first, device=self.device)
        recent = torch.as_tensor(policy.recent(budget), device=self.device)
        attention = None
        if self.scores is not None:
            window = policy.score_window(policy.recent(budget))
            attention = self.scores.window_sum(window, self.store.capacity)
        score = policy.score(positions, attention, first).to(torch.float32)
        keep_first = policy.protected(positions, first, self.seen, recent) | (positions < 0)
        priority = torch.where(keep_first, torch.inf, score)
        count = int(excess.max())
        victims = torch.topk(priority, count, dim=-1, largest=False, sorted=True).indices
        wanted = torch.arange(count, device=self.device).view(1, 1, -1)
        valid = wanted < torch.as_tensor(excess, device=self.device).view(-1, 1, 1)
        rows, groups, ranks = valid.nonzero(as_tuple=True)
        slots = victims[rows, groups, ranks]
        if self.recall is not None:
            keys, values = self.store.read(self.positions)
            self.recall.add(
                rows, keys[rows, :, slots], values[rows, :, slots], self.positions[rows, 0, slots]
            )
        self.positions[rows, groups, slots] = FREE
        if self.scores is not None:
            self.scores.clear_slots(rows, groups, slots)
        self.kept -= excess
        self.evicted += int(excess.sum()) * self.groups

    def _inputs(self, length: int) -> dict:
        """Attention inputs and RoPE positions of the new tokens, for stores that recompute."""
        if not getattr(self.store, "takes_inputs", False):
            return {}
        hidden, rope = self.inputs
        if rope is None:  # HF's default positions: arange from the tokens seen
            rope = torch.arange(self.seen, self.seen + length, device=hidden.device)
        return {"hidden": hidden, "rope": rope.expand(hidden.shape[0], -1)}

    def finish_prefill(self) -> None:
        """After prefill eviction: split the kept tokens over the tiers, if the cache has tiers."""
        if self.tiering is None:
            return
        hidden, rope = self.inputs if self.inputs is not None else (None, None)
        if hidden is not None:
            if rope is None:  # HF's default positions: 0..L-1
                rope = torch.arange(self.seen, device=hidden.device)
            rope = rope.expand(hidden.shape[0], -1)
        self.store, mapping, self.width = self.tiering.split(self, self.store, hidden, rope)
        self.inputs = None  # the prompt's hidden states are no longer needed
        # Slots moved: old slot mapping[j] is now slot j (-1: nothing there).
        taken = mapping.clamp(min=0).view(1, 1, -1).expand(*self.positions.shape[:2], -1)
        moved = self.positions.gather(-1, taken)
        self.positions = torch.where(mapping >= 0, moved, FREE).contiguous()
        if self.scores is not None:
            self.scores.reindex(taken)
            empty = (mapping < 0).nonzero(as_tuple=True)[0]
            batch = torch.arange(self.positions.shape[0], device=self.device)
            rows = batch.repeat_interleave(empty.numel())
            self.scores.clear_slots(rows, torch.zeros_like(rows), empty.repeat(len(batch)))

    def _maybe_compact(self) -> None:
        """Copy live slots to the front of smaller buffers once over a third of width is empty."""
        if not getattr(self.store, "compactable", True):
            return
        live = int(self.kept.max(initial=0))  # compaction drops padding slots as well
        if self.width - live <= max(32, self.width // 3):
            return
        occupied = self.positions[..., : self.width] >= 0
        order = torch.argsort((~occupied).to(torch.int8), dim=-1, stable=True)
        keep = int(self.kept.max(initial=0))
        index = order[..., :keep]
        capacity = keep + headroom(keep)
        self.store.reindex(index, capacity)
        moved = self.positions.gather(-1, index)
        moved = torch.where(occupied.gather(-1, index), moved, FREE)
        self.positions = torch.nn.functional.pad(moved, (0, capacity - keep), value=FREE)
        if self.scores is not None:
            self.scores.reindex(index)
            self.scores.grow(capacity)
        self.width = keep
        self.dead[:] = 0
