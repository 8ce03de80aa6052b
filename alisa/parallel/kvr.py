"""KV-Runahead prefill (https://arxiv.org/abs/2405.05329) and the TSP all-gather baseline.

Rank i runs the model on tokens [b_i, b_{i+1}) with their true positions and an explicit causal
mask offset by b_i. Per layer it receives the K/V of tokens [0, b_i) from rank i-1, appends its
own and sends the result to rank i+1 (non-blocking, in layer order), so only the last rank ends
with the whole cache. Receives are posted up front, so a rank never waits for a send it does not
need. The caches below only exchange K/V in ``update``; model code is untouched.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers import DynamicCache

from alisa.kv.cache import AlisaCache
from alisa.model.adapter import model_shape


class _Chain:
    """The K/V relay of one prefill: receive prefix from rank-1, send prefix+own to rank+1."""

    def __init__(self, bounds: list[int], shape: tuple[int, int, int], dtype, device, layers: int):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.bounds = bounds
        self.sends: list = []
        self.received: list = []
        self.bytes_sent = 0
        batch, heads, head_dim = shape
        if self.rank > 0:
            prefix = bounds[self.rank]
            for layer in range(layers):
                keys = torch.empty(batch, heads, prefix, head_dim, dtype=dtype, device=device)
                values = torch.empty_like(keys)
                handles = (
                    dist.irecv(keys, self.rank - 1, tag=2 * layer),
                    dist.irecv(values, self.rank - 1, tag=2 * layer + 1),
                )
                self.received.append((keys, values, handles))

    def exchange(self, layer: int, keys: torch.Tensor, values: torch.Tensor):
        if self.rank > 0:
            prefix_keys, prefix_values, handles = self.received[layer]
            for handle in handles:
                handle.wait()
            keys = torch.cat([prefix_keys, keys], dim=2)
            values = torch.cat([prefix_values, values], dim=2)
            self.received[layer] = None  # the concatenation holds them now
        if self.rank < self.world - 1:
            keys, values = keys.contiguous(), values.contiguous()
            self.sends.append(dist.isend(keys, self.rank + 1, tag=2 * layer))
            self.sends.append(dist.isend(values, self.rank + 1, tag=2 * layer + 1))
            self.bytes_sent += keys.nbytes + values.nbytes
        return keys, values

    def finish(self) -> None:
        for handle in self.sends:
            handle.wait()
        self.sends.clear()


class _Relaying:
    """Relays K/V along the chain in ``update`` until :meth:`finish_prefill` (a cache mixin)."""

    chain: _Chain | None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.chain is not None:
            key_states, value_states = self.chain.exchange(layer_idx, key_states, value_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def finish_prefill(self) -> None:
        """Wait for this rank's sends; later updates (decode) stay local."""
        self.chain.finish()
        self.chain = None


class RunaheadDynamicCache(_Relaying, DynamicCache):
    """HF dynamic cache that relays K/V along the chain during one prefill."""

    def __init__(self, chain: _Chain, **kwargs) -> None:
        super().__init__(**kwargs)
        self.chain = chain


class RunaheadAlisaCache(_Relaying, AlisaCache):
    """The last rank's cache: the relayed full prompt goes straight into the ALISA cache."""

    def __init__(self, model, config, chain: _Chain, **kwargs) -> None:
        super().__init__(model, config, **kwargs)
        self.chain = chain


class AllGatherCache(DynamicCache):
    """TSP baseline: every rank all-gathers every chunk's K/V per layer (even chunks)."""

    def __init__(self, bounds: list[int], **kwargs) -> None:
        super().__init__(**kwargs)
        self.bounds = bounds
        self.bytes_sent = 0
        self.gathering = True  # off after prefill: decode is local to the last rank

    def finish_prefill(self) -> None:
        """Later updates (decode) stay local to this rank."""
        self.gathering = False

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if not self.gathering:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        rank, world = dist.get_rank(), dist.get_world_size()
        width = max(b - a for a, b in zip(self.bounds[:-1], self.bounds[1:], strict=True))
        pieces = []
        for tensor in (key_states, value_states):
            padded = torch.nn.functional.pad(
                tensor, (0, 0, 0, width - tensor.shape[2])
            ).contiguous()
            gathered = [torch.empty_like(padded) for _ in range(world)]
            dist.all_gather(gathered, padded)
            self.bytes_sent += padded.nbytes * (world - 1)
            lengths = [b - a for a, b in zip(self.bounds[:-1], self.bounds[1:], strict=True)]
            pieces.append(
                torch.cat(
                    [g[:, :, :n] for g, n in zip(gathered[: rank + 1], lengths, strict=False)],
                    dim=2,
                )
            )
        return super().update(pieces[0], pieces[1], layer_idx, *args, **kwargs)


def chunk_mask(bounds: list[int], rank: int, batch: int, dtype, device) -> torch.Tensor:
    """(B, 1, c_i, b_{i+1}) additive causal mask of rank i's queries over keys [0, b_{i+1})."""
    start, stop = bounds[rank], bounds[rank + 1]
    queries = torch.arange(start, stop, device=device).view(-1, 1)
    keys = torch.arange(stop, device=device).view(1, -1)
    mask = torch.zeros(stop - start, stop, dtype=dtype, device=device)
    mask.masked_fill_(keys > queries, torch.finfo(dtype).min)
    return mask.expand(batch, 1, -1, -1)


@torch.inference_mode()
def chunk_forward(model, input_ids: torch.Tensor, bounds: list[int], cache) -> torch.Tensor:
    """Run this rank's chunk through the model with offset positions and mask; last logits."""
    rank = dist.get_rank()
    start, stop = bounds[rank], bounds[rank + 1]
    batch = input_ids.shape[0]
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    chunk = input_ids[:, start:stop].to(device)
    positions = torch.arange(start, stop, device=device).expand(batch, -1)
    mask = chunk_mask(bounds, rank, batch, dtype, device)
    out = model(
        input_ids=chunk,
        position_ids=positions,
        attention_mask=mask,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[:, -1]


def new_chain(model, bounds: list[int], batch: int) -> _Chain:
    shape = model_shape(model)
    parameter = next(model.parameters())
    return _Chain(
        bounds,
        (batch, shape.num_kv_heads, shape.head_dim),
        parameter.dtype,
        parameter.device,
        shape.num_layers,
    )
