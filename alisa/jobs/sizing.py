"""Predicted peak memory of one batch, and the largest batch that fits a byte budget.

Counted: weights, every layer's KV store after sparsity and quantization (kept tokens plus the
slot headroom the cache allocates), and the prefill transient (one layer's full-precision prompt
KV, the layer activations, the padding mask and the logits). The same arithmetic serves the
ALISA cache and, with r = 1 and 16 bits, HF's ``DynamicCache`` (whose concatenation briefly
holds one layer twice).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from alisa.config import AlisaConfig
from alisa.storage.store import headroom
from scheduler import ModelSpec, layers_kept

SAFETY = 1.10  # allocator slack on activations


@dataclass(frozen=True, kw_only=True)
class BatchMemory:
    """Predicted bytes of one batch."""

    weights: int
    kv: int
    transient: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.transient


def kept_tokens(
    config: AlisaConfig | None,
    num_layers: int,
    tokens: int,
    windows: Sequence[int | None] = (),
) -> np.ndarray:
    """(num_layers,) tokens a sequence keeps in each layer after ``tokens`` seen.

    The cache's own budget rule (:meth:`AlisaConfig.keep_rules`): ratio or token budget, sinks,
    pyramid scales and dense layers; ``config=None`` (HF's cache) keeps every token. Either way a
    layer with a sliding window (``windows``, as :attr:`scheduler.ModelSpec.windows`) holds at
    most its window.
    """
    rules = (config or AlisaConfig()).keep_rules(num_layers, windows)
    return layers_kept(rules, np.int64(tokens))


def batch_memory(
    spec: ModelSpec, config: AlisaConfig | None, batch: int, prompt_len: int, new_tokens: int
) -> BatchMemory:
    """Peak bytes of generating ``new_tokens`` for ``batch`` prompts of ``prompt_len`` tokens.

    ``config=None`` sizes HF's ``DynamicCache``: every token, model dtype, no headroom.
    """
    total = prompt_len + new_tokens
    full_token = spec.kv_bytes_per_token(16)
    layer_full = full_token / spec.num_layers
    if config is None:
        held = int(
            kept_tokens(None, spec.num_layers, total, spec.windows).sum()
        )  # every token, windows bounded
        kv = batch * held * layer_full + batch * total * layer_full  # cat holds a layer twice
    else:
        # Each layer allocates its kept tokens plus headroom; layers keep different counts.
        kept = kept_tokens(config, spec.num_layers, total, spec.windows).tolist()
        slots = [count + headroom(count) for count in kept]
        kv = batch * sum(slots) * spec.kv_bytes_per_token(config.kv_bits) / spec.num_layers
        if config.kv_bits < 16:
            residual = sum(min(config.residual_tokens, count) for count in slots)
            kv += batch * residual * layer_full
        if config.retention == "host":  # every token's key sketch stays on the device
            kv += batch * total * spec.sketch_bytes_per_token()
    element = spec.bytes_per_element
    activations = batch * prompt_len * (4 * spec.hidden_size + 2 * spec.intermediate_size) * element
    mask = batch * prompt_len * prompt_len  # boolean padding mask of the prefill
    prompt_layer = batch * prompt_len * layer_full  # the layer being prefilled, uncompressed
    logits = batch * spec.vocab_size * 4
    transient = int(SAFETY * (activations + mask + logits) + prompt_layer)
    return BatchMemory(weights=spec.total_weight_bytes, kv=int(kv), transient=transient)


def fits(memory: BatchMemory, budget: int | None, kv_budget: int | None) -> bool:
    """Whether predicted memory stays within the total and the KV budgets (None: no limit)."""
    return (budget is None or memory.total <= budget) and (
        kv_budget is None or memory.kv <= kv_budget
    )


def largest_batch(
    spec: ModelSpec,
    config: AlisaConfig | None,
    budget: int | None,
    prompt_len: int,
    new_tokens: int,
    limit: int,
    kv_budget: int | None = None,
) -> int:
    """The largest batch (<= limit) that :func:`fits` both budgets; 0 if none."""
    low, high = 0, limit
    while low < high:
        middle = (low + high + 1) // 2
        if fits(batch_memory(spec, config, middle, prompt_len, new_tokens), budget, kv_budget):
            low = middle
        else:
            high = middle - 1
    return low
