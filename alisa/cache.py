"""``AlisaCache``: a transformers ``Cache`` whose layers keep only what the KV policy selects."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from transformers.cache_utils import Cache

from alisa.architecture import ModelShape, model_shape
from alisa.attention import ATTENTION_NAME, attach
from alisa.config import AlisaConfig, policy_for_layer
from alisa.layer import AlisaLayer
from alisa.quant_store import QuantizedStore
from alisa.recall import RecallPool
from alisa.store import DenseStore, StoreFactory
from quant import check_options


class AlisaCache(Cache):
    """KV cache that evicts by policy (ALISA SWA, H2O, TOVA, ...) during prefill and decode.

    Use it wherever HF takes a cache::

        cache = AlisaCache(model, AlisaConfig(policy="swa", caching_ratio=0.2))
        model.generate(**inputs, past_key_values=cache)

    Building it routes the model's attention through the ``alisa`` attention function (see
    :func:`alisa.attention.attach`), which is plain SDPA for any other cache. One cache serves one
    generation (one batch of sequences).

    Parameters
    ----------
    model
        A decoder-only HF model with full attention in every layer (Llama family, GPT-2, OPT, ...).
    config
        Policy, caching ratio and storage options.
    """

    def __init__(
        self, model: nn.Module, config: AlisaConfig | None = None, *, max_new_tokens: int = 256
    ) -> None:
        self.config = config or AlisaConfig()
        self.shape: ModelShape = model_shape(model)
        factory = store_factory(self.config, self.shape)
        layers = [
            AlisaLayer(
                policy_for_layer(self.config, index, self.shape.num_layers),
                per_head=self.config.per_head,
                store_factory=factory,
            )
            for index in range(self.shape.num_layers)
        ]
        super().__init__(layers=layers)
        self.planner = None
        if self.config.gpu_memory is not None:
            self.planner = _planner(model, self.shape, self.config, factory, max_new_tokens)
        for index, layer in enumerate(layers):
            layer.layer_idx = index
            layer.tiering = self.planner
            # Prefetch the next layer's host tier while this one runs (pointless with <= 2 layers).
            layer.next_layer = layers[(index + 1) % len(layers)] if len(layers) > 2 else None
            if self.config.recall_every and layer.policy.can_evict():
                layer.recall = RecallPool(torch.device("cpu"))
                layer.recall_every, layer.recall_tokens = (
                    self.config.recall_every,
                    self.config.recall_tokens,
                )
        attach(model)
        self._model_config = model.config

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if layer_idx == 0 and self._model_config._attn_implementation != ATTENTION_NAME:
            # Another attention function would read the slot buffers without their mask.
            raise ValueError(
                f"attn_implementation={self._model_config._attn_implementation!r} is incompatible "
                f"with AlisaCache, which needs {ATTENTION_NAME!r} (set when the cache is built)"
            )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def kv_bytes(self) -> int:
        """Bytes of key/value buffers held by all layers (spare capacity included)."""
        return sum(layer.kv_bytes() for layer in self.layers)

    def state_bytes(self) -> int:
        """Bytes of bookkeeping held besides K/V: slot positions and attention sums."""
        return sum(layer.state_bytes() for layer in self.layers)

    def stored_tokens(self) -> int:
        """Tokens stored over all layers and sequences (KV heads counted when per head)."""
        return sum(layer.stored_tokens() for layer in self.layers)

    def tier_bytes(self) -> dict[str, int]:
        """KV bytes per tier: device, host, recompute (hidden states); all on device if untiered."""
        totals = {"device": 0, "host": 0, "recompute": 0}
        for layer in self.layers:
            store = layer.store
            parts = (
                store.tier_bytes() if hasattr(store, "tier_bytes") else {"device": layer.kv_bytes()}
            )
            for tier, count in parts.items():
                totals[tier] += count
        return totals

    def tier_tokens(self) -> dict[str, int]:
        """Stored tokens per tier (device, host, recompute) over all layers and sequences."""
        totals = {"device": 0, "host": 0, "recompute": 0}
        for layer in self.layers:
            offset = 0
            for tier, slots in getattr(layer.store, "regions", [("device", layer.store.capacity)]):
                totals[tier] += int((layer.positions[..., offset : offset + slots] >= 0).sum())
                offset += slots
        return totals

    def evicted_tokens(self) -> int:
        """Tokens evicted so far over all layers and sequences."""
        return sum(layer.evicted for layer in self.layers)


def store_factory(config: AlisaConfig, shape: ModelShape) -> StoreFactory:
    """Dense storage for ``kv_bits=16``, else INT8/INT4 storage checked against the head size."""
    if config.kv_bits == 16:
        return DenseStore
    group = config.quant_group_size or shape.head_dim
    try:
        check_options(config.kv_bits, group, shape.head_dim)
    except ValueError as error:
        raise ValueError(f"quant_group_size={config.quant_group_size!r}: {error}") from None
    return partial(
        QuantizedStore,
        bits=config.kv_bits,
        group_size=group,
        residual_tokens=config.residual_tokens,
    )


def _planner(model, shape: ModelShape, config: AlisaConfig, factory, max_new_tokens: int):
    from alisa.planning import TierPlanner
    from alisa.recompute import KVRecomputer

    recomputer = None
    if config.recompute != "never":
        try:
            recomputer = KVRecomputer(model)
        except ValueError:
            if config.recompute == "always":
                raise
    region = partial(factory, groups=1)
    return TierPlanner(model, shape, config, region, recomputer, max_new_tokens)
