"""Step extensions of a cache layer: recall of evicted tokens (beyond the paper).

SWA's eviction is final in the paper: a token that left the kept set gets no attention, so its
score stays zero. :class:`Recall` keeps evicted keys/values in an INT8 host pool
(:class:`~alisa.storage.recall.RecallPool`); every ``every`` decode steps the current query is
scored against the pool, with the kept tokens' softmax normaliser, and pool tokens that would get
more attention than the weakest unprotected kept tokens swap places with them (at most
``tokens`` per sequence per layer).
"""

from __future__ import annotations

import torch

from alisa.grouped import grouped_logits
from alisa.layer import AlisaLayer
from alisa.storage.recall import RecallPool, candidates


class Recall:
    """Recall for one layer: the pool of its evicted tokens and the periodic swap.

    Parameters
    ----------
    every
        Decode steps between recall rounds.
    tokens
        Most tokens swapped back per sequence and round.
    host
        Where the pool lives.
    """

    def __init__(self, every: int, tokens: int, host: torch.device) -> None:
        self.every, self.tokens, self.host = every, tokens, host
        self.reset()

    def reset(self) -> None:
        self.pool = RecallPool(self.host)
        self.steps = 0
        self.recalled = 0  # tokens swapped back in from the pool

    def on_evict(self, layer: AlisaLayer, rows, groups, slots) -> None:
        """Quantize the victims into the pool before their slots are emptied."""
        positions = layer.slots.positions
        keys, values = layer.store.read(positions)
        self.pool.add(rows, keys[rows, :, slots], values[rows, :, slots], positions[rows, 0, slots])

    def after_step(self, layer: AlisaLayer, query: torch.Tensor, scaling: float) -> None:
        self.steps += 1
        if self.steps % self.every == 0:
            self.recalled += self.swap(layer, query[:, :, -1:], scaling)

    def select_batch(self, indices: torch.Tensor) -> None:
        self.pool.select_batch(indices)

    def swap(self, layer: AlisaLayer, query: torch.Tensor, scaling: float) -> int:
        """Swap pool tokens in where the current query (B, H, 1, D) prefers them; returns how
        many were swapped."""
        pool = self.pool
        if pool.keys is None or self.tokens < 1:
            return 0
        slot_map, policy = layer.slots, layer.policy
        positions = slot_map.positions  # (B, 1, S)
        keys, values = layer.store.read(positions)
        logits = grouped_logits(query, keys, scaling)[:, :, :, 0]  # (B, Hkv, G, S)
        occupied = positions >= 0  # (B, 1, S)
        logits = logits.masked_fill(~occupied.unsqueeze(2), float("-inf"))
        normaliser = torch.logsumexp(logits, dim=-1, keepdim=True)
        kept_score = torch.exp(logits - normaliser).sum(dim=(1, 2))  # (B, S)
        pool_keys, pool_values, pool_positions = pool.read(query.device)
        score = candidates(query, pool_keys, pool_positions, normaliser, scaling)  # (B, P)
        budget = policy.budget(slot_map.lengths())
        recent = torch.as_tensor(policy.recent(budget), device=query.device)
        first = torch.as_tensor(slot_map.first, device=query.device)
        movable = occupied & ~policy.protected(positions, first, slot_map.seen, recent)
        weakest = kept_score.masked_fill(~movable[:, 0], float("inf"))
        count = min(self.tokens, score.shape[1], weakest.shape[1])
        best = torch.topk(score, count, dim=1)  # strongest pool tokens, descending
        worst = torch.topk(weakest, count, dim=1, largest=False)  # weakest kept, ascending
        swap = best.values > worst.values  # pair the best candidate with the weakest kept token
        rows, ranks = swap.nonzero(as_tuple=True)
        if rows.numel() == 0:
            return 0
        slots, columns = worst.indices[rows, ranks], best.indices[rows, ranks]
        out_keys, out_values = keys[rows, :, slots].clone(), values[rows, :, slots].clone()
        out_positions = positions[rows, 0, slots].clone()
        layer.store.write_entries(
            rows, slots, pool_keys[rows, :, columns], pool_values[rows, :, columns], slot_map.seen
        )
        positions[rows, 0, slots] = pool_positions[rows, columns]
        zero = torch.zeros_like(rows)
        layer.eviction.replace(rows, zero, slots, best.values[rows, ranks])
        pool.remove(rows, columns)
        pool.add(rows, out_keys, out_values, out_positions)
        return int(rows.numel())
