"""Sharded decode (LoongServe-style multi-master, https://arxiv.org/abs/2404.09526, §4).

After KV-Runahead prefill every rank keeps the K/V of its own chunk; the last rank (the master)
keeps its chunk plus every new token. Per layer and step the master broadcasts the query, each
rank returns its partial output and log-sum-exp over its shard, and the master merges them:
out = sum_i exp(lse_i - lse) out_i. The merge is exact for dense attention.

With a sparse policy each shard evicts within its own budget (round(n_shard * r)), by the attention
its shard receives normalised within the shard: an APPROXIMATION of single-process SWA, whose
top-k is global. ``probes.bench_parallel`` measures how far it drifts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from alisa.config import AlisaConfig, policy_for_layer
from alisa.kv.drop import DropKeeper
from alisa.kv.grouped import grouped_logits
from alisa.kv.layer import AlisaLayer

SHARDED_ATTENTION = "alisa_sharded"


def make_shards(
    full_cache, bounds: list[int], config: AlisaConfig, num_layers: int
) -> list[AlisaLayer]:
    """This rank's shard of every layer: its own chunk's K/V, kept by the config's policy."""
    rank = dist.get_rank()
    start, stop = bounds[rank], bounds[rank + 1]
    shards = []
    for index in range(num_layers):
        policy = policy_for_layer(config, index, num_layers)
        layer = AlisaLayer(DropKeeper(policy), layer_idx=index)
        keys = full_cache.layers[index].keys[:, :, start:stop].contiguous()
        values = full_cache.layers[index].values[:, :, start:stop].contiguous()
        layer.update(keys, values)
        shards.append(layer)
    return shards


def partial_attention(layer: AlisaLayer, query: torch.Tensor, scaling: float):
    """(B, H, 1, D) output and (B, H, 1) log-sum-exp of ``query`` over one shard; then the
    shard's step hook (account attention, evict), as the ``alisa`` attention function does."""
    positions = layer.slot_positions()
    keys, values = layer.store.read(positions)
    batch, heads, length, head_dim = query.shape
    logits = grouped_logits(query, keys, scaling)  # (B, Hkv, G, q, S)
    visible = (positions >= 0)[:, :, None, None, :]  # (B, 1, 1, 1, S)
    logits = logits.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    probabilities = torch.exp(logits - lse)
    flat = probabilities.flatten(2, 3)  # (B, Hkv, G*q, S)
    output = torch.matmul(flat.to(values.dtype), values)
    layer.after_attention(query, probabilities)
    return output.reshape(batch, heads, length, head_dim), lse.reshape(batch, heads, length)


def merge(outputs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Exact softmax merge of partial attentions: (B, H, 1, D) outputs, (B, H, 1) lse each."""
    stacked = torch.stack(lses)  # (P, B, H, 1)
    weights = torch.softmax(stacked, dim=0).unsqueeze(-1)  # exp(lse_i - lse)
    return (torch.stack([o.float() for o in outputs]) * weights).sum(dim=0)


class ShardContext:
    """Communication state of sharded decode (held by the master's attention calls)."""

    def __init__(self, shards: list[AlisaLayer], query_shape: tuple, dtype, scalings: list[float]):
        self.shards, self.query_shape, self.dtype, self.scalings = (
            shards,
            query_shape,
            dtype,
            scalings,
        )
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.master = self.world - 1

    def exchange(self, layer_idx: int, query: torch.Tensor) -> torch.Tensor:
        """Broadcast the query, compute this rank's part, gather and (on the master) merge."""
        query = query.contiguous()
        dist.broadcast(query, src=self.master)
        output, lse = partial_attention(self.shards[layer_idx], query, self.scalings[layer_idx])
        packed = torch.cat([output.float().flatten(), lse.float().flatten()])
        gathered = (
            [torch.empty_like(packed) for _ in range(self.world)]
            if self.rank == self.master
            else None
        )
        dist.gather(packed, gathered, dst=self.master)
        if self.rank != self.master:
            return output
        split = output.numel()
        outputs = [g[:split].view_as(output) for g in gathered]
        lses = [g[split:].view_as(lse) for g in gathered]
        return merge(outputs, lses)

    def serve(self) -> None:
        """Non-master ranks: answer queries until the master says stop."""
        control = torch.zeros(1, dtype=torch.long)
        query = torch.empty(self.query_shape, dtype=self.dtype, device=self.shards[0].device)
        while True:
            dist.broadcast(control, src=self.master)
            if int(control) == 0:
                return
            for index in range(len(self.shards)):
                self.exchange(index, query)

    def announce(self, more: bool) -> None:
        """Master: tell the others whether another decode step follows."""
        dist.broadcast(torch.tensor([1 if more else 0], dtype=torch.long), src=self.master)


class MasterShardCache(Cache):
    """The master's cache during sharded decode: new tokens go into its own shard."""

    def __init__(self, context: ShardContext, seen: int) -> None:
        super().__init__(layers=[_Passthrough(shard, seen) for shard in context.shards])
        self.context = context


class _Passthrough(CacheLayerMixin):
    """Cache-layer face of a master shard: appends the new token, reports global lengths."""

    is_sliding = False
    is_compileable = False

    def __init__(self, shard: AlisaLayer, seen: int) -> None:
        super().__init__()
        self.shard, self.seen = shard, seen
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        return None

    def update(self, keys, values, *args, **kwargs):
        self.shard.update(keys, values)
        self.seen += keys.shape[2]
        return keys, values

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, self.seen

    def get_max_length(self) -> int:
        return -1


def sharded_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs
):
    """Master-side attention: the exchange with every shard, merged exactly."""
    context: ShardContext = kwargs["shard_context"]
    merged = context.exchange(module.layer_idx, query)
    return merged.to(query.dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register(SHARDED_ATTENTION, sharded_attention)
AttentionMaskInterface.register(SHARDED_ATTENTION, sdpa_mask)
