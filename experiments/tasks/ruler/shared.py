"""One prefill for every compared system, then each system's own greedy decode.

Every system's prefill computes the same thing: alisa's prefill attention is HF's dense SDPA,
so the hidden states, keys, values and first-token logits are those of the dense model, and
only what each cache keeps afterwards differs. A long prompt's prefill is most of a RULER
sample's CPU time (SmolLM2, 8K tokens: 28 s against about 3 s of decoding), so it is run once:
the ``alisa_fanout`` attention function computes the dense attention output and hands each
layer's (query, key, value) to every cache (an ``AlisaCache`` layer then does exactly what
``alisa_attention`` does at prefill, through :func:`alisa.kv.attention.prefill_layer`; an HF
cache stores the prompt). Each system then decodes alone from the shared first-token logits.
``tests/test_ruler.py`` checks the tokens equal ``alisa.generate``'s, system by system.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from alisa import AlisaCache
from alisa.config import AlisaConfig
from alisa.kv.attention import LogitOptions, alisa_attention, prefill_layer
from alisa.kv.hooks import attached
from alisa.memory import PeakMemory
from alisa.runtime.engine import (
    DecodeState,
    Engine,
    GenerationOutput,
    cache_kv_bytes,
    device_clock,
)
from experiments.systems import HF_QUANTIZED, make_cache, parse_alisa, system_name

FANOUT_ATTENTION = "alisa_fanout"
FANOUT_KEYWORD = "fanout_caches"


def fanout_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Dense prefill attention (B, q, H, D) that also fills every cache in
    ``kwargs["fanout_caches"]`` with this layer's (B, H_kv, q, D) keys and values."""
    caches = kwargs.pop(FANOUT_KEYWORD, None) or []
    options = LogitOptions.take(dict(kwargs))  # alisa_attention takes its own copy from kwargs
    window = kwargs.get("sliding_window")
    output, _ = alisa_attention(
        module, query, key, value, attention_mask, scaling, dropout, **kwargs
    )
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    for cache in caches:
        if not isinstance(cache, AlisaCache):
            cache.update(key, value, module.layer_idx)
            continue
        layer = cache.layers[module.layer_idx]
        if window != layer.keeper.window:
            raise ValueError(
                f"layer {module.layer_idx} attends with sliding_window={window!r} but its cache "
                f"keeps window={layer.keeper.window!r}"
            )
        layer.update(key, value)
        prefill_layer(layer, query, key, attention_mask, scaling, options)
    return output, None


AttentionInterface.register(FANOUT_ATTENTION, fanout_attention)
AttentionMaskInterface.register(FANOUT_ATTENTION, sdpa_mask)


def check_system(system: str, overrides: dict | None = None) -> None:
    """Refuse, before any work, a system :func:`system_cache` would refuse (no model needed).

    Raises
    ------
    ValueError
        As :func:`system_cache`, naming the system.
    """
    if system == "alisa" or system.startswith("alisa:"):
        config = parse_alisa(system).with_overrides(**(overrides or {}))
        _check_untiered(config)
    elif system != "hf-dynamic" and system not in HF_QUANTIZED:
        raise ValueError(
            f"unknown system {system!r}; use hf-dynamic, {', '.join(HF_QUANTIZED)} or alisa:..."
        )
    elif overrides:
        raise ValueError(
            f"system {system!r} is an HF cache: AlisaConfig fields {sorted(overrides)} do not "
            "apply to it (name alisa systems in sweep.system instead)"
        )


def _check_untiered(config: AlisaConfig) -> None:
    if config.gpu_memory is not None or config.host_memory is not None:
        raise ValueError(
            f"system {system_name(config)!r}: gpu_memory/host_memory tiers are not measured by "
            "the shared prefill (a tier that recomputes needs each layer's attention input, "
            "which it does not hand over); leave them out"
        )


def system_cache(system: str, model, *, max_new_tokens: int, overrides: dict | None = None):
    """An empty cache for ``system`` (an :mod:`experiments.systems` name), AlisaConfig fields in
    ``overrides`` applied to an ``alisa`` system.

    Raises
    ------
    ValueError
        An unknown system, overrides for an HF cache, or device/host tiers (``gpu_memory``,
        ``host_memory``).
    """
    check_system(system, overrides)
    cache, config = make_cache(system, model)
    if config is None:
        return cache
    config = config.with_overrides(**(overrides or {}))
    return AlisaCache(model, config, max_new_tokens=max_new_tokens)


def system_label(system: str, overrides: dict | None = None) -> str:
    """The canonical name of a system (``hf-...`` as given, an ``alisa`` one with every
    non-default field, overrides applied) that :func:`system_cache` reads back."""
    if system != "alisa" and not system.startswith("alisa:"):
        return system
    return system_name(parse_alisa(system).with_overrides(**(overrides or {})))


@torch.inference_mode()
def shared_prefill(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, caches: Sequence[Cache]
) -> tuple[torch.Tensor, float]:
    """Prefill (B, L) ``input_ids`` once into every empty cache of ``caches``.

    Returns
    -------
    tuple
        ((B, V) logits of the last prompt position, seconds of the forward pass).
    """
    state = DecodeState.start(input_ids, attention_mask)
    previous = model.config._attn_implementation
    device = input_ids.device
    model.set_attn_implementation(FANOUT_ATTENTION)
    try:
        start = device_clock(device)
        logits = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=state.positions,
            use_cache=False,
            logits_to_keep=1,
            **{FANOUT_KEYWORD: list(caches)},
        ).logits[:, -1, :]
        return logits, device_clock(device) - start
    finally:
        model.set_attn_implementation(previous)


def tier_bytes(cache: Cache) -> dict[str, int]:
    """KV bytes a cache holds per tier (an HF cache: all on the device)."""
    if isinstance(cache, AlisaCache):
        return cache.tier_bytes()
    return {"device": cache_kv_bytes(cache), "host": 0}


@torch.inference_mode()
def decode_after_prefill(
    model,
    tokenizer,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache: Cache,
    logits: torch.Tensor,
    *,
    max_new_tokens: int,
    prefill_s: float = 0.0,
    prune: bool = False,
    observe: Callable[[torch.Tensor], None] | None = None,
) -> GenerationOutput:
    """Greedy decode from a prefilled ``cache`` and its prefill's (B, V) ``logits``, as
    :func:`alisa.generate` decodes (EOS stops a row; step times, KV bytes per tier, peak memory
    of the decode). ``prune``: finished rows leave the batch (``generate(prune_finished=True)``).
    ``observe``: shown each step's (B, V) logits before its tokens are chosen."""
    engine = Engine(model, tokenizer)
    state = DecodeState.start(input_ids, attention_mask)
    with attached(model), PeakMemory(input_ids.device) as memory:
        result = engine.run(
            state,
            cache,
            max_new_tokens,
            prune=prune,
            prefill_logits=logits,
            prefill_s=prefill_s,
            observe=observe,
        )
    result.peak_memory_bytes = memory.peak_bytes
    return result
