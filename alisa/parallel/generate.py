"""Multi-process generation: KV-Runahead (or TSP) prefill, then local or sharded decode.

Call :func:`parallel_generate` on every rank of an initialised process group (torchrun, or
:func:`alisa.parallel.dist.spawn`); the last rank returns the :class:`GenerationOutput`, the
others None. A single process needs none of this: use :func:`alisa.runtime.generate`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from alisa.config import AlisaConfig, policy_for_layer
from alisa.model.adapter import ModelAdapter
from alisa.parallel.config import ParallelConfig
from alisa.parallel.kvr import (
    AllGatherCache,
    RunaheadAlisaCache,
    RunaheadDynamicCache,
    chunk_forward,
    new_chain,
)
from alisa.parallel.partition import (
    PartitionTable,
    attention_cost_model,
    even_split,
    grid_search,
    with_last_chunk,
)
from alisa.parallel.sharded import SHARDED_ATTENTION, MasterShardCache, ShardContext, make_shards
from alisa.runtime.engine import DecodeState, Engine, GenerationOutput, device_clock
from alisa.runtime.sampling import SamplingOptions


@dataclass
class PrefillResult:
    """What one rank's prefill produced."""

    logits: torch.Tensor
    cache: object
    bounds: list[int]
    ttft_s: float
    bytes_sent: int
    cpu_s: float


def check_consistent(length: int) -> None:
    """Every rank must see the same prompt length; a mismatch fails on all ranks at once."""
    mine = torch.tensor([length], dtype=torch.long)
    lengths = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(lengths, mine)
    seen = [int(t) for t in lengths]
    if len(set(seen)) != 1:
        raise ValueError(f"ranks disagree on the prompt length: {seen} (one prompt for all ranks)")


def choose_bounds(model, input_ids, parallel: ParallelConfig, config: AlisaConfig) -> list[int]:
    """Chunk boundaries for this prompt, the same on every rank.

    The last rank seeds the policy's scores from its own queries: its chunk is widened to the
    observation window, so the handover matches one process.
    """
    bounds = _partition(model, input_ids, parallel, config)
    if parallel.mode == "tsp":
        return bounds
    layers = ModelAdapter.of(model).shape.num_layers
    rows = max(policy_for_layer(config, i, layers).observation_window for i in range(layers))
    return with_last_chunk(bounds, rows)


def _partition(model, input_ids, parallel: ParallelConfig, config: AlisaConfig) -> list[int]:
    length, world = input_ids.shape[1], dist.get_world_size()
    if parallel.partition == "even" or parallel.mode == "tsp":
        return even_split(length, world)
    if parallel.partition == "table":
        table = PartitionTable.load(parallel.table_path, parallel.table_key)
        bounds = table.lookup(length)
        if len(bounds) != world + 1:
            raise ValueError(
                f"partition table {parallel.table_key!r} splits over {len(bounds) - 1} ranks; "
                f"the world has {world}"
            )
        return bounds

    def measure(bounds: list[int]) -> float:
        result = prefill(model, input_ids, bounds, ParallelConfig(mode="kvr"), AlisaConfig())
        cost = torch.tensor([result.ttft_s])
        dist.broadcast(cost, src=world - 1)  # the last rank's TTFT decides, for everyone
        return float(cost)

    best, _ = grid_search(
        measure, length, world, points=3, rounds=3, min_stride=max(8, length // 64)
    )
    return best


def prefill(
    model, input_ids, bounds, parallel: ParallelConfig, config: AlisaConfig
) -> PrefillResult:
    """This rank's prefill; on the last rank the cache holds the whole prompt."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = input_ids.shape[0]
    dist.barrier()
    device = input_ids.device
    wall, cpu = device_clock(device), time.process_time()
    if parallel.mode == "tsp":
        cache = AllGatherCache(bounds)
        logits = chunk_forward(model, input_ids, bounds, cache)
        cache.finish_prefill()
        sent = cache.bytes_sent
    else:
        chain = new_chain(model, bounds, batch)
        last = rank == world - 1 and parallel.decode == "local"
        cache = RunaheadAlisaCache(model, config, chain) if last else RunaheadDynamicCache(chain)
        logits = chunk_forward(model, input_ids, bounds, cache)
        cache.finish_prefill()
        sent = chain.bytes_sent
    ttft = device_clock(device) - wall
    return PrefillResult(logits, cache, bounds, ttft, sent, time.process_time() - cpu)


@torch.inference_mode()
def parallel_generate(
    model,
    tokenizer,
    prompt: str,
    config: AlisaConfig | None = None,
    parallel: ParallelConfig | None = None,
    *,
    max_new_tokens: int = 64,
    sampling: SamplingOptions | None = None,
) -> GenerationOutput | None:
    """Generate for one prompt with every rank of the process group; the last rank returns.

    Raises
    ------
    ValueError
        Ranks with different prompt lengths, a prompt shorter than the world, a partition table
        for another world size, ``retention="host"`` with sharded decode, a model with
        sliding-window layers.
    """
    config, parallel = config or AlisaConfig(), parallel or ParallelConfig()
    shape = ModelAdapter.of(model).shape
    if shape.hybrid:
        # The chunked prefill's masks and the shards' attention are full causal attention.
        raise ValueError(
            f"{type(model).__name__} has sliding-window layers; parallel prefill and sharded "
            "decode support full-attention models only"
        )
    if shape.extras:
        raise ValueError(
            f"{type(model).__name__}'s attention uses {' and '.join(shape.extras)}, which "
            "parallel prefill and sharded decode do not apply (one process does)"
        )
    if parallel.decode == "sharded" and config.retention == "host":
        # Shards evict within their own chunk; a host region per shard is not built.
        raise ValueError("retention='host' cannot be combined with parallel decode='sharded'")
    sampling = sampling or SamplingOptions()
    device = next(model.parameters()).device
    input_ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(device)
    check_consistent(input_ids.shape[1])
    bounds = choose_bounds(model, input_ids, parallel, config)
    result = prefill(model, input_ids, bounds, parallel, config)
    engine = Engine(model, tokenizer, sampling)
    if parallel.decode == "sharded":
        return _sharded_decode(model, engine, input_ids, result, config, max_new_tokens)
    if dist.get_rank() != dist.get_world_size() - 1:
        return None
    return engine.run(
        DecodeState.start(input_ids),
        result.cache,
        max_new_tokens,
        prefill_logits=result.logits,
        prefill_s=result.ttft_s,
    )


def _sharded_decode(
    model, engine: Engine, input_ids, result: PrefillResult, config, max_new_tokens
):
    """The master rank decodes; K/V stay on the ranks that prefilled them, which serve attention."""
    adapter = ModelAdapter.of(model)
    shape, scalings = adapter.shape, list(adapter.scalings)
    query_shape = (input_ids.shape[0], shape.num_heads, 1, shape.head_dim)
    shards = make_shards(result.cache, result.bounds, config, shape.num_layers)
    context = ShardContext(shards, query_shape, next(model.parameters()).dtype, scalings)
    if context.rank != context.master:
        context.serve()
        return None
    previous = model.config._attn_implementation
    model.set_attn_implementation(SHARDED_ATTENTION)
    try:
        return engine.run(
            DecodeState.start(input_ids),
            MasterShardCache(context, input_ids.shape[1]),
            max_new_tokens,
            prefill_logits=result.logits,
            prefill_s=result.ttft_s,
            kv_bytes=lambda: sum(s.kv_bytes() for s in shards),
            announce=context.announce,
            shard_context=context,
        )
    finally:
        model.set_attn_implementation(previous)


__all__ = ["ParallelConfig", "attention_cost_model", "parallel_generate", "prefill"]
